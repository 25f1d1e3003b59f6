"""The score seam: the one step every kernel takes from raw scores S = Q Kᵀ to what its
softmax (forward) or its P and dS (backward) see.

Three parts, all arch-neutral, on the (rows, cols) view of a thread's scores (`acc_to_mn`):

* a score mod (`ScoreMod`), compile-time: a transform of the scaled scores applied before the
  mask. Softcap, ``cap · tanh(s · scale / cap)``, is the built-in one (`SOFTCAP`); later
  user-written mods plug in here, arch modules untouched.
* `fold_scores` (host side, in a kernel's `__call__`): what the mod folds into the exp2 scale
  and what it keeps for itself (`mod_scale`), so the softmax costs one FFMA and one MUFU.EX2
  per score whatever the mod.
* `Scores` (device side): the mod, then the mask (`AttentionMask`) where the block needs it;
  its backward counterpart is `ScoreMod.grad`, the mod's derivative, which the backward
  blocks apply to dS (`flash_cute.blocks.bwd.p_and_ds`).
* Traced mods (`Variant.mods`, FlexAttention-form score and mask mods): `GRAPH` is their
  `ScoreMod` for the fold, and `tile_scores` binds their graph (`flash_cute.blocks.graph_mods`) to
  a tile's batch entry and head; `Scores` runs it on every visited block, since a mask mod
  may mask anywhere. Their derivative is not a function of the output: the backward asks
  `Scores.prepare` for it in a fragment of its own (`grad_mn`).
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_cute.blocks.dsl_state import DslState
from flash_cute.blocks.fa4_mods import Fa4Mods, Fa4SeqInfo
from flash_cute.blocks.graph_mods import GraphMods
from flash_cute.blocks.mask import AttentionMask
from flash_cute.blocks.softmax import LOG2_E
from flash_cute.contract.block_range import BlockRange, needs_mask
from flash_cute.contract.constants import EMPTY, FULL
from flash_cute.contract.mods import Fa4Spec


class ScoreMod:
    """A transform f of the scores, applied before the mask; masked entries stay -inf.

    `fold(softmax_scale, param)` (host side) returns (scale_log2, mod_scale): the factor the
    softmax's exp2 takes, and the run-time value the mod keeps. `apply(acc_mn, mod_scale)`
    overwrites raw scores with what the softmax sees; `grad(value)` is d(softmax input)/d(raw
    score) divided by the softmax scale (applied to dK and dQ at the end), as a function of
    the value `apply` stored, so the backward keeps S until dS is formed. Without a mod
    (None) the scores go to the mask as they are. `value_grad` False: the derivative is not a
    function of the output (a traced mod's); the backward takes it from `Scores.prepare`."""

    value_grad = True

    def fold(self, softmax_scale: Float32, param: Float32):
        raise NotImplementedError

    def apply(self, acc_mn: cute.Tensor, mod_scale: Float32):
        raise NotImplementedError

    def grad(self, value: Float32) -> Float32:
        raise NotImplementedError


class Softcap(ScoreMod):
    """s ↦ cap · tanh(s · scale / cap). The cap folds into the exp2 scale: the mod stores
    tanh(s · scale / cap) and the softmax runs with scale_log2 = cap · log2 e, so the exp2
    path is the same with and without softcap. Its derivative with respect to s, over the
    scale, is 1 − tanh² (masked entries hold −inf: clamped to −1 their factor is 0, not
    NaN)."""

    def fold(self, softmax_scale: Float32, param: Float32):
        return param * Float32(LOG2_E), softmax_scale / param

    @cute.jit
    def apply(self, acc_mn: cute.Tensor, mod_scale: Float32):
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            acc_mn[r, None].store(cute.math.tanh(acc_mn[r, None].load() * mod_scale,
                                                 fastmath=True))

    def grad(self, value: Float32) -> Float32:
        t = cute.arch.fmax(value, Float32(-1.0))
        return Float32(1.0) - t * t


SOFTCAP = Softcap()


class GraphScore(ScoreMod):
    """The fold of a traced score mod (`flash_cute.blocks.graph_mods`): the mod sees the scaled
    score, so the scale stays with it (`mod_scale`) and the softmax's exp2 takes log2 e alone."""

    value_grad = False

    def fold(self, softmax_scale: Float32, param: Float32):
        return Float32(LOG2_E), softmax_scale


GRAPH = GraphScore()


def score_mod_of(variant) -> Optional[ScoreMod]:
    """The compile-time score mod of a `Variant` (None: scores go to the mask as they are)."""
    if variant.mods is not None and variant.mods.score is not None:
        return GRAPH
    return SOFTCAP if variant.softcap else None


def set_kernel_switches(kernel, variant) -> None:
    """The variant's switches as the attributes the kernels' `const_expr` branches read; the
    softcap switch as the kernel's score mod (`score_mod_of`); `variant` is a
    `contract.variant.Variant`."""
    kernel.causal = variant.causal
    kernel.has_window_left = variant.window_left
    kernel.has_window_right = variant.window_right
    kernel.score_mod = score_mod_of(variant)
    kernel.varlen = variant.varlen
    kernel.has_seqused_q = variant.seqused_q
    kernel.has_seqused_k = variant.seqused_k
    kernel.pack_gqa = variant.pack_gqa
    kernel.dropout = variant.dropout
    kernel.dropout_frame = variant.dropout_frame
    kernel.split_kv = variant.split_kv
    kernel.page_size = variant.page_size
    kernel.append = variant.append
    kernel.ex2_per16 = variant.ex2_per16
    kernel.mods = variant.mods
    kernel.timeline = getattr(variant, "timeline", False)


def aux_tensors(cfg, args):
    """The captured tensors of a kernel's traced mods from its argument record (None
    without)."""
    if cfg.mods is None:
        return None
    # FA4-form mods' aux_scalars follow the tensors (`Fa4Mods` splits them).
    scalars = tuple(getattr(args, f"scalar{i}")
                    for i in range(len(getattr(cfg.mods, "scalars", ()))))
    # A backward's gradients of learnable captured tensors follow them (`GraphMods` splits).
    count = len(cfg.mods.aux) + len(getattr(cfg.mods, "grad_slots", ()))
    return tuple(getattr(args, f"aux{i}") for i in range(count)) + scalars


def tile_scores(cfg, mod_scale: Float32, mask: AttentionMask, aux=None, batch=None,
                head=None, block_states=None, seq=None) -> "Scores":
    """The score seam of one tile: the kernel's score mod and, with traced mods (`cfg.mods`),
    their graph bound to the tile's batch entry and head (packed GQA: its K/V head); with a
    block mask (`KernelMods.sparse`), its tile states (`FwdArgs.block_states`); FA4-form mods
    (`contract.mods.Fa4Spec`) get the tile's sequence (`seq`, a `SeqInfo`) as their seqlen_info."""
    mods = sparse = None
    if cutlass.const_expr(isinstance(cfg.mods, Fa4Spec)):
        mods = Fa4Mods(cfg.mods, aux, batch, head,
                       Fa4SeqInfo(seq.offset_q, seq.offset_k, mask.seqlen_q, mask.seqlen_k),
                       mask.tile_m, mask.tile_n, mask.pack)
    elif cutlass.const_expr(cfg.mods is not None):
        mods = GraphMods(cfg.mods, aux, batch, head, mask.seqlen_q, mask.seqlen_k,
                         mask.tile_m, mask.tile_n, mask.pack)
    if cutlass.const_expr(cfg.mods is not None and cfg.mods.sparse):
        sparse = BlockStates(block_states, batch, head)
    return Scores(cfg.score_mod, mod_scale, mask, mods, sparse)


def block_mask_tensors(cfg, args):
    """(tile states, ranges) of a kernel's block mask from its argument record (None
    without one)."""
    if cfg.mods is None or not cfg.mods.sparse:
        return None
    return args.block_states, args.block_ranges


def block_mask_parts(block_mask) -> tuple:
    """(tile states, ranges) of a kernel's `block_mask_tensors` ((None, None) for None)."""
    return (None, None) if block_mask is None else block_mask


def block_ranges(cfg, ranges, batch, head, block: Int32, full: bool = False):
    """(start, end) of the non-empty tiles a block mask leaves to `block` (a query tile in a
    forward, a key tile in a backward; `FwdArgs.block_ranges`), or None without one; `full`
    (a forward's ranges): with its longest run of full tiles, (start, end, full_start,
    full_end)."""
    if cutlass.const_expr(cfg.mods is None or not cfg.mods.sparse):
        return None
    columns = 4 if full else 2
    return tuple(ranges[batch, head, block, c] for c in range(columns))


class BlockStates(DslState):
    """A block mask's state of each of a kernel's tiles for one (batch entry, head)."""

    def __init__(self, states: cute.Tensor, batch: Int32, head: Int32):
        self.states, self.batch, self.head = states, batch, head

    def at(self, m_block: Int32, n_block: Int32) -> Int32:
        return self.states[self.batch, self.head, m_block, n_block]


def fold_scores(score_mod: Optional[ScoreMod], softmax_scale: Float32, param: Float32):
    """(scale_log2, mod_scale) of a kernel's scores, from its `FwdArgs`/`BwdArgs` scalars
    (`param`: the softcap field). Without a mod: the softmax scale folded into exp2, and a
    mod scale of 1 that nothing reads."""
    if score_mod is None:
        return softmax_scale * Float32(LOG2_E), Float32(1.0)
    return score_mod.fold(softmax_scale, param)


class Scores(DslState):
    """A kernel thread's score step: the mod (when the kernel has one), then the mask."""

    def __init__(self, score_mod: Optional[ScoreMod], mod_scale: Float32, mask: AttentionMask,
                 mods: Optional[GraphMods] = None, sparse: Optional["BlockStates"] = None):
        self.score_mod, self.mod_scale, self.mask, self.mods = score_mod, mod_scale, mask, mods
        self.sparse = sparse

    @property
    def needs_grad(self) -> bool:
        """Whether the backward must take the mod's derivative from `prepare` (`grad_mn`)."""
        return self.mods is not None and self.mods.spec.score_grad is not None

    def ds_hook(self, coord_mn: cute.Tensor, m_block: Int32, n_block: Int32):
        """The backward's use of dS before the mod's derivative
        (`flash_cute.blocks.bwd.p_and_ds`): the gradients of learnable captured tensors
        (`GraphMods.accumulate_grads`); None without."""
        if not getattr(getattr(self.mods, "spec", None), "aux_grads", ()):
            return None
        return lambda ds_mn: self.mods.accumulate_grads(ds_mn, coord_mn, m_block, n_block)

    def tile_state(self, m_block: Int32, n_block: Int32) -> Optional[Int32]:
        """The block mask's state of this tile (None without one), for `prepare`'s `state`:
        a kernel loads it before it issues the tile's GEMMs, so the global load's latency
        hides under them instead of following their wait."""
        if cutlass.const_expr(self.sparse is None):
            return None
        return self.sparse.at(m_block, n_block)

    @cute.jit
    def prepare(self, acc_mn: cute.Tensor, coord_mn: cute.Tensor, m_block: Int32,
                n_block: Int32, rng: Optional[BlockRange] = None,
                masked: cutlass.Constexpr = None, grad_mn: Optional[cute.Tensor] = None,
                state: Optional[Int32] = None):
        """In place, before the softmax (or the backward's P): the mod, then the mask where
        the block needs it (masked entries stay -inf). `masked`: True or False when the
        caller knows, None to ask `needs_mask` at run time, with `rng` (the query block's
        `block_range`, computed here when not given). `grad_mn` (backward, `needs_grad`):
        receives the traced score mod's derivative. `state`: the tile's block-mask state from
        `tile_state` (loaded here when None)."""
        if cutlass.const_expr(self.sparse is not None and masked is False):
            # A block of the unmasked range, inside the block mask's run of full tiles
            # (`block_range.narrow`): the mods with no mask rule.
            self.mods.apply(acc_mn, coord_mn, m_block, n_block, self.mod_scale, grad_mn, None)
        elif cutlass.const_expr(self.sparse is not None):
            self.sparse_mods(acc_mn, coord_mn, m_block, n_block, grad_mn, state)
        elif cutlass.const_expr(self.mods is not None):
            self.mods.apply(acc_mn, coord_mn, m_block, n_block, self.mod_scale, grad_mn)
        elif cutlass.const_expr(self.score_mod is not None):
            self.score_mod.apply(acc_mn, self.mod_scale)
        if cutlass.const_expr(masked is None):
            visited = self.mask.block_range(m_block) if cutlass.const_expr(rng is None) else rng
            if needs_mask(n_block, visited):
                self.mask.apply(acc_mn, coord_mn, m_block, n_block)
        elif cutlass.const_expr(masked):
            self.mask.apply(acc_mn, coord_mn, m_block, n_block)

    @cute.jit
    def sparse_mods(self, acc_mn: cute.Tensor, coord_mn: cute.Tensor, m_block: Int32,
                    n_block: Int32, grad_mn: Optional[cute.Tensor] = None,
                    state: Optional[Int32] = None):
        """The traced mods under a block mask: a full tile skips the mask rule, an empty one
        (inside the visited range of a mask that is not contiguous) is masked whole."""
        spec = self.mods.spec
        # A partial tile inside one block runs the mask mod alone; one straddling blocks the
        # per-element rule, which reads the block's state at each element.
        partial = spec.mask if cutlass.const_expr(self.mods.nested()) else spec.block_rule
        if cutlass.const_expr(state is None):
            state = self.sparse.at(m_block, n_block)
        if state == FULL:
            self.mods.apply(acc_mn, coord_mn, m_block, n_block, self.mod_scale, grad_mn, None)
        else:
            self.mods.apply(acc_mn, coord_mn, m_block, n_block, self.mod_scale, grad_mn,
                            partial, state != EMPTY)
