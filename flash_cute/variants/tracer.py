"""Score and mask modifications in FlexAttention's form, traced into a small op graph.

A score mod is a plain torch function ``score_mod(score, b, h, q_idx, kv_idx) -> score`` and a
mask mod ``mask_mod(b, h, q_idx, kv_idx) -> bool``, the very functions a user passes to
`torch.nn.attention.flex_attention`, with captured tensors (``slopes[h]``,
``bias[q_idx - kv_idx]``). `trace` records one with torch.fx into a `ModGraph`: a list of
nodes over the five inputs, constants and loads from the captured tensors, in a documented
op subset (`OPS`); anything else is refused with the op's name. The graph is what every
implementation runs: `evaluate` (torch, on broadcast index grids: the reference and the CPU
operator), `score_derivative` (d out / d score, generated from the same graph, so no
hand-written backward is needed) and, next, the kernels' code.

Semantics, shared by every implementation:

* ``score`` is the scaled score q·k · softmax_scale; the mod's result goes to the softmax.
* ``b`` is the batch entry (the sequence, for the packed layout), ``h`` the query head,
  ``q_idx`` / ``kv_idx`` the positions inside the sequence; all int32.
* A load from a captured tensor clamps each index into the tensor's extent, so no index
  arithmetic reads outside it.
"""

import collections
import functools
import operator
import weakref
from typing import Callable, NamedTuple, Optional

import torch

from flash_cute.contract.mods import (INPUTS, LENGTH_INPUTS, MASK_INPUTS, KernelMods, Node,  # noqa: F401
                                     input_reads)


# Graph op -> (arity, torch implementation). Loads ("load") and constants are nodes of their own.
OPS = {
    "add": (2, torch.add), "sub": (2, torch.sub), "mul": (2, torch.mul),
    "div": (2, torch.div), "floordiv": (2, lambda a, b: torch.div(a, b, rounding_mode="floor")),
    "mod": (2, torch.remainder), "pow": (2, torch.pow),
    "minimum": (2, torch.minimum), "maximum": (2, torch.maximum),
    "lt": (2, torch.lt), "le": (2, torch.le), "gt": (2, torch.gt), "ge": (2, torch.ge),
    "eq": (2, torch.eq), "ne": (2, torch.ne),
    "and": (2, torch.logical_and), "or": (2, torch.logical_or),
    "neg": (1, torch.neg), "not": (1, torch.logical_not), "abs": (1, torch.abs),
    "exp": (1, torch.exp), "log": (1, torch.log), "tanh": (1, torch.tanh),
    "sigmoid": (1, torch.sigmoid), "sqrt": (1, torch.sqrt),
    "where": (3, torch.where),
}

# torch.fx targets -> graph ops.
_FUNCTIONS = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.floordiv: "floordiv", operator.mod: "mod", operator.pow: "pow",
    operator.neg: "neg", operator.lt: "lt", operator.le: "le", operator.gt: "gt",
    operator.ge: "ge", operator.eq: "eq", operator.ne: "ne", operator.and_: "and",
    operator.or_: "or", operator.invert: "not", operator.abs: "abs", operator.getitem: "load",
    torch.add: "add", torch.sub: "sub", torch.mul: "mul", torch.div: "div",
    torch.neg: "neg", torch.abs: "abs", torch.exp: "exp", torch.log: "log",
    torch.tanh: "tanh", torch.sigmoid: "sigmoid", torch.sqrt: "sqrt", torch.where: "where",
    torch.minimum: "minimum", torch.maximum: "maximum", torch.logical_and: "and",
    torch.logical_or: "or", torch.logical_not: "not",
}
_METHODS = {"exp": "exp", "log": "log", "tanh": "tanh", "sigmoid": "sigmoid", "abs": "abs",
            "sqrt": "sqrt", "neg": "neg", "__getitem__": "load"}
