"""LSE merge: combine attention results computed over disjoint key ranges.

For parts s with outputs O_s and log-sum-exps LSE_s over disjoint key sets:
``LSE = ln(sum_s exp(LSE_s))`` and ``O = sum_s exp(LSE_s - LSE) O_s``. Split-KV decode
and ring attention both rest on it. Model: `flash_cute.reference.block_models.lse_merge`.

Blocks: `merge_row` (one row, a warp, the splits across the lanes), the row block of both
merges: the kernel `kernels.lse_merge.LseMergeKernel` (a separate launch: the ampere split-KV
forward, `flash_attn_combine`), and a forward's merge of its own splits, the last split of
each tile merging it (`SplitArrivals`, `merge_rows`: the hopper forward).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_cute.blocks.dsl_state import DslState
from flash_cute.blocks.softmax import LN_2, LOG2_E


@cute.jit
def row_lse(lse_at, num_splits: Int32, lane: Int32):
    """LSE of one row over the splits (`lse_at(s)`: split s's), by one warp, lane i taking
    splits i, i + 32, ...; every split -inf gives -inf."""
    lse_max = -Float32.inf
    for s in cutlass.range(lane, num_splits, 32, unroll=1):
        lse_max = cute.arch.fmax(lse_max, lse_at(s))
    lse_max = cute.arch.warp_reduction_max(lse_max)
    lse_max_safe = Float32(0.0) if lse_max == -Float32.inf else lse_max
    total = Float32(0.0)
    for s in cutlass.range(lane, num_splits, 32, unroll=1):
        total = total + cute.math.exp2((lse_at(s) - lse_max_safe) * Float32(LOG2_E),
                                       fastmath=True)
    total = cute.arch.warp_reduction_sum(total)
    lse = -Float32.inf
    if total > Float32(0.0):
        lse = lse_max_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)
    return lse


@cute.jit
def merge_row(lse_at, o_at, num_splits: Int32, lane: Int32, vec: cutlass.Constexpr):
    """The block both merges run: one row of O and its LSE from its splits, by one warp.
    `lse_at(s)`: split s's LSE of the row; `o_at(s)`: split s's fp32 O row (d = 32 * vec).
    Returns (this lane's `vec` columns of O, fp32 registers; the row's LSE). A split whose
    LSE is -inf adds nothing: its O is selected away, so an unwritten partial cannot reach O.
    The O loop has no branch, so the loads of several splits are in flight together."""
    lse = row_lse(lse_at, num_splits, lane)
    lse_safe = Float32(0.0) if lse == -Float32.inf else lse
    acc = cute.make_rmem_tensor(vec, Float32)
    acc.fill(0.0)
    for s in cutlass.range(num_splits, unroll=8):
        lse_s = lse_at(s)
        part = cute.local_tile(o_at(s), (vec,), (lane,)).load()
        weight = cute.math.exp2((lse_s - lse_safe) * Float32(LOG2_E), fastmath=True)
        kept = cute.full_like(part, lse_s > -Float32.inf, cutlass.Boolean)
        acc.store(acc.load() + cute.where(kept, part * weight, cute.zeros_like(part)))
    return acc, lse


class SplitArrivals(DslState):
    """The in-kernel merge's arrival count (a forward that merges its own splits, `HopperFwd`):
    after storing its partial, each split of a tile adds one to the tile's int32 counter, and
    the split that finds the others all there merges the tile (`merge_rows`) and sets the
    counter back to 0 for the next launch. No CTA waits for another, so any order of tiles
    and any grid size is safe. The merger reads what other CTAs wrote: every thread's stores
    are released by its fence before the barrier the counting thread passes, and acquired by
    the counter's atomic and the fence after it.

    `counts`: int32, one per (tile, head, batch) of the launch, zero; `flag`: an int32 in
    shared memory that hands the count's verdict to the other threads; `barrier`: a named
    barrier over the `num_threads` threads that store the tile (thread index `tidx`)."""

    def __init__(self, counts: cute.Tensor, flag: cute.Tensor, barrier, tidx: Int32):
        self.counts, self.flag, self.barrier, self.tidx = counts, flag, barrier, tidx

    @cute.jit
    def last(self, slot: Int32, num_splits: Int32):
        """Whether this split of tile `slot` is the last to have stored its partial (every
        thread of the barrier calls it, after its stores)."""
        cute.arch.fence_acq_rel_gpu()
        self.barrier.arrive_and_wait()
        if self.tidx == 0:
            done = cute.arch.atomic_add(self.counts.iterator + slot, Int32(1), sem="acq_rel",
                                        scope="gpu")
            self.flag[0] = Int32(0)
            if done == num_splits - 1:
                self.counts[slot] = Int32(0)
                self.flag[0] = Int32(1)
        self.barrier.arrive_and_wait()
        is_last = self.flag[0] != 0
        if is_last:
            cute.arch.fence_acq_rel_gpu()
        return is_last


@cute.jit
def merge_rows(rows: Int32, lse_at, o_at, g_out: cute.Tensor, g_lse: cute.Tensor,
               num_splits: Int32, tidx: Int32, num_threads: cutlass.Constexpr,
               vec: cutlass.Constexpr):
    """The in-kernel merge of a tile: rows 0 .. `rows` - 1, one warp per row (`merge_row`).
    `lse_at(s, r)` / `o_at(s, r)`: split s's LSE / fp32 O row of tile row r; `g_out`
    (tile rows, d) and `g_lse` (tile rows,): where the merged row goes."""
    lane = tidx % 32
    for r in cutlass.range(tidx // 32, rows, num_threads // 32, unroll=1):
        acc, lse = merge_row(lambda s: lse_at(s, r), lambda s: o_at(s, r), num_splits, lane,
                             vec)
        cute.local_tile(g_out[r, None], (vec,), (lane,)).store(acc.load().to(g_out.element_type))
        if lane == 0:
            g_lse[r] = lse
