"""LSE merge: combine attention results computed over disjoint key ranges.

For parts s with outputs O_s and log-sum-exps LSE_s over disjoint key sets:
``LSE = ln(sum_s exp(LSE_s))`` and ``O = sum_s exp(LSE_s - LSE) O_s``. Split-KV decode
and ring attention both rest on it. Model: `flash_cute.reference.block_models.lse_merge`.

The kernel takes the tensors in one of three layouts (`LAYOUTS`) and sees each as a
(splits, rows, d) stack: the ampere forward's split-KV partials, padded or varlen, or a plain
[splits, rows, d] stack (`flash_attn_combine`). A forward can merge its own splits instead,
the last split of each tile merging it (`SplitArrivals`, `merge_rows`: the hopper forward);
both merges run the row block `merge_row`.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_cute.blocks.dsl_state import DslState
from flash_cute.blocks.layouts import assume_aligned_strides
from flash_cute.blocks.softmax import LN_2, LOG2_E

# Per layout, the mode order that makes each of (o_parts, lse_parts, out, lse) read
# (splits, rows..., d) with the rows' modes ordered (head, query, batch), head fastest, so
# neighbouring warps read neighbouring rows of O.
LAYOUTS = {
    # o_parts [S, rows, d], lse_parts [S, rows], out [rows, d], lse [rows]
    "rows": ((0, 1, 2), (0, 1), (0, 1), (0,)),
    # o_parts [S, b, sq, h, d], lse_parts [S, b, h, sq], out [b, sq, h, d], lse [b, h, sq]
    "padded": ((0, 3, 2, 1, 4), (0, 2, 3, 1), (2, 1, 0, 3), (1, 2, 0)),
    # o_parts [S, tq, h, d], lse_parts [S, h, tq], out [tq, h, d], lse [h, tq]
    "varlen": ((0, 2, 1, 3), (0, 1, 2), (1, 0, 2), (0, 1)),
}


def _rows_view(t: cute.Tensor, order: tuple, lead: int, tail: int) -> cute.Tensor:
    """`t` with its modes in `order`, the modes between the first `lead` and the last `tail`
    grouped into one (row) mode."""
    t = cute.make_tensor(t.iterator, cute.select(t.layout, mode=list(order)))
    return cute.group_modes(t, lead, cute.rank(t) - tail)


class LseMergeKernel:
    """Merges split results: O [rows, d] and LSE [rows] from [splits, rows, d] and
    [splits, rows] (in any of `LAYOUTS`).

    | warps | role                                                                         |
    |-------|------------------------------------------------------------------------------|
    | 0-3   | one row per warp: LSE with the splits across the lanes (a shuffle reduction), |
    |       | then O with d/32 columns per lane, the splits' loads independent of each other |

    No shared memory. A split whose LSE is -inf (no visible key, or a row its forward never
    wrote) adds nothing: its O is selected away, so an unwritten partial cannot reach O. The
    O loop has no branch, so the loads of several splits are in flight together.
    """

    num_threads = 128
    rows_per_cta = 4

    def __init__(self, out_dtype, hdim: int, layout: str = "rows"):
        if hdim % 32 != 0:
            raise ValueError(f"LSE merge needs hdim % 32 == 0, got {hdim}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
        self.out_dtype = out_dtype
        self.hdim = hdim
        self.vec = hdim // 32
        self.layout = layout

    @cute.jit
    def __call__(self, mO_parts: cute.Tensor, mLSE_parts: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, stream: cuda.CUstream):
        """The four tensors as `LAYOUTS[self.layout]` names them; O parts fp32, LSEs fp32."""
        o_order, lse_order, out_order, out_lse_order = LAYOUTS[self.layout]
        # Rows of 16 bytes (the launch checks it): 128-bit loads of the partials.
        mO_parts = _rows_view(assume_aligned_strides(mO_parts, 4), o_order, 1, 1)
        mLSE_parts = _rows_view(mLSE_parts, lse_order, 1, 0)
        mO = _rows_view(mO, out_order, 0, 1)
        mLSE = _rows_view(mLSE, out_lse_order, 0, 0)
        rows = cute.size(mO, mode=[0])
        grid = (cute.ceil_div(rows, self.rows_per_cta), 1, 1)
        self.kernel(mO_parts, mLSE_parts, mO, mLSE, rows).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO_parts: cute.Tensor, mLSE_parts: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * self.rows_per_cta + tidx // 32
        num_splits = cute.size(mO_parts, mode=[0])
        if row < rows:
            acc, lse = merge_row(lambda s: mLSE_parts[s, row], lambda s: mO_parts[s, row, None],
                                 num_splits, lane, self.vec)
            out = cute.local_tile(mO[row, None], (self.vec,), (lane,))
            out.store(acc.load().to(self.out_dtype))
            if lane == 0:
                mLSE[row] = lse


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


def merge_key(out_dtype, hdim: int, layout: str):
    """The `jit.CompileKey` of the merge kernel of a dtype, head dim and layout."""
    from flash_cute.runtime.jit import CompileKey, current_target
    from flash_cute.contract.variant import dtype_name

    flags = () if layout == "rows" else (("layout", layout),)
    return CompileKey("blocks.lse_merge", current_target(), dtype_name(out_dtype), hdim, hdim,
                      (LseMergeKernel.rows_per_cta, hdim), flags)


def _kernel(out_dtype, hdim: int, layout: str) -> LseMergeKernel:
    from flash_cute.runtime.jit import DTYPES
    from flash_cute.contract.variant import dtype_name

    return LseMergeKernel(DTYPES[dtype_name(out_dtype)], hdim, layout)


def merge_call(out_dtype, hdim: int, layout: str, args: tuple):
    """A `jit.KernelCall` of the merge kernel for `args` (four `jit.TensorArg`s)."""
    from flash_cute.runtime.jit import KernelCall

    return KernelCall(merge_key(out_dtype, hdim, layout),
                      lambda: _kernel(out_dtype, hdim, layout), args)


def lse_merge(o_parts, lse_parts, out_dtype=None, out=None, lse=None):
    """Merge on the GPU: o_parts [splits, rows, d] fp32, lse_parts [splits, rows] fp32.

    Returns (out [rows, d] in `out_dtype` (default bf16), lse [rows] fp32), written into
    `out`/`lse` when given.
    """
    import torch

    from flash_cute.runtime.jit import TensorArg, launch_kernel

    out_dtype = out_dtype or torch.bfloat16
    _, rows, hdim = o_parts.shape
    if out is None:
        out = torch.empty(rows, hdim, dtype=out_dtype, device=o_parts.device)
    if lse is None:
        lse = torch.empty(rows, dtype=torch.float32, device=o_parts.device)
    args = (TensorArg(o_parts), TensorArg(lse_parts, 4), TensorArg(out), TensorArg(lse, 4))
    launch_kernel(merge_key(out_dtype, hdim, "rows"), lambda: _kernel(out_dtype, hdim, "rows"),
                  args)
    return out, lse
