"""The Hopper backward's fp32 dQ accumulator in fragment order, and its postprocess.

A query tile's dQ partial leaves the consumers' registers for one shared-memory tile and is
added to global memory by one bulk reduce-add (`cp.reduce.async.bulk .add.f32`) of the whole
tile (or of each consumer warpgroup's half, see below), so the tile is kept in the order the
WGMMA accumulator fragments have, in shared and in global memory (FA3/FA4 do the same):
element i of consumer thread t (warpgroup w = t // 128, n = tile_m * hdim / DQ_THREADS
elements per thread) sits at

    w * 128 * n + (i // 4) * 4 * 128 + 4 * (t % 128) + i % 4

of its tile's tile_m * hdim floats, so each thread's four consecutive values are one 128-bit
store, a warp's store covers 512 contiguous bytes (no bank conflicts) and each warpgroup's
half is contiguous (a bulk add of its own, `BwdSchedule.dq_per_wg`); see docs/decisions.md,
D-HB-DQPOST.

dQaccum is [b, ceil(sq / tile_m), h, tile_m * hdim] (varlen: [total_q // tile_m + b, h,
tile_m * hdim], sequence b's tiles starting at cu_seqlens_q[b] // tile_m + b, so tiles of
different sequences never share a block), zero-filled. `HopperDqPostprocess` maps each
thread's fragment back to rows and columns through the same tiled MMA and writes
dQ = dQaccum · scale in the input dtype, like q.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.experimental.primitives.nvvm_wrapper import (
    CpReduceOp,
    CpReduceType,
    cp_reduce_async_bulk_global_shared_cta,
)

from flash_cute.arch.sm90plus.tma import smem_tile, swizzled_layout
from flash_cute.blocks.layouts import assume_aligned_strides, transpose_view
from flash_cute.blocks.seqlen import SeqInfo

from .config import BWD_CONSUMER_WARPGROUPS
from .row_copy import row_store, store_tile_rows

DQ_THREADS = 128 * BWD_CONSUMER_WARPGROUPS
_VEC = 4


def dq_tiled_mma(dtype, tile_m: int, hdim: int, split: tuple,
                 swapped: bool = False) -> cute.TiledMma:
    """dQ = dS K's WGMMA, or dQᵀ = Kᵀ dSᵀ's (`swapped`; N is then the tile's queries), split
    over the consumer warpgroups as `split` (M, N). The operands' major modes do not change
    the accumulator's fragment, which is all the postprocess uses."""
    wg_m, wg_n = split
    n = tile_m if swapped else hdim
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, (wg_m, wg_n, 1),
        (64, n // wg_n))


def thread_view(tile: cute.Tensor, tidx, per_thread: int) -> cute.Tensor:
    """Consumer thread `tidx`'s (4, per_thread / 4) slots of a flat fragment-order tile."""
    layout = cute.make_layout((_VEC, per_thread // _VEC, (128, BWD_CONSUMER_WARPGROUPS)),
                              stride=(1, _VEC * 128, (_VEC, per_thread * 128)))
    return cute.make_tensor(tile.iterator, layout)[None, None, tidx]


def as_vectors(acc: cute.Tensor) -> cute.Tensor:
    """An accumulator fragment in register order as (4, size / 4)."""
    return cute.make_tensor(acc.iterator, cute.make_layout((_VEC, cute.size(acc) // _VEC)))


def varlen_first_tile(first_row, batch, tile_m: int):
    """Index of sequence `batch`'s first dQaccum tile (varlen), its first row being
    cu_seqlens_q[batch]: the tiles of different sequences never overlap and all lie below
    `host_dq_layout.accum_shape`'s total_q // tile_m + batch (tests/test_hopper_bwd_cpu.py
    checks both)."""
    return first_row // tile_m + batch


def tile_of(mdQaccum: cute.Tensor, seq: SeqInfo, head, m_block, tile_m: int) -> cute.Tensor:
    """The flat fp32 tile of query tile `m_block` of one head of one sequence."""
    if cutlass.const_expr(seq.varlen):
        return mdQaccum[varlen_first_tile(seq.offset_q, seq.batch, tile_m) + m_block, head,
                        None]
    return mdQaccum[seq.batch, m_block, head, None]


@cute.jit
def reduce_add_tile(mdQaccum: cute.Tensor, sdQ: cute.Tensor, seq: SeqInfo, head,
                    m_block: Int32, tile_m: cutlass.Constexpr[int], hdim: cutlass.Constexpr[int],
                    chunk: cutlass.Constexpr[int] = 0, chunks: cutlass.Constexpr[int] = 1):
    """One lane: the bulk reduce-add of the shared tile, or of its `chunk`-th of `chunks`
    contiguous parts (a warpgroup's half), into its dQaccum tile (bulk_group completion:
    commit and wait as for a TMA store)."""
    g = tile_of(mdQaccum, seq, head, m_block, tile_m)
    n = tile_m * hdim // chunks
    with cute.arch.elect_one():
        cp_reduce_async_bulk_global_shared_cta((g.iterator + chunk * n),
                                               (sdQ.iterator + chunk * n), n * 4,
                                               op=CpReduceOp.ADD, type=CpReduceType.F32)


class HopperDqPostprocess:
    """dQ = dQaccum · scale in the input dtype, from the fragment-order tiles.

    | warps | role                                                                          |
    |-------|-------------------------------------------------------------------------------|
    | 0-7   | thread t: its fragment of one query tile (128-bit loads, as the backward's    |
    |       | consumer thread t stored it), scaled, converted, into a swizzled 16-bit tile  |
    |       | at the rows and columns the dQ WGMMA's accumulator gives it; barrier; then    |
    |       | 128-bit rows of that tile to dQ, rows past the sequence skipped               |

    One CTA per (query tile, head, batch); every row of every sequence is written (tiles no
    K/V tile reached, e.g. past seqused_q, hold zeros). The shared tile makes the global
    stores whole rows (straight from the fragment a warp instruction writes 16-byte pieces of
    8 rows: D-HB-DQPOST)."""

    def __init__(self, dtype, hdim: int, tile_m: int, split: tuple, varlen: bool,
                 swapped: bool = False, out_dtype=None):
        """`dtype`: the backward's inputs' (its dQ WGMMA's); `out_dtype`: dQ's, `dtype` unless
        given (float32: a ring step's gradient, unrounded)."""
        self.dtype, self.hdim, self.tile_m, self.split = dtype, hdim, tile_m, split
        self.out_dtype = out_dtype or dtype
        self.varlen, self.swapped = varlen, swapped
        self.per_thread = tile_m * hdim // DQ_THREADS
        self.vec = 128 // self.out_dtype.width

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32,
                 mCuSeqlensQ: Optional[cute.Tensor], max_seqlen_q: Int32,
                 stream: cuda.CUstream):
        """mdQaccum as `host_dq_layout.accum_shape`; mdQ like q; cu_seqlens_q [b + 1] when
        varlen."""
        mdQaccum = assume_aligned_strides(mdQaccum, _VEC)
        mdQ = assume_aligned_strides(mdQ, self.vec)
        batch = SeqInfo.num_batches(mdQ, mCuSeqlensQ)
        grid = (cute.ceil_div(max_seqlen_q, self.tile_m), mdQ.shape[-2], batch)
        mma = dq_tiled_mma(self.dtype, self.tile_m, self.hdim, self.split, self.swapped)
        # A warpgroup's columns: hdim 96 and 192 split theirs in two 48 and 96 wide; dQᵀ
        # splits hdim as its M.
        s_layout = swizzled_layout(self.out_dtype, (self.tile_m, self.hdim),
                                   self.hdim // self.split[0 if self.swapped else 1])
        store = row_store(self.out_dtype, self.hdim, DQ_THREADS)

        @cute.struct
        class SharedStorage:
            sdQ: smem_tile(self.out_dtype, s_layout)

        self.kernel(mdQaccum, mdQ, scale, mCuSeqlensQ, mma, s_layout, store,
                    SharedStorage).launch(grid=grid, block=[DQ_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32,
               mCuSeqlensQ: Optional[cute.Tensor], mma: cute.TiledMma,
               s_layout: cute.ComposedLayout, store: cute.TiledCopy,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sdQ = storage.sdQ.get_tensor(s_layout.outer, swizzle=s_layout.inner)
        rows = SeqInfo.extent(mdQ, mCuSeqlensQ)
        seq = SeqInfo(batch, rows, rows, mCuSeqlensQ)
        valid_rows = seq.seqlen_q - m_block * self.tile_m
        # Uniform over the CTA, so every thread reaches the barrier or none does.
        if valid_rows > 0:
            tile = (self.tile_m, self.hdim)
            acc_tile = (self.hdim, self.tile_m) if cutlass.const_expr(self.swapped) else tile
            acc = cute.make_rmem_tensor(mma.get_slice(tidx).partition_shape_C(acc_tile), Float32)
            src = tile_of(mdQaccum, seq, head, m_block, self.tile_m)
            cute.autovec_copy(thread_view(src, tidx, self.per_thread), as_vectors(acc))
            out = cute.make_rmem_tensor_like(acc, self.out_dtype)
            out.store((acc.load() * scale).to(self.out_dtype))
            # 32-bit stores of the fragment's column pairs; the 128-byte swizzle puts the 8
            # rows of a warp's store in 8 different 16-byte chunks (no bank conflicts).
            s_acc = transpose_view(sdQ) if cutlass.const_expr(self.swapped) else sdQ
            cute.autovec_copy(out, mma.get_slice(tidx).partition_C(s_acc))
            cute.arch.barrier()
            g = cute.local_tile(seq.q_view(mdQ, head), tile, (m_block, 0))
            store_tile_rows(store, tidx, sdQ, g, valid_rows)