_BOOL = {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"}


class ModGraph(NamedTuple):
    """A traced mod: nodes in order, the output node, and the captured tensors it loads."""
    nodes: tuple
    output: int
    aux: tuple
    kind: str  # "score" or "mask"

    def uses(self, name: str) -> bool:
        return any(n.op == name for n in self.nodes)


class UnsupportedMod(TypeError):
    """A mod uses an operation outside `OPS` (or a form of one the kernels cannot run)."""


def trace(fn: Callable, kind: str = "score") -> ModGraph:
    """The `ModGraph` of a FlexAttention-form score mod (``kind="score"``) or mask mod
    (``"mask"``); raises `UnsupportedMod` naming what is outside the op subset."""
    import torch.fx

    names = INPUTS if kind == "score" else MASK_INPUTS
    try:
        tracer = _tracer_class()()
        graph = tracer.trace(_positional(fn, len(names)))
        gm = torch.fx.GraphModule(tracer.root, graph)
    except UnsupportedMod:
        raise
    except Exception as exc:
        raise UnsupportedMod(f"{kind}_mod {getattr(fn, '__name__', fn)!r} could not be traced "
                             f"({type(exc).__name__}: {exc}); mods are traced with torch.fx: "
                             "no data-dependent Python control flow (use torch.where)") from exc
    return _Builder(gm, names, kind).build()


@functools.lru_cache(maxsize=None)
def _tracer_class():
    import torch.fx

    class Tracer(torch.fx.Tracer):
        """torch.fx's tracer, taking captured `nn.Parameter`s (a learnable bias, ALiBi slopes)
        as it takes captured tensors: fx looks a parameter up among its root module's, which a
        traced function has none of."""

        def create_arg(self, a):
            if isinstance(a, torch.nn.Parameter) and not any(
                    a is p for p in self.root.parameters()):
                self.root.register_parameter(f"_captured_{len(list(self.root.parameters()))}", a)
            return super().create_arg(a)

    return Tracer


def _positional(fn: Callable, arity: int) -> Callable:
    """`fn` behind a wrapper with exactly `arity` positional parameters (fx traces by them)."""
    args = ", ".join(f"a{i}" for i in range(arity))
    scope = {"fn": fn}
    exec(f"def mod({args}):\n    return fn({args})\n", scope)  # noqa: S102 - fixed template
    return scope["mod"]


class _Builder:
    def __init__(self, gm, names, kind):
        self.gm, self.names, self.kind = gm, names, kind
        self.nodes, self.aux, self.index = [], [], {}

    def build(self) -> ModGraph:
        output = None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.index[node] = self._add(self.names[len(self.index)], ())
            elif node.op == "get_attr":
                self.index[node] = ("aux", self._aux(getattr(self.gm, node.target)))
            elif node.op in ("call_function", "call_method"):
                self.index[node] = self._call(node)
            elif node.op == "output":
                output = self._value(node.args[0])
        if isinstance(output, tuple) or output is None:
            raise UnsupportedMod(f"{self.kind}_mod must return a value computed from its inputs")
        return ModGraph(tuple(self.nodes), output, tuple(self.aux), self.kind)

    def _add(self, op, args) -> int:
        self.nodes.append(Node(op, tuple(args)))
        return len(self.nodes) - 1

    def _aux(self, tensor) -> int:
        for i, t in enumerate(self.aux):
            if t is tensor:
                return i
        self.aux.append(tensor)
        return len(self.aux) - 1

    def _value(self, arg) -> int:
        """The node index of an fx argument (a node, or a Python number made a constant)."""
        if isinstance(arg, (bool, int, float)):
            return self._add("const", (arg,))
        if isinstance(arg, torch.Tensor) and arg.dim() == 0:
            return self._add("const", (arg.item(),))
        value = self.index.get(arg)
        if value is None or isinstance(value, tuple):
            raise UnsupportedMod(f"{self.kind}_mod uses {arg!r} as a value; captured tensors "
                                 "may only be indexed (e.g. bias[q_idx - kv_idx])")
        return value

    def _call(self, node) -> int:
        target = node.target
        op = (_FUNCTIONS.get(target) if node.op == "call_function" else _METHODS.get(target))
        if op is None:
            name = getattr(target, "__name__", str(target))
            raise UnsupportedMod(
                f"{self.kind}_mod uses {name!r}, which flash-cute's mods do not support; "
                f"supported: {', '.join(sorted(OPS))} (and their operators), indexing of "
                "captured tensors, Python numbers")
        if node.kwargs:
            raise UnsupportedMod(f"{self.kind}_mod passes keyword arguments to {op!r}")
        if op == "load":
            return self._load(node)
        arity = OPS[op][0]
        if len(node.args) != arity:
            raise UnsupportedMod(f"{self.kind}_mod calls {op!r} with {len(node.args)} "
                                 f"arguments, not {arity}")
        return self._add(op, [self._value(a) for a in node.args])

    def _load(self, node) -> int:
        base, index = node.args
        source = self.index.get(base)
        if not (isinstance(source, tuple) and source[0] == "aux"):
            raise UnsupportedMod(f"{self.kind}_mod indexes a computed value; only captured "
                                 "tensors may be indexed")
        tensor = self.aux[source[1]]
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != tensor.dim():
            raise UnsupportedMod(f"{self.kind}_mod indexes a {tensor.dim()}-D captured tensor "
                                 f"with {len(index)} indices; index every dimension")
        if tensor.dtype.is_complex:
            raise UnsupportedMod(f"{self.kind}_mod loads from a complex tensor")
        return self._add("load", (source[1], *[self._value(i) for i in index]))


def evaluate(graph: ModGraph, inputs: dict, aux: Optional[tuple] = None):
    """The graph's output on broadcastable torch tensors `inputs` (by input name); `aux`
    replaces the captured tensors (same shapes), e.g. moved to another device."""
    return _tensor(values(graph, inputs, aux)[graph.output])


def values(graph: ModGraph, inputs: dict, aux: Optional[tuple] = None) -> list:
    """Every node's value, as `evaluate` computes them."""
    aux = graph.aux if aux is None else aux
    out = []
    for node in graph.nodes:
        if node.op in INPUTS or node.op in LENGTH_INPUTS:
            out.append(inputs[node.op])
        elif node.op == "const":
            out.append(node.args[0])
        elif node.op == "load":
            out.append(_load(aux[node.args[0]], [out[i] for i in node.args[1:]]))
        else:
            out.append(OPS[node.op][1](*[_tensor(out[i]) for i in node.args]))
    return out


def accumulate_load_grads(graph: ModGraph, inputs: dict, ds, grads: dict) -> None:
    """Add d(loss)/d(captured tensor) for each of `learnable_loads(graph)` into `grads` (by
    the tensor's id: a float tensor of its shape): ``ds`` [b, h, sq, sk] is d(loss)/d(the
    mod's output); each element adds ds · d(output)/d(load) at the load's clamped index, as
    the kernels' atomics do."""
    aux = tuple(t.detach().to(ds.device) for t in graph.aux)
    vals = values(graph, inputs, aux)
    for load in learnable_loads(graph):
        node = graph.nodes[load]
        tensor, grad = graph.aux[node.args[0]], grads[id(graph.aux[node.args[0]])]
        factor = evaluate(load_derivative(graph, load), inputs, aux)
        contrib = ds * torch.broadcast_to(torch.as_tensor(factor, dtype=ds.dtype,
                                                          device=ds.device), ds.shape)
        index = []
        for dim, i in enumerate(node.args[1:]):
            idx = torch.as_tensor(_tensor(vals[i]), device=ds.device).to(torch.int64)
            index.append(torch.broadcast_to(idx.clamp(0, tensor.shape[dim] - 1), ds.shape))
        grad.index_put_(tuple(i.reshape(-1) for i in index), contrib.reshape(-1).to(grad.dtype),
                        accumulate=True)


def _tensor(value):
    """A tensor of a value; Python floats become float64 0-d tensors, which keep a constant
    exact without widening the dimensioned tensors they meet (type promotion)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else None)


def _load(tensor: torch.Tensor, index: list):
    """tensor[index] with each index clamped into its dimension (the kernels' rule)."""
    clamped = []
    for dim, i in enumerate(index):
        i = _tensor(i).to(torch.int64, copy=False) if not isinstance(i, int) else torch.tensor(i)
        clamped.append(i.clamp(0, tensor.shape[dim] - 1).to(tensor.device))
    return tensor[tuple(clamped)]


def score_derivative(graph: ModGraph) -> ModGraph:
    """The graph of d(score_mod)/d(score), over the same inputs and captured tensors,
    from each op's rule (a load, a comparison and an index are constant in the score)."""
    if graph.kind != "score":
        raise ValueError("only a score mod has a derivative")
    return derivative(graph, lambda i, node: node.op == "score")


def load_derivative(graph: ModGraph, load: int) -> ModGraph:
    """The graph of d(score_mod)/d(the value node `load` reads from a captured tensor): the
    factor of that tensor's gradient at the element's (clamped) index."""
    if graph.nodes[load].op != "load":
        raise ValueError(f"node {load} is not a load")
    return derivative(graph, lambda i, node: i == load)


def derivative(graph: ModGraph, wrt: Callable) -> ModGraph:
    """The graph of d(output)/d(x), x the nodes `wrt(index, node)` picks (each counting as x
    itself), by forward differentiation: every other input, constant and load is constant."""
    nodes = list(graph.nodes)
    zero = _append(nodes, Node("const", (0.0,)))
    one = _append(nodes, Node("const", (1.0,)))
    deriv = {}
    for i, node in enumerate(graph.nodes):
        deriv[i] = one if wrt(i, node) else _rule(nodes, node, i, deriv, zero, one)
    return ModGraph(tuple(nodes), deriv[graph.output], graph.aux, graph.kind)


def learnable_loads(graph: Optional[ModGraph]) -> tuple:
    """The load nodes of a score mod that read a floating-point captured tensor requiring
    grad (a learnable bias, ALiBi slopes): their tensors get gradients."""
    if graph is None or graph.kind != "score":
        return ()
    return tuple(i for i, n in enumerate(graph.nodes) if n.op == "load"
                 and graph.aux[n.args[0]].is_floating_point()
                 and graph.aux[n.args[0]].requires_grad)


def learnable(variant: Optional["Variant"]) -> tuple:
    """The captured tensors of a call's mods that get gradients, in the order the backward
    returns them (first load first; each tensor once)."""
    if variant is None or variant.fa4 is not None:
        return ()
    graph = variant.score_mod
    out = []
    for i in learnable_loads(graph):
        t = graph.aux[graph.nodes[i].args[0]]
        if not any(t is o for o in out):
            out.append(t)
    return tuple(out)


def _append(nodes: list, node: Node) -> int:
    nodes.append(node)
    return len(nodes) - 1


def _rule(nodes, node, i, deriv, zero, one) -> int:
    op, args = node.op, node.args
    if (op in INPUTS or op in LENGTH_INPUTS or op in ("const", "load") or op in _BOOL
            or op in ("floordiv", "mod")):
        return zero
    d = [deriv[a] for a in args]
    if op != "where" and all(x == zero for x in d):
        return zero

    def new(o, *a):
        return _append(nodes, Node(o, a))

    if op in ("add", "sub"):
        return d[0] if d[1] == zero else (new("neg", d[1]) if op == "sub" and d[0] == zero
                                          else new(op, d[0], d[1]) if d[0] != zero else d[1])
    if op == "neg":
        return new("neg", d[0])
    if op == "mul":
        a, b = args
        terms = [new("mul", d[0], b)] if d[0] != zero else []
        terms += [new("mul", a, d[1])] if d[1] != zero else []
        return terms[0] if len(terms) == 1 else new("add", *terms)
    if op == "div":
        a, b = args
        if d[1] == zero:
            return new("div", d[0], b)
        quotient = new("div", new("mul", a, d[1]), new("mul", b, b))
        return new("neg", quotient) if d[0] == zero else new("sub", new("div", d[0], b), quotient)
    if op == "pow":
        if d[1] != zero:
            raise UnsupportedMod("score_mod raises to a power that depends on the score")
        a, n = args
        lower = (_append(nodes, Node("const", (nodes[n].args[0] - 1,)))
                 if nodes[n].op == "const" else new("sub", n, one))
        return new("mul", new("mul", n, new("pow", a, lower)), d[0])
    if op == "exp":
        return new("mul", i, d[0])
    if op == "log":
        return new("div", d[0], args[0])
    if op == "tanh":
        return new("mul", new("sub", one, new("mul", i, i)), d[0])
    if op == "sigmoid":
        return new("mul", new("mul", i, new("sub", one, i)), d[0])
    if op == "sqrt":
        return new("div", d[0], new("mul", _append(nodes, Node("const", (2.0,))), i))
    if op == "abs":
        sign = new("where", new("lt", args[0], zero), new("neg", one), one)
        return new("mul", sign, d[0])
    if op in ("minimum", "maximum"):
        a, b = args
        pick_a = new("le" if op == "minimum" else "ge", a, b)
        return new("where", pick_a, d[0], d[1])
    if op == "where":
        return zero if d[1] == d[2] == zero else new("where", args[0], d[1], d[2])
    raise UnsupportedMod(f"no derivative rule for {op!r}")


# The kernels' limits: captured tensors per call, their dtypes (bool is read as uint8, int64
# values as int32), and the exponents `pow` takes (constants only).
MAX_AUX = 4
AUX_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
              torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.bool: "u8"}


def kernel_mods(variant: "Variant", grads: bool = False) -> tuple:
    """(`KernelMods`, the captured tensors in its aux order) of a registered `Variant` (FA4-form
    mods: their `fa4_mods.Fa4Spec` and the call's aux tensors); `grads`: a backward's, with the
    derivatives of the learnable loads (`learnable_loads`); raises `UnsupportedMod` for what
    the kernels cannot run (too many captured tensors, a dtype outside `AUX_DTYPES`, `pow`
    with an exponent that is not a constant, a learnable load whose derivative reads the
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


def _block_rule(nodes: list, aux: list, variant: "Variant", mask: Optional[int]) -> int:
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


def index_grids(batch_index, heads: int, seqlen_q: int, seqlen_k: int, device=None) -> dict:
    """Broadcastable int32 grids of b [B, 1, 1, 1], h [1, H, 1, 1], q_idx [1, 1, Q, 1] and
    kv_idx [1, 1, 1, K] (`batch_index`: an int, or a list of batch entries)."""
    b = torch.tensor(batch_index if isinstance(batch_index, list) else [batch_index],
                     dtype=torch.int32, device=device)
    return {"b": b.view(-1, 1, 1, 1),
            "h": torch.arange(heads, dtype=torch.int32, device=device).view(1, -1, 1, 1),
            "q_idx": torch.arange(seqlen_q, dtype=torch.int32, device=device).view(1, 1, -1, 1),
            "kv_idx": torch.arange(seqlen_k, dtype=torch.int32, device=device).view(1, 1, 1, -1)}


def alibi_graph(slopes: torch.Tensor) -> ModGraph:
    """FlashAttention-2's ALiBi as a score mod: score − slope · |q_idx + seqlen_k − seqlen_q −
    kv_idx| (bottom-right aligned), slopes fp32 [nheads] or [batch, nheads]."""
    nodes = [Node(name, ()) for name in INPUTS + LENGTH_INPUTS]   # 0..6
    at = {name: i for i, name in enumerate(INPUTS + LENGTH_INPUTS)}

    def add(op, *args):
        nodes.append(Node(op, args))
        return len(nodes) - 1

    index = (at["h"],) if slopes.dim() == 1 else (at["b"], at["h"])
    slope = add("load", 0, *index)
    shift = add("sub", add("add", at["q_idx"], at["seqlen_k"]), at["seqlen_q"])
    distance = add("abs", add("sub", shift, at["kv_idx"]))
    out = add("sub", at["score"], add("mul", slope, distance))
    return ModGraph(tuple(nodes), out, (slopes,), "score")


class Variant(NamedTuple):
    """A call's modifications: the traced graphs (None where absent) and a block mask's
    per-block states (`flash_cute.variants.block_mask.block_states`) with its block size; or FA4-form
    mods (`fa4`: a `fa4_mods.Fa4Spec`) with weak references to the call's aux tensors."""
    score_mod: Optional[ModGraph]
    mask_mod: Optional[ModGraph]
    block_states: Optional[torch.Tensor] = None
    block_size: Optional[tuple] = None
    fa4: Optional[object] = None
    aux_tensors: tuple = ()
    aux_scalars: tuple = ()


_REGISTRY = {}
_KEYS = {}
# FA4-form entries apart: `registered` (traced by torch.compile, which reads the dict it
# looks in) then sees the FlexAttention-form ones only, however many scalar values FA4-form
# calls register.
_FA4_KEYS = {}
_NEXT = [1]


def register_alibi(slopes: torch.Tensor, mask_mod: Optional[Callable] = None,
                   block_mask=None) -> int:
    """The registry key of ALiBi with these slopes, with an optional mask mod or block mask
    (kept while the tensor and the block mask live)."""
    ident = ("alibi", id(slopes), mask_mod, None if block_mask is None else id(block_mask))
    return _store(ident, lambda: alibi_graph(slopes), mask_mod, block_mask, (slopes,))


def register(score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None,
             block_mask=None) -> int:
    """The registry key of a call's mods (0 for none), the operators' `variant` argument:
    the same functions (and block mask object) get the same key, traced once. A block mask's
    mask mod stands in for a missing `mask_mod`; its entry goes when the block mask does."""
    if score_mod is None and mask_mod is None and block_mask is None:
        return 0
    ident = (score_mod, mask_mod, None if block_mask is None else id(block_mask))
    return _store(ident, lambda: None if score_mod is None else trace(score_mod, "score"),
                  mask_mod, block_mask, ())


def _store(ident, score_graph: Callable, mask_mod, block_mask, owners: tuple) -> int:
    """The key of `ident`, building its `Variant` the first time; the entry is forgotten when
    any of `owners` (and the block mask) is collected."""
    key = _KEYS.get(ident)
    if key is not None:
        return key
    if mask_mod is None and block_mask is not None:
        mask_mod = block_mask.mask_mod
    states = size = None
    if block_mask is not None:
        from flash_cute.variants.block_mask import block_states

        # int32: the kernels read the states as a captured tensor (`kernel_mods`).
        states, size = block_states(block_mask).to(torch.int32), tuple(block_mask.BLOCK_SIZE)
        owners += (block_mask,)
    variant = Variant(score_graph(), None if mask_mod is None else trace(mask_mod, "mask"),
                      states, size)
    key, _NEXT[0] = _NEXT[0], _NEXT[0] + 1
    _REGISTRY[key] = variant
    _KEYS[ident] = key
    _own(ident, key, owners)
    return key


def _own(ident, key: int, owners: tuple) -> None:
    """The entry goes when any of `owners` is collected; `holders` gives them back while it
    lives."""
    _OWNERS[key] = tuple(weakref.ref(o) for o in owners)
    for owner in owners:
        weakref.finalize(owner, _forget, ident, key)


def holders(key: int) -> tuple:
    """The objects whose collection ends registry entry `key` (its captured tensors, block
    mask, FA4 aux tensors): an autograd context keeps them, so that a backward finds the
    forward's entry even when the caller dropped them (a block mask built inline in the
    call)."""
    return tuple(ref() for ref in _OWNERS.get(key, ()))


_OWNERS = {}


def register_fa4(score_mod: Optional[Callable], mask_mod: Optional[Callable],
                 score_mod_bwd: Optional[Callable], aux_tensors, aux_scalars=None,
                 block_mask=None) -> int:
    """The registry key of FA4-form mods (`flash_cute.blocks.fa4_mods`) with this call's aux tensors
    (kept while they live: FA4 passes them per call, so each list gets its entry and none
    recompiles, the compile key holding their dtypes and ranks only) and aux scalars (their
    values go to the kernels as parameters, the compile key holds their types; the
    `SCALAR_ENTRIES` value sets registered last keep entries); with a block mask (a
    FlexAttention BlockMask, or FA4's tensors as `block_mask.Fa4Blocks`), kept while it lives,
    its block states joining the aux tensors last."""
    from flash_cute.variants.fa4_spec import fa4_spec, scalar_signature

    aux = tuple(aux_tensors or ())
    if len(aux) > MAX_AUX:
        raise UnsupportedMod(f"{len(aux)} aux_tensors; the kernels take at most {MAX_AUX}")
    sig = []
    for t in aux:
        if not isinstance(t, torch.Tensor) or t.dtype not in AUX_DTYPES:
            raise UnsupportedMod(f"aux_tensors hold {getattr(t, 'dtype', type(t).__name__)}; "
                                 f"the kernels read {', '.join(sorted(str(d) for d in AUX_DTYPES))}")
        sig.append((AUX_DTYPES[t.dtype], t.dim()))
    kinds, values = scalar_signature(aux_scalars)
    ident = ("fa4", score_mod, mask_mod, score_mod_bwd, tuple(id(t) for t in aux), kinds,
             values, None if block_mask is None else id(block_mask))
    key = _FA4_KEYS.get(ident)
    if key is not None:
        if ident in _SCALAR_KEYS:
            _SCALAR_KEYS.move_to_end(ident)
        return key
    states = size = None
    owners = tuple(aux)
    if block_mask is not None:
        from flash_cute.variants.block_mask import block_states

        if len(aux) >= MAX_AUX:
            raise UnsupportedMod(f"{len(aux)} aux_tensors and a block mask, whose states take "
                                 f"a slot too; the kernels take at most {MAX_AUX}")
        states, size = block_states(block_mask).to(torch.int32), tuple(block_mask.BLOCK_SIZE)
        sig.append(("i32", 4))
        owners += (block_mask,)
    # Weak references: the entry goes when a tensor does (`_forget`), not kept alive by it.
    variant = Variant(None, None, states, size,
                      fa4=fa4_spec(score_mod, mask_mod, score_mod_bwd, tuple(sig), kinds,
                                   size or ()),
                      aux_tensors=tuple(weakref.ref(t) for t in aux), aux_scalars=values)
    key, _NEXT[0] = _NEXT[0], _NEXT[0] + 1
    _REGISTRY[key] = variant
    _FA4_KEYS[ident] = key
    _own(ident, key, owners)
    if kinds:
        # A scalar that changes every call (a schedule, a temperature) would grow the
        # registry: entries of scalar values go least recently registered first, beyond
        # far more than a forward pass keeps for its backward.
        _SCALAR_KEYS[ident] = key
        while len(_SCALAR_KEYS) > SCALAR_ENTRIES:
            _forget(*_SCALAR_KEYS.popitem(last=False))
    return key


SCALAR_ENTRIES = 4096
_SCALAR_KEYS = collections.OrderedDict()


def _forget(ident, key) -> None:
    _KEYS.pop(ident, None)
    _FA4_KEYS.pop(ident, None)
    _REGISTRY.pop(key, None)
    _OWNERS.pop(key, None)
    _SCALAR_KEYS.pop(ident, None)


def registered(score_mod: Optional[Callable], mask_mod: Optional[Callable],
               block_mask=None) -> Optional[int]:
    """The key `register` gave these, or None (a plain dict lookup: traceable)."""
    return _KEYS.get((score_mod, mask_mod, None if block_mask is None else id(block_mask)))


def lookup(key: int) -> Variant:
    variant = _REGISTRY.get(key)
    if variant is None:
        raise KeyError(f"variant {key} is not registered (keys come from mod_graph.register)")
    return variant
