"""The kernels' view of a call's mods, as data: a traced mod's node list (`Node`,
`KernelMods`) and an FA4-form mod's spec (`Fa4Spec`), what the blocks emit and the compile key
hashes. Built by `flash_cute.variants` (the tracer, the derivative, the FA4-form registry);
read by `flash_cute.blocks` (`graph_mods`, `fa4_mods`, `score`). Plain Python: no torch, no
CuTe DSL."""

import hashlib
from typing import Callable, NamedTuple, Optional

INPUTS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_INPUTS = INPUTS[1:]
# Inputs only flash-cute's built-in mods use (a traced mod has FlexAttention's five): the
# sequence's used lengths, for masks and biases aligned bottom-right.
LENGTH_INPUTS = ("seqlen_q", "seqlen_k")


class Node(NamedTuple):
    """One graph node: ``op`` is an input name ("score", "b", ...), "const" (``args`` =
    (value,)), "load" (``args`` = (aux index, index nodes...)) or an `OPS` name over earlier
    nodes (``args``: their indices)."""
    op: str
    args: tuple


class KernelMods(NamedTuple):
    """What a kernel compiles of a call's mods (`kernel_mods`): one node list holding the score
    mod, its derivative in the score and the mask mod, their output nodes (None where absent;
    `score_grad` None where the derivative is identically 1, as for any additive bias), and
    each captured tensor's (dtype name, rank). Python values only: hashable, the compile key's
    part (`key`)."""
    nodes: tuple
    score: Optional[int]
    score_grad: Optional[int]
    mask: Optional[int]
    aux: tuple
    # With a block mask: FlexAttention's rule per element (`_block_rule`), for kernel tiles
    # that straddle its blocks, and its (rows, cols) block size.
    block_rule: Optional[int] = None
    block_size: tuple = ()
    # A backward's gradients of learnable captured tensors: per load of one, (its aux index,
    # the load node, the node of d(score mod)/d(load)); each such tensor's fp32 gradient is
    # an aux field after the captured tensors, in `grad_slots` order.
    aux_grads: tuple = ()

    @property
    def grad_slots(self) -> tuple:
        """The aux indices of the tensors with gradients, each once, by first load."""
        return tuple(dict.fromkeys(a for a, _, _ in self.aux_grads))

    @property
    def sparse(self) -> bool:
        return self.block_rule is not None

    def key(self) -> str:
        # Without gradients, the fields before `aux_grads` alone: the keys (and the disk
        # cache's entries) of every other mods kernel stay as they were.
        fields = tuple(self) if self.aux_grads else tuple(self)[:-1]
        return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def input_reads(nodes: tuple) -> tuple:
    """Per node, the inputs of `INPUTS` it reads, transitively (a load by its indices)."""
    out = []
    for node in nodes:
        deps = node.args[1:] if node.op == "load" else (() if node.op == "const" else node.args)
        level = {node.op} if node.op in INPUTS else set()
        for i in deps:
            level |= out[i]
        out.append(frozenset(level))
    return tuple(out)


class Fa4Spec(NamedTuple):
    """What a kernel compiles of a call's FA4-form mods: the functions (compile-time), each
    captured tensor's (dtype name, rank), the functions' identity hash and each aux scalar's
    DSL type name ("Int32" or "Float32"; their values are run-time)."""
    score_mod: Optional[Callable]
    mask_mod: Optional[Callable]
    score_mod_bwd: Optional[Callable]
    aux: tuple
    ident: str
    scalars: tuple = ()
    # With a block mask: its (rows, cols) block size; its block-level states are the last
    # aux tensor (int32 [B or 1, H or 1, query blocks, key blocks]).
    block_size: tuple = ()

    # The fields the kernels read of a traced spec (`KernelMods`).
    @property
    def sparse(self) -> bool:
        return bool(self.block_size)

    @property
    def block_rule(self):
        """FlexAttention's rule per element, for tiles that straddle blocks (`Fa4Mods.apply`'s
        mask "rule")."""
        return "rule" if self.sparse else None

    @property
    def score(self):
        return None if self.score_mod is None else 0

    @property
    def score_grad(self):
        """Not None where the backward takes the derivative (any score mod: it is not known
        to be 1)."""
        return self.score

    @property
    def mask(self):
        return None if self.mask_mod is None else 0

    def key(self) -> str:
        return hashlib.sha256(repr((self.ident, self.aux, self.scalars, self.block_size))
                              .encode()).hexdigest()[:16]
