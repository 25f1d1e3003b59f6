"""sm80 data movement shared by the forward and backward kernels: swizzled shared-memory tiles,
128-bit cp.async tiled copies, and row-predicated tile loads."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync


def smem_layout(rows: int, cols: int, stages: int = 1):
    """Swizzled (rows, cols[, stages]) tile of a 16-bit type: ldmatrix and 128-bit cp.async both
    hit distinct banks (8 rows of 64 columns, or of 32 when cols is not a multiple of 64)."""
    kblk = 64 if cols % 64 == 0 else 32
    atom = cute.make_composed_layout(
        cute.make_swizzle(3 if kblk == 64 else 2, 3, 3), 0,
        cute.make_layout((8, kblk), stride=(kblk, 1)),
    )
    if stages == 1:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


def gmem_tiled_copy(dtype, num_threads: int, cols: int, op=None):
    """128-bit copies of a (rows, cols) tile, cols/8 threads per row; cp.async by default."""
    op = op or cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
    elems = 128 // dtype.width
    per_row = (64 if cols % 64 == 0 else 32) // elems
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=128)
    thr = cute.make_layout((num_threads // per_row, per_row), stride=(per_row, 1))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))


@cute.jit
def load_rows(tiled_copy: cute.TiledCopy, src: cute.Tensor, dst: cute.Tensor, coord: cute.Tensor,
              valid_rows: Int32):
    """Copy a partitioned tile; rows >= valid_rows are zero-filled instead, so padding rows
    never carry NaN or stale data into a GEMM."""
    for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
        if coord[0, m, 0][0] < valid_rows:
            cute.copy(tiled_copy, src[None, m, None], dst[None, m, None])
        else:
            dst[None, m, None].fill(0)
