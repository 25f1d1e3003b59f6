"""What the kernels compile of a call's mods: `kernel_mods` turns a registered
`registry.CallMods` into a `KernelMods` (`flash_cute.contract.mods`: one node list, the
derivative where it is not 1, the captured tensors' dtypes and ranks, the learnable loads'
derivatives) and refuses what the kernels cannot read (`MAX_AUX`, `AUX_DTYPES`);
`aux_for_kernel` makes a captured tensor kernel-ready.

`CallMods` is named as a string only: the registry imports this module (its limits), so this
one does not import the registry.
"""

from typing import Optional

import torch

from flash_cute.contract.mods import MASK_INPUTS, KernelMods, Node, input_reads
from flash_cute.variants.derivative import learnable_loads, load_derivative, score_derivative
from flash_cute.variants.tracer import OPS, ModGraph, UnsupportedMod

# The kernels' limits: captured tensors per call, their dtypes (bool is read as uint8, int64
# values as int32), and the exponents `pow` takes (constants only).
MAX_AUX = 4
AUX_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
              torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.bool: "u8"}


def kernel_mods(variant: "CallMods", grads: bool = False) -> tuple:  # noqa: F821
    """(`KernelMods`, the captured tensors in its aux order) of a registered `CallMods` (FA4-form
    mods: their `contract.mods.Fa4Spec` and the call's aux tensors); `grads`: a backward's, with the
    derivatives of the learnable loads (`derivative.learnable_loads`); raises `UnsupportedMod`
    for what the kernels cannot run (too many captured tensors, a dtype outside `AUX_DTYPES`,
    `pow` with an exponent that is not a constant, a learnable load whose derivative reads the
    score)."""
    if variant.fa4 is not None:
        tensors = [ref() for ref in variant.aux_tensors]
        # A block mask's states: the last aux tensor (`Fa4Spec.block_size`).
        return variant.fa4, tensors + ([variant.block_states] if variant.fa4.sparse else [])
    nodes, aux, outputs = [], [], {}
    score = variant.score_mod
    aux_grads = ()
    if score is not None:
        grad = score_derivative(score)
        base = _merge(nodes, aux, grad)
        outputs["score"] = base + score.output
        constant_one = (grad.nodes[grad.output].op == "const"
                        and grad.nodes[grad.output].args[0] == 1.0)
        outputs["score_grad"] = None if constant_one else base + grad.output
        if grads:
            aux_grads = _load_grads(nodes, aux, score)
    if variant.mask_mod is not None:
        outputs["mask"] = _merge(nodes, aux, variant.mask_mod) + variant.mask_mod.output
    if variant.block_states is not None:
        outputs["block_rule"] = _block_rule(nodes, aux, variant, outputs.get("mask"))
    for node in nodes:
        if node.op == "pow" and nodes[node.args[1]].op != "const":
            raise UnsupportedMod("the kernels raise to constant powers only (x ** 2, x ** 0.5)")
    if len(aux) > MAX_AUX:
        raise UnsupportedMod(f"the mods capture {len(aux)} tensors; the kernels take at most "
                             f"{MAX_AUX} (stack them into one)")
    slots = len(dict.fromkeys(a for a, _, _ in aux_grads))
    if len(aux) + slots > MAX_AUX:
        raise UnsupportedMod(f"the mods capture {len(aux)} tensors, {slots} of them learnable, "
                             f"whose gradients take a slot each; the kernels take at most "
                             f"{MAX_AUX} in all")
    sig = []
    for t in aux:
        if t.dtype not in AUX_DTYPES:
            raise UnsupportedMod(f"a mod loads from a {t.dtype} tensor; the kernels read "
                                 f"{', '.join(sorted(str(d) for d in AUX_DTYPES))}")
        sig.append((AUX_DTYPES[t.dtype], t.dim()))
    spec = KernelMods(tuple(nodes), outputs.get("score"), outputs.get("score_grad"),
                      outputs.get("mask"), tuple(sig), outputs.get("block_rule"),
                      tuple(int(x) for x in variant.block_size or ()), aux_grads)
    return spec, tuple(aux)


