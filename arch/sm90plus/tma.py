"""TMA plumbing of the sm90+ kernels: mode orders that put a tile's (rows, cols) first,
swizzled shared-memory tiles, TMA load atoms over whole tensors, their partitions, the
mbarrier pipelines they fill, and the zeroing of rows a TMA loaded past a sequence."""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from flash_cute.blocks.layouts import pack_heads

# Mode orders that put (rows, cols) first, as TMA tiles the leading modes of a tensor, and
# their inverses that give the kernel back the caller's order (so `SeqInfo` views apply).
# Q, K: (b, s, h, d) -> (s, d, h, b); varlen (t, h, d) -> (t, d, h).
ROWS_FIRST = {False: ((1, 3, 2, 0), (3, 0, 2, 1)), True: ((0, 2, 1), (0, 2, 1))}
# V as the MN-major B operand of P V, head dim contiguous: (b, s, h, dv) -> (dv, s, h, b);
# varlen (t, h, dv) -> (dv, t, h).
COLS_FIRST = {False: ((3, 1, 2, 0), (3, 1, 2, 0)), True: ((2, 0, 1), (1, 2, 0))}


def smem_tile(dtype, layout):
    """A `cute.struct` field for one (staged) swizzled shared-memory tile of `layout`, 1 KiB
    aligned: the period of a 128-byte swizzle, which TMA boxes and WGMMA descriptors assume."""
    return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]


def swizzled_layout(dtype, shape: tuple, atom_cols: int) -> cute.ComposedLayout:
    """(rows, cols[, stages]) 16-bit tile, cols contiguous, swizzled by the widest WGMMA
    atom that fits `atom_cols` columns (an atom may not straddle the columns one warpgroup
    reads or writes, or the MMA cannot partition the tile)."""
    kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols)
    return cute.tile_to_shape(warpgroup.make_smem_layout_atom(kind, dtype), shape,
                              order=tuple(range(len(shape))))


def permute(t: cute.Tensor, order) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=list(order)))


def tma_load_atom(t: cute.Tensor, order, staged_layout, tile):
    """TMA atom over the whole tensor (every batch and head; the kernel picks its tile by
    coordinates), with one stage of `staged_layout` as the shared-memory box."""
    return cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), permute(t, order),
        cute.slice_(staged_layout, (None, None, 0)), tile)


def packed_tma_atom(op, t: cute.Tensor, varlen: bool, staged_layout, tile, pack: int):
    """TMA atom over Q or O with `pack` heads folded into the rows (packed GQA), and its
    coordinate tensor as `flash_cute.blocks.layouts.pack_heads` lays it out: padded (b, (pack, s),
    h / pack, d), varlen ((pack, t), h / pack, d).

    The descriptor is built over ((h, s), d[, b]), heads and rows as one mode tiled
    (pack, rows / pack): a box of `pack` heads by rows / pack queries, four dimensions like
    the unpacked one (the packed tensor itself would need five)."""
    order = (1, 0, 2) if varlen else (2, 1, 3, 0)
    grouped = cute.group_modes(permute(t, order), 0, 2)
    atom, coords = cpasync.make_tiled_tma_atom(
        op, grouped, cute.slice_(staged_layout, (None, None, 0)),
        ((pack, tile[0] // pack), tile[1]))
    # coords: ((h, s), d[, b]) -> the caller's order, then the heads folded into the rows.
    (heads, rows), (head_step, row_step) = coords.shape[0], coords.stride[0]
    shape, stride = (rows, heads, coords.shape[1]), (row_step, head_step, coords.stride[1])
    if not varlen:
        shape, stride = (coords.shape[2],) + shape, (coords.stride[2],) + stride
    unpacked = cute.make_tensor(coords.iterator, cute.make_layout(shape, stride=stride))
    row, head = (0, 1) if varlen else (1, 2)
    return atom, pack_heads(unpacked, row, head, pack)


def tma_partition(atom, s: cute.Tensor, g: cute.Tensor, rank: int = 2):
    """TMA partition (no multicast) of a staged shared-memory tile and its global tile(s), the
    tile being the leading `rank` modes of both."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, rank),
                                 cute.group_modes(g, 0, rank))


def make_tma_pipelines(specs, consumer_warps: int):
    """One `PipelineTmaAsync` per (barrier storage, stages, TMA bytes per stage). The empty
    barriers count one arrive per consumer warp (PipelineTmaAsync releases from lane 0 of each
    warp), the full ones one producer arrive plus the stage's bytes. Every thread of the CTA
    calls this: the barriers are initialized by warp 0 and made visible to all (and to the
    async proxy) before anyone waits on them."""
    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
    consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps)
    pipes = tuple(pipeline.PipelineTmaAsync.create(
        num_stages=stages, producer_group=producer, consumer_group=consumers, tx_count=tx,
        barrier_storage=bars.data_ptr(), defer_sync=True) for bars, stages, tx in specs)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return pipes


@cute.jit
def clear_rows_past(tile: cute.Tensor, valid_rows: Int32, row_mode: cutlass.Constexpr[int],
                    tid: Int32, num_threads: cutlass.Constexpr[int]):
    """Zero the entries of a 2-D (shared-memory) tile whose coordinate along `row_mode` (0 or
    1) is >= `valid_rows`, spread over `num_threads` threads (`tid` in [0, num_threads)).

    A TMA zero-fills only what lies past the end of the tensor: in a varlen tile the rows
    past a sequence hold the next sequence or the unused tail of the packed tensor, possibly
    NaN or inf, and a probability of 0 times such a row is NaN in the GEMM. The caller makes
    the zeros visible to the tensor cores (`clear_tails` does both)."""
    rows = cute.size(tile, mode=[row_mode])
    cols = cute.size(tile, mode=[1 - row_mode])
    zero = tile.element_type(0)
    for idx in cutlass.range(tid + valid_rows * cols, rows * cols, num_threads, unroll=1):
        row = idx // cols
        col = idx - row * cols
        if cutlass.const_expr(row_mode == 0):
            tile[row, col] = zero
        else:
            tile[col, row] = zero


@cute.jit
def clear_tails(tiles: tuple, valid_rows: Int32, row_mode: cutlass.Constexpr[int], tid: Int32,
                num_threads: cutlass.Constexpr[int], barrier_id: cutlass.Constexpr[int]):
    """`clear_rows_past` on each of `tiles`, then what makes the zeros visible to the tensor
    cores: a fence to the async proxy and named barrier `barrier_id` over the `num_threads`
    threads (every one of which must call this)."""
    for t in cutlass.range_constexpr(len(tiles)):
        clear_rows_past(tiles[t], valid_rows, row_mode, tid, num_threads)
    cute.arch.fence_view_async_shared()
    pipeline.NamedBarrier(barrier_id=barrier_id, num_threads=num_threads).arrive_and_wait()
