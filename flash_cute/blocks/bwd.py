"""Backward blocks shared by every arch (recompute from LSE).

Like the forward blocks they see only (rows, cols) views of a thread's fragments (`acc_to_mn`)
and the matching coordinate views, never an MMA layout.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_cute.blocks.dropout import kept
from flash_cute.blocks.layouts import acc_to_mn
from flash_cute.contract.block_range import block_range


@cute.jit
def row_stats(coord_mn: cute.Tensor, m_block: Int32, tile_m: int, seqlen_q: Int32,
              g_lse_log2: cute.Tensor, g_delta: cute.Tensor):
    """LSE·log2 e and Δ for a thread's rows of query tile `m_block`.

    Rows past seqlen_q get LSE = +inf, so their P is exp2(−inf) = 0 and they add nothing to
    dK or dV whatever their (padding) Q and dO hold.
    """
    num_rows = cute.size(coord_mn, mode=[0])
    lse = cute.make_rmem_tensor(num_rows, Float32)
    delta = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        row = m_block * tile_m + coord_mn[r, 0][0]
        safe = cutlass.min(row, seqlen_q - 1)
        lse[r] = Float32.inf if row >= seqlen_q else g_lse_log2[safe]
        delta[r] = g_delta[safe]
    return lse, delta


@cute.jit
def tile_row_values(coord_mn: cute.Tensor, valid_rows: Int32, t_rows: cute.Tensor, outside,
                    clamp: cutlass.Constexpr[bool] = False, shares: cutlass.Constexpr[int] = 1,
                    share: Int32 = 0, checked: cutlass.Constexpr[bool] = True):
    """A thread's rows of a per-row vector of a query tile already in memory (e.g. LSE₂ or Δ,
    TMA-loaded to shared memory), indexed by the tile's own rows, of which the first
    `valid_rows` belong to the sequence; the other rows get `outside`.

    LSE₂ = +inf and Δ = 0 outside: whatever the tile holds there (zeros past the tensor, the
    next varlen sequence, or the unwritten padding of a buffer, possibly NaN) never reaches
    P = exp2(−inf) = 0 or dS = P ∘ (dP − Δ) = 0. `clamp`: the index is clamped to the last
    valid row, for a tile in global memory whose rows past the sequence may not exist (the
    value read is then discarded).

    `shares` > 1: only the thread's rows ``[share · n, (share + 1) · n)`` (n = rows / shares),
    for threads that hold the same rows and split the values among themselves (`share` may
    be a run-time value). `checked=False`: every row is read as it is, for a caller whose
    rows past the sequence are harmless as loaded (the Hopper backward's TMA zero fill).
    """
    if cutlass.const_expr(cute.size(coord_mn, mode=[0]) % shares):
        raise ValueError(f"{shares} shares do not divide {cute.size(coord_mn, mode=[0])} rows")
    num_rows = cute.size(coord_mn, mode=[0]) // shares
    vals = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        if cutlass.const_expr(shares > 1):
            row = coord_mn[share * num_rows + r, 0][0]
        else:
            row = coord_mn[r, 0][0]
        if cutlass.const_expr(checked):
            idx = cutlass.min(row, valid_rows - 1) if clamp else row
            vals[r] = t_rows[idx] if row < valid_rows else Float32(outside)
        else:
            vals[r] = t_rows[row]
    return vals


@cute.jit
def p_and_ds(s_mn: cute.Tensor, dp_mn: cute.Tensor, lse: cute.Tensor, delta: cute.Tensor,
             scale_log2: Float32, score_mod: cutlass.Constexpr = None,
             grad_mn: Optional[cute.Tensor] = None, ds_hook: cutlass.Constexpr = None):
    """In place: S → P = exp2(S·scale_log2 − LSE₂) and dP → dS = P ∘ (dP − Δ) [∘ f'(s)].

    With a score mod (`flash_cute.blocks.score`; softcap) S holds the mod's output and dS takes its
    derivative, `score_mod.grad` of that output (the softmax scale is applied to dK and dQ at
    the end); a traced mod's derivative comes in `grad_mn` instead (`Scores.prepare`).
    `ds_hook(ds_mn)` sees dS before that derivative (the gradients of learnable captured
    tensors, `GraphMods.accumulate_grads`).
    """
    if cutlass.const_expr(ds_hook is not None):
        _p_and_ds(s_mn, dp_mn, lse, delta, scale_log2, None, None)
        ds_hook(dp_mn)
        times_grad(dp_mn, grad_mn)
    else:
        _p_and_ds(s_mn, dp_mn, lse, delta, scale_log2, score_mod, grad_mn)


def times_grad(ds_mn: cute.Tensor, grad_mn: Optional[cute.Tensor]):
    """In place: dS ∘ the traced mod's derivative (nothing without one)."""
    if grad_mn is not None:
        for r in range(cute.size(ds_mn, mode=[0])):
            ds_mn[r, None].store(ds_mn[r, None].load() * grad_mn[r, None].load())


def _p_and_ds(s_mn, dp_mn, lse, delta, scale_log2, score_mod, grad_mn):
    """`p_and_ds`'s pass (plain Python, run at trace time)."""
    for r in range(cute.size(s_mn, mode=[0])):
        if grad_mn is not None:
            for c in range(cute.size(dp_mn, mode=[1])):
                dp_mn[r, c] = (dp_mn[r, c] - delta[r]) * grad_mn[r, c]
        elif score_mod is not None and score_mod.value_grad:
            for c in range(cute.size(dp_mn, mode=[1])):
                grad = score_mod.grad(s_mn[r, c])
                dp_mn[r, c] = (dp_mn[r, c] - delta[r]) * grad
        else:
            dp_mn[r, None].store(dp_mn[r, None].load() - delta[r])
        p = cute.math.exp2(s_mn[r, None].load() * scale_log2 - lse[r], fastmath=True)
        s_mn[r, None].store(p)
        dp_mn[r, None].store(p * dp_mn[r, None].load())


def p_and_ds_dropout(s_mn: cute.Tensor, dp_mn: cute.Tensor, lse, delta, scale_log2: Float32,
                     score_mod, dropout, coord_mn: cute.Tensor, m_block: Int32, n_block: Int32,
                     grad_mn: Optional[cute.Tensor] = None, ds_hook=None):
    """`p_and_ds` with dropout (`flash_cute.blocks.dropout`; Z its keep decisions, 1/(1-p) its
    scale): S → Z ∘ P, the operand of dV (which the kernel scales by 1/(1-p) at the end), and
    dP → dS = P ∘ (Z ∘ dP / (1 - p) − Δ) [∘ f'(s)]. Dropped entries still get dS = −P·Δ: the
    softmax couples them to the row. Each row's LSE₂ and Δ are read once, at their first use
    in the group walk (a shuffle each, for shuffled statistics). Plain Python, run at trace
    time: the group walk's callback holds no staged control flow."""
    rows = _FirstUse(lambda r: (lse[r], delta[r]))

    def visit(r, c, keep):
        lse_r, delta_r = rows[r]
        s = s_mn[r, c]
        p = cute.math.exp2(s * scale_log2 - lse_r, fastmath=True)
        ds = p * cute.math.fma(kept(keep, dp_mn[r, c]), dropout.scale, -delta_r)
        if grad_mn is not None and ds_hook is None:
            ds = ds * grad_mn[r, c]
        elif score_mod is not None and score_mod.value_grad:
            ds = ds * score_mod.grad(s)
        dp_mn[r, c] = ds
        s_mn[r, c] = kept(keep, p)

    dropout.for_each(coord_mn, m_block, n_block, visit)
    if ds_hook is not None:
        # The gradients of learnable captured tensors take dS before the mod's derivative.
        ds_hook(dp_mn)
        times_grad(dp_mn, grad_mn)


class _FirstUse(dict):
    """A trace-time memo: `load(key)` at the first lookup of each key."""

    def __init__(self, load):
        super().__init__()
        self.load = load

    def __missing__(self, key):
        value = self[key] = self.load(key)
        return value


@cute.jit
def probs(s_mn: cute.Tensor, lse: cute.Tensor, scale_log2: Float32):
    """In place: S → P = exp2(S·scale_log2 − LSE₂), the first half of `p_and_ds` (no score mod),
    for a kernel whose dP is still being computed."""
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        s_mn[r, None].store(cute.math.exp2(s_mn[r, None].load() * scale_log2 - lse[r],
                                           fastmath=True))


@cute.jit
def ds_from_probs(p_mn: cute.Tensor, dp_mn: cute.Tensor, delta: cute.Tensor):
    """In place: dP → dS = P ∘ (dP − Δ), the second half of `p_and_ds` (no score mod), rounded
    as there."""
    for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
        dp_mn[r, None].store(p_mn[r, None].load() * (dp_mn[r, None].load() - delta[r]))


@cute.jit
def dq_turn(n_block: Int32, m_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32,
            seqlen_k: Int32, causal: bool, window_left, window_right) -> Int32:
    """Deterministic dQ: the place of K/V block `n_block` among the K/V blocks that add into
    query block `m_block`, which are exactly ``block_range(m_block).[n_block_min, n_block_max)``
    (the range is tight, like `m_block_range`'s, so every one of them visits `m_block`). dQ of
    `m_block` is added in increasing n_block: block n waits until the semaphore equals its
    turn, adds, and increments it."""
    rng = block_range(m_block, tile_m, tile_n, seqlen_q, seqlen_k, causal, window_left,
                      window_right, imin=cutlass.min, imax=cutlass.max)
    return n_block - rng.n_block_min


@cute.jit
def wait_turn(semaphore: cute.Pointer, turn: Int32):
    """Spin until the global int32 at `semaphore` equals `turn` (acquire: the adds of the
    blocks before are visible to what follows)."""
    seen = cute.arch.load(semaphore, Int32, sem="acquire", scope="gpu")
    while seen != turn:
        seen = cute.arch.load(semaphore, Int32, sem="acquire", scope="gpu")


@cute.jit
def pass_turn(semaphore: cute.Pointer):
    """Give the next block its turn (release: after this thread's completed adds)."""
    cute.arch.red(semaphore, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")


@cute.jit
def atomic_add_rows(acc_mn: cute.Tensor, coord_mn: cute.Tensor, g_tile: cute.Tensor,
                    valid_rows: Int32):
    """fp32 atomics of a (rows, cols) fragment into the in-bounds rows of a global tile."""
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        row = coord_mn[r, 0][0]
        if row < valid_rows:
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                ptr = g_tile.iterator + cute.crd2idx((row, coord_mn[0, c][1]), g_tile.layout)
                cute.arch.atomic_add(ptr, acc_mn[r, c])


@cute.jit
def store_rows(acc_mn: cute.Tensor, coord_mn: cute.Tensor, g_tile: cute.Tensor,
               valid_rows: Int32):
    """Store the in-bounds rows of a (rows, cols) fragment, converted to g_tile's type."""
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        row = coord_mn[r, 0][0]
        if row < valid_rows:
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                g_tile[row, coord_mn[0, c][1]] = acc_mn[r, c].to(g_tile.element_type)


@cute.jit
def store_acc_tile(tiled_mma: cute.TiledMma, tidx, acc: cute.Tensor, m_out: cute.Tensor,
                   tile_shape: cutlass.Constexpr, block: Int32, valid_rows: Int32,
                   transposed: cutlass.Constexpr[bool] = False):
    """Store the in-bounds rows of accumulator `acc` of `tiled_mma` as tile `block` of the
    (rows, cols) tensor `m_out` (e.g. dK or dV of one K/V tile). `transposed`: acc holds the
    tile's transpose (cols, rows) (dKᵀ, dVᵀ of the Hopper backward's swap_dkv)."""
    g_out = cute.local_tile(m_out, tile_shape, (block, 0))
    ident = cute.make_identity_tensor(tile_shape)
    if cutlass.const_expr(transposed):
        rows, cols = tile_shape
        ident = cute.composition(ident, cute.make_layout((cols, rows), stride=(rows, 1)))
    coord = tiled_mma.get_slice(tidx).partition_C(ident)
    acc_mn, coord_mn = acc_to_mn(acc), acc_to_mn(coord)
    if cutlass.const_expr(transposed):
        acc_mn, coord_mn = (cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))
                            for t in (acc_mn, coord_mn))
    store_rows(acc_mn, coord_mn, g_out, valid_rows)