def _load_grads(nodes: list, aux: list, score: ModGraph) -> tuple:
    """Append d(score mod)/d(load) of each learnable load to `nodes`: ((aux index, load node,
    derivative node), ...). The backward computes them after dS, when the score itself is
    gone: a derivative that reads it is refused."""
    out = []
    levels = input_reads(score.nodes)
    for load in learnable_loads(score):
        if any("score" in levels[i] for i in score.nodes[load].args[1:]):
            raise UnsupportedMod(
                "a learnable captured tensor is indexed by a value of the score (e.g. "
                "table[h, score > 0]); the kernels accumulate gradients at indices of b, h, "
                "q_idx and kv_idx: detach the tensor")
        d = load_derivative(score, load)
        reads = {i for i, lv in enumerate(input_reads(d.nodes)) if "score" in lv}
        if d.output in reads:
            raise UnsupportedMod(
                "a learnable captured tensor's derivative depends on the score (e.g. "
                "score * w[h]); the kernels accumulate gradients of terms added to it (a "
                "bias: w[h] * (q_idx - kv_idx), bias[q_idx - kv_idx]): detach the tensor or "
                "write the mod as a bias")
        base = _merge(nodes, aux, d)
        slot = next(i for i, a in enumerate(aux) if a is score.aux[score.nodes[load].args[0]])
        out.append((slot, base + load, base + d.output))
    return tuple(out)


def _block_rule(nodes: list, aux: list, variant: "CallMods",  # noqa: F821
                mask: Optional[int]) -> int:
    """Append FlexAttention's rule per element to `nodes`: visible iff the element's block is
    full, or partial and the mask mod (output node `mask`; None: none) says so; the block
    states are a captured tensor [B or 1, H or 1, query blocks, key blocks]."""
    states = variant.block_states
    if not any(a is states for a in aux):
        aux.append(states)
    index = next(i for i, a in enumerate(aux) if a is states)

    def add(op, *args):
        nodes.append(Node(op, args))
        return len(nodes) - 1

    at = {name: add(name) for name in MASK_INPUTS}
    zero = add("const", 0)
    b = at["b"] if states.shape[0] > 1 else zero
    h = at["h"] if states.shape[1] > 1 else zero
    q_block = add("floordiv", at["q_idx"], add("const", int(variant.block_size[0])))
    k_block = add("floordiv", at["kv_idx"], add("const", int(variant.block_size[1])))
    state = add("load", index, b, h, q_block, k_block)
    full = add("eq", state, add("const", 2))
    partial = add("eq", state, add("const", 1))
    return add("or", full, partial if mask is None else add("and", partial, mask))


def _merge(nodes: list, aux: list, graph: ModGraph) -> int:
    """Append `graph`'s nodes to `nodes` (indices shifted, its captured tensors joined to
    `aux` by identity); returns the offset of its first node."""
    base = len(nodes)
    remap = []
    for t in graph.aux:
        found = next((i for i, a in enumerate(aux) if a is t), None)
        if found is None:
            aux.append(t)
            found = len(aux) - 1
        remap.append(found)
    for node in graph.nodes:
        if node.op == "load":
            nodes.append(Node("load", (remap[node.args[0]],
                                       *[base + i for i in node.args[1:]])))
        elif node.op in OPS:
            nodes.append(Node(node.op, tuple(base + i for i in node.args)))
        else:
            nodes.append(node)
    return base


def aux_for_kernel(t: torch.Tensor) -> torch.Tensor:
    """A captured tensor as a kernel reads it: contiguous (its fake tensor's unit last stride),
    bool as uint8 (a view), detached (DLPack refuses a tensor that requires grad)."""
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t
