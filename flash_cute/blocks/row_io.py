"""Block: row copies of a (rows, d) tile between shared or global memory and registers, in
whole vectors, never touching rows past a valid count (the backward's row kernels and the
Hopper epilogues)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def row_copy(dtype, elems: int, threads_per_row: int, num_threads: int) -> cute.TiledCopy:
    """Tiled copy of (rows, d) tiles: `elems`-element vectors, `threads_per_row` consecutive
    threads side by side along a row."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype,
                               num_bits_per_copy=elems * dtype.width)
    threads = cute.make_layout((num_threads // threads_per_row, threads_per_row),
                               stride=(threads_per_row, 1))
    return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, elems)))


@cute.jit
def copy_rows(tiled_copy: cute.TiledCopy, src: cute.Tensor, dst: cute.Tensor,
               coord: cute.Tensor, valid_rows: Int32):
    """Copy a thread's partition of a tile; rows >= valid_rows are never touched.

    A predicate rather than a branch per row, so all of a thread's loads are issued back to
    back instead of one row's round trip at a time.
    """
    num_rows = cute.size(coord, mode=[1])
    # One Boolean per row, broadcast (stride 0) over the atom's values and the row's vectors.
    per_row = cute.make_layout((coord.shape[0][1], num_rows, cute.size(coord, mode=[2])),
                               stride=(0, 1, 0))
    pred = cute.make_rmem_tensor(per_row, cutlass.Boolean)
    for m in cutlass.range_constexpr(num_rows):
        pred[0, m, 0] = coord[0, m, 0][0] < valid_rows
    cute.copy(tiled_copy, src, dst, pred=pred)
