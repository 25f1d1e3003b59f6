"""The Hopper epilogues' row copies: a shared-memory tile to global memory as whole 128-bit
pieces of rows (the backward's dK/dV and the dQ postprocess)."""

import cutlass.cute as cute
from cutlass import Int32

from flash_cute.blocks.row_io import copy_rows, row_copy
from flash_cute.contract.row_split import lanes_per_row


def row_store(dtype, cols: int, num_threads: int) -> cute.TiledCopy:
    """`row_copy` of (rows, cols) 16-bit tiles in 128-bit vectors, `lanes_per_row` threads
    side by side along a row."""
    vec = 128 // dtype.width
    return row_copy(dtype, vec, lanes_per_row(cols // vec), num_threads)


@cute.jit
def store_tile_rows(store: cute.TiledCopy, tidx, s_tile: cute.Tensor, g_tile: cute.Tensor,
                    valid_rows: Int32):
    """Thread `tidx`'s part of a (rows, cols) shared tile to the same-shaped global tile by
    `store` (`row_store`): whole 128-bit pieces of rows, rows >= valid_rows untouched."""
    thr = store.get_slice(tidx)
    copy_rows(store, thr.partition_S(s_tile), thr.partition_D(g_tile),
              thr.partition_S(cute.make_identity_tensor(g_tile.shape)), valid_rows)
