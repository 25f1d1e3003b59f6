"""The backward pass's two arch-neutral helper kernels (CuTe DSL), launched by
`flash_cute.runtime.bwd_prep`, which says what they compute."""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_cute.blocks.layouts import assume_aligned_strides
from flash_cute.blocks.row_io import copy_rows, row_copy
from flash_cute.blocks.seqlen import SeqInfo
from flash_cute.blocks.softmax import LOG2_E
from flash_cute.contract.row_split import ROW_THREADS, VECTORS_PER_THREAD, row_split

# fp32 values per 128-bit zero store (`BwdPreprocessKernel.zero_fill`).
_ZERO_VEC = 4


class BwdPreprocessKernel:
    """Delta and LSElog2 for every query row; one CTA per (row tile, head, batch).

    | warps | role                                                                          |
    |-------|-------------------------------------------------------------------------------|
    | 0-3   | all: 128-bit loads of O and dO, `threads_per_row` lanes per row, fp32 products |
    |       | summed in registers then by a butterfly shuffle; the row's first lane writes   |
    |       | Delta; LSElog2 one thread per row (coalesced)                                  |
    | 0-3   | `zero_fill`: 128-bit zero stores of the CTA's share of a flat fp32 buffer (the |
    |       | main kernel's dQaccum), so it needs no fill kernel of its own                  |

    O, dO: padded [b, sq, h, dv] or varlen [total_q, h, dv]; LSE, dLSE, Delta, LSElog2: fp32
    padded [b, h, sq] or varlen [h, total_q]. Rows past a sequence's length (seqused_q[b] when
    given) are neither read nor written: the main kernels never read their Delta or LSElog2
    (`flash_cute.blocks.bwd.row_stats` and `tile_row_values` stand in P = 0 for them).
    """

    num_threads = ROW_THREADS
    vectors_per_thread = VECTORS_PER_THREAD

    def __init__(self, dtype, hdim_v: int, varlen: bool = False, has_dlse: bool = False,
                 has_seqused: bool = False, zero_fill: bool = False):
        self.vec = 128 // dtype.width
        self.zero_fill = zero_fill
        if hdim_v % self.vec != 0:
            raise ValueError(f"hdim_v must be a multiple of {self.vec} (128-bit loads), "
                             f"got {hdim_v}")
        self.dtype = dtype
        self.hdim_v = hdim_v
        self.varlen = varlen
        self.has_dlse = has_dlse
        self.has_seqused = has_seqused
        self.threads_per_row, self.tile_m = row_split(
            hdim_v // self.vec, self.num_threads, self.vectors_per_thread)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mdLSE: Optional[cute.Tensor], mDelta: cute.Tensor, mLSElog2: cute.Tensor,
                 mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
                 max_seqlen_q: Int32, mZero: Optional[cute.Tensor], stream: cuda.CUstream):
        """Varlen: cu_seqlens_q [b + 1] int32; seqused_q [b] int32 or None; max_seqlen_q sizes
        the grid. `zero_fill`: mZero, a 16-byte aligned fp32 vector whose length is a multiple
        of 4, is set to 0 (else None)."""
        mO, mdO = (assume_aligned_strides(t, self.vec) for t in (mO, mdO))
        batch = SeqInfo.num_batches(mO, mCuSeqlensQ)
        grid = (cute.ceil_div(max_seqlen_q, self.tile_m), mO.shape[-2], batch)
        load = row_copy(self.dtype, self.vec, self.threads_per_row, self.num_threads)
        zeros = None
        if cutlass.const_expr(self.zero_fill):
            # (4, n / 4): one 128-bit piece per column.
            zeros = cute.make_tensor(mZero.iterator, cute.make_layout(
                (_ZERO_VEC, mZero.shape[0] // _ZERO_VEC), stride=(1, _ZERO_VEC)))
        self.kernel(mO, mdO, mLSE, mdLSE, mDelta, mLSElog2, mCuSeqlensQ, mSeqUsedQ, zeros,
                    load).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
               mdLSE: Optional[cute.Tensor], mDelta: cute.Tensor, mLSElog2: cute.Tensor,
               mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
               zeros: Optional[cute.Tensor], load: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.zero_fill):
            self.zero_share(zeros, tidx)
        rows = SeqInfo.extent(mO, mCuSeqlensQ)
        seq = SeqInfo(batch, rows, rows, mCuSeqlensQ, mCuSeqlensQ, mSeqUsedQ)
        valid_rows = seq.seqlen_q - m_block * self.tile_m
        if valid_rows > 0:
            self.store_lse_log2(self.row_tile(seq.lse_view(mLSE, head), m_block),
                                self.row_tile(seq.lse_view(mLSElog2, head), m_block),
                                valid_rows, tidx)
            dlse = None
            if cutlass.const_expr(self.has_dlse):
                dlse = self.row_tile(seq.lse_view(mdLSE, head), m_block)
            tile = (self.tile_m, self.hdim_v)
            self.store_delta(cute.local_tile(seq.q_view(mO, head), tile, (m_block, 0)),
                             cute.local_tile(seq.q_view(mdO, head), tile, (m_block, 0)),
                             dlse, self.row_tile(seq.lse_view(mDelta, head), m_block),
                             load, valid_rows, tidx)

    @cute.jit
    def zero_share(self, zeros: cute.Tensor, tidx: Int32):
        """This CTA's contiguous share of the (4, n) pieces of `zeros`, 128-bit stores of 0.
        Every CTA of the grid takes part, whether or not it has rows to read (varlen)."""
        num_x, num_y, num_z = cute.arch.grid_dim()
        bx, by, bz = cute.arch.block_idx()
        pieces = cute.size(zeros, mode=[1])
        per_cta = cute.ceil_div(pieces, num_x * num_y * num_z)
        first = (bx + num_x * (by + num_y * bz)) * per_cta
        last = cutlass.min(first + per_cta, pieces)
        zero = cute.make_rmem_tensor(cute.make_layout(_ZERO_VEC), Float32)
        zero.fill(0.0)
        for i in cutlass.range(first + tidx, last, self.num_threads, unroll=4):
            cute.autovec_copy(zero, zeros[None, i])

    def row_tile(self, rows: cute.Tensor, m_block: Int32) -> cute.Tensor:
        """The tile_m entries of a per-row vector that this CTA owns."""
        return cute.local_tile(rows, (self.tile_m,), (m_block,))

    @cute.jit
    def store_lse_log2(self, t_lse: cute.Tensor, t_lse_log2: cute.Tensor, valid_rows: Int32,
                       tidx: Int32):
        """LSE · log2 e, one thread per row; −inf (no key seen) becomes +inf: P = exp2(−inf) = 0."""
        rows = cutlass.min(valid_rows, self.tile_m)
        for i in cutlass.range_constexpr(-(-self.tile_m // self.num_threads)):
            row = tidx + i * self.num_threads
            if row < rows:
                lse = t_lse[row]
                t_lse_log2[row] = Float32.inf if lse == -Float32.inf else lse * Float32(LOG2_E)

    @cute.jit
    def store_delta(self, gO: cute.Tensor, gdO: cute.Tensor, t_dlse: Optional[cute.Tensor],
                    t_delta: cute.Tensor, load: cute.TiledCopy, valid_rows: Int32, tidx: Int32):
        """Delta = rowsum(dO ∘ O) (− dLSE) for a (tile_m, hdim_v) tile."""
        thr = load.get_slice(tidx)
        tOgO, tOgdO = thr.partition_S(gO), thr.partition_S(gdO)
        tOcO = thr.partition_S(cute.make_identity_tensor((self.tile_m, self.hdim_v)))
        # Zero first: every lane takes part in every row's shuffles, skipped rows included.
        rO, rdO = cute.make_rmem_tensor_like(tOgO), cute.make_rmem_tensor_like(tOgdO)
        rO.fill(0)
        rdO.fill(0)
        copy_rows(load, tOgO, rO, tOcO, valid_rows)
        copy_rows(load, tOgdO, rdO, tOcO, valid_rows)
        is_row_leader = tidx % self.threads_per_row == 0
        for m in cutlass.range_constexpr(cute.size(rO, mode=[1])):
            prod = rO[None, m, None].load().to(Float32) * rdO[None, m, None].load().to(Float32)
            delta = cute.arch.warp_reduction_sum(prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                                                 threads_in_group=self.threads_per_row)
            row = tOcO[0, m, 0][0]
            if is_row_leader and row < valid_rows:
                if cutlass.const_expr(t_dlse is not None):
                    delta = delta - t_dlse[row]
                t_delta[row] = delta


class BwdPostprocessKernel:
    """dQ = dQaccum · scale in the input dtype; one CTA per (row tile, head, batch).

    | warps | role                                                                        |
    |-------|-----------------------------------------------------------------------------|
    | 0-3   | all: 128-bit fp32 loads, scale, convert, 64-bit stores; `threads_per_row`    |
    |       | lanes per row                                                                |

    dQaccum (fp32) and dQ are laid out like q: padded [b, sq, h, d] or varlen [total_q, h, d].
    The op is elementwise, so varlen treats the whole pack as one sequence (no cu_seqlens).
    """

    num_threads = ROW_THREADS
    vectors_per_thread = VECTORS_PER_THREAD
    vec = 128 // Float32.width

    def __init__(self, dtype, hdim: int, varlen: bool = False):
        if hdim % self.vec != 0:
            raise ValueError(f"hdim must be a multiple of {self.vec}, got {hdim}")
        self.dtype = dtype
        self.hdim = hdim
        self.varlen = varlen
        self.threads_per_row, self.tile_m = row_split(
            hdim // self.vec, self.num_threads, self.vectors_per_thread)

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32,
                 stream: cuda.CUstream):
        """mdQaccum fp32 and mdQ, both [b, sq, h, d] (varlen: [total_q, h, d])."""
        mdQaccum, mdQ = (assume_aligned_strides(t, self.vec) for t in (mdQaccum, mdQ))
        rows = mdQ.shape[0] if cutlass.const_expr(self.varlen) else mdQ.shape[1]
        batch = 1 if cutlass.const_expr(self.varlen) else mdQ.shape[0]
        grid = (cute.ceil_div(rows, self.tile_m), mdQ.shape[-2], batch)
        load = row_copy(Float32, self.vec, self.threads_per_row, self.num_threads)
        store = row_copy(self.dtype, self.vec, self.threads_per_row, self.num_threads)
        self.kernel(mdQaccum, mdQ, scale, load, store).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32,
               load: cute.TiledCopy, store: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        tile = (self.tile_m, self.hdim)
        gA = cute.local_tile(self.head_rows(mdQaccum, batch, head), tile, (m_block, 0))
        gQ = cute.local_tile(self.head_rows(mdQ, batch, head), tile, (m_block, 0))
        valid_rows = self.head_rows(mdQ, batch, head).shape[0] - m_block * self.tile_m
        thr_load = load.get_slice(tidx)
        tAgA = thr_load.partition_S(gA)
        tAcA = thr_load.partition_S(cute.make_identity_tensor(tile))
        rA = cute.make_rmem_tensor_like(tAgA)
        copy_rows(load, tAgA, rA, tAcA, valid_rows)
        rQ = cute.make_rmem_tensor_like(rA, self.dtype)
        rQ.store((rA.load() * scale).to(self.dtype))
        copy_rows(store, rQ, store.get_slice(tidx).partition_D(gQ), tAcA, valid_rows)

    def head_rows(self, t: cute.Tensor, batch: Int32, head: Int32) -> cute.Tensor:
        """(rows, d) of one head of one batch (varlen: of the whole pack)."""
        if cutlass.const_expr(self.varlen):
            return t[None, head, None]
        return t[batch, None, head, None]


