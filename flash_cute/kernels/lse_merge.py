"""The LSE-merge kernel: partial (O, LSE) over disjoint key ranges merged into one, a warp
per row (`blocks.lse_merge.merge_row`). It takes the tensors in one of three layouts
(`LAYOUTS`) and sees each as a (splits, rows, d) stack: the ampere forward's split-KV partials,
padded or varlen, or a plain [splits, rows, d] stack (`flash_attn_combine`). Launched by
`runtime.lse_merge`, which names it."""

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Int32

from flash_cute.blocks.layouts import assume_aligned_strides
from flash_cute.blocks.lse_merge import merge_row

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
