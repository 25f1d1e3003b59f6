"""FlashAttention-2 forward on sm80: cp.async + ldmatrix + mma.sync.

Every warp owns tile_m / num_warps query rows and runs the whole loop for them (the FA2 work
split: K and V are shared through shared memory, nothing else is exchanged between warps).
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp

from flash_cute.blocks.dropout import Dropout
from flash_cute.blocks.dsl_state import DslState
from flash_cute.blocks.layouts import acc_to_mn, acc_to_operand_a, assume_aligned_strides
from flash_cute.blocks.mask import AttentionMask
from flash_cute.blocks.score import (
    aux_tensors,
    block_mask_parts,
    block_mask_tensors,
    block_ranges,
    fold_scores,
    set_kernel_switches,
    tile_scores,
)
from flash_cute.blocks.seqlen import SeqInfo
from flash_cute.blocks.softmax import OnlineSoftmax, rescale_o
from flash_cute.contract.block_range import block_range, narrow, split_range
from flash_cute.contract.kernel_args import FwdArgs
from flash_cute.contract.variant import Variant, kernel_head_dims

from .config import FWD_SCHEDULES, fwd_smem_bytes
from .mma import tiled_mma
from .tiles import gmem_tiled_copy, load_rows, smem_layout


class AmpereFwd:
    """Forward kernel: O = softmax(Q Kᵀ · scale) V and LSE, one CTA per (query tile, head, batch).

    | warps        | role                                                              |
    |--------------|-------------------------------------------------------------------|
    | 0..W-1 (all) | cp.async loads, S = Q Kᵀ, mask, online softmax, O += P V, epilogue |

    | stage (per K/V block n, visited right to left) | overlaps with            |
    |------------------------------------------------|--------------------------|
    | cp.async V[n]                                  | S = Q K[n]ᵀ              |
    | cp.async K[n-1]                                | softmax(S), O += P V[n]  |

    Q stays in shared memory (ldmatrix per k-block); P goes from the S accumulator straight into
    the A operand of P V. The epilogue stages O through the Q buffer for 128-bit stores.

    With seqused_q / seqused_k the lengths are those (`SeqInfo`): rows past them are zero-filled
    on load, never stored, and the masks align to the used lengths.

    Split-KV (`split_kv`): the grid's head axis counts heads x splits (split-major); each CTA
    reduces its split's K/V blocks (`block_range.split_range`) and stores O, fp32, and LSE
    from registers into its split's partials, for `lse_merge`.
    """

    def pipeline(self):
        """This kernel's pipeline as data (`flash_cute.contract.pipeline`)."""
        from .pipelines import forward
        return forward(self)

    def __init__(self, dtype, hdim: int, hdim_v: Optional[int] = None,
                 variant: Variant = Variant(), schedule: Optional[tuple] = None):
        self.dtype = dtype
        self.hdim, self.hdim_v = kernel_head_dims("ampere", hdim, hdim_v, FWD_SCHEDULES,
                                                  schedule)
        self.tile_m, self.tile_n, self.num_warps = schedule or FWD_SCHEDULES[hdim]
        self.num_threads = 32 * self.num_warps
        set_kernel_switches(self, variant)

    @property
    def smem_bytes(self) -> int:
        return fwd_smem_bytes(self.hdim, self.hdim_v, (self.tile_m, self.tile_n))

    # ---------------------------------------------------------------- host side

    @cute.jit
    def __call__(self, args: FwdArgs, stream: cuda.CUstream):
        """`args`: a `kernel_args.FwdArgs` (its docstring gives the layouts)."""
        vec = 128 // self.dtype.width
        mQ, mK, mV = (assume_aligned_strides(t, vec) for t in (args.q, args.k, args.v))
        # A split-KV partial is fp32, allocated by the launch with 16-byte rows.
        mO = assume_aligned_strides(args.out, 128 // args.out.element_type.width)
        mCuSeqlensQ = args.cu_seqlens_q
        sQ_layout = smem_layout(self.tile_m, self.hdim)
        sK_layout = smem_layout(self.tile_n, self.hdim)
        sV_layout = smem_layout(self.tile_n, self.hdim_v)
        sO_layout = smem_layout(self.tile_m, self.hdim_v)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        mma = tiled_mma(self.dtype, (self.num_warps, 1))
        batch = SeqInfo.num_batches(mQ, mCuSeqlensQ)
        heads = mQ.shape[-2] * args.num_splits if cutlass.const_expr(self.split_kv) \
            else mQ.shape[-2]
        grid = (cute.ceil_div(args.max_seqlen_q, self.tile_m), heads, batch)
        scale_log2, mod_scale = fold_scores(self.score_mod, args.softmax_scale, args.softcap)
        self.kernel(
            mQ, mK, mV, mO, args.lse, scale_log2, mod_scale, args.window_left,
            args.window_right, args.max_seqlen_q if cutlass.const_expr(self.varlen) else None,
            mCuSeqlensQ, args.cu_seqlens_k, args.seqused_q,
            args.seqused_k,
            sQ_layout, sK_layout, sV_layout,
            sO_layout,
            gmem_tiled_copy(self.dtype, self.num_threads, self.hdim),
            gmem_tiled_copy(self.dtype, self.num_threads, self.hdim_v),
            gmem_tiled_copy(self.dtype, self.num_threads, self.hdim_v,
                            cute.nvgpu.CopyUniversalOp()),
            mma, args.rng_seed, args.keep_threshold, args.dropout_scale, args.num_splits,
            args.blocks_per_split, aux_tensors(self, args), block_mask_tensors(self, args),
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, scale_log2: Float32, mod_scale: Float32,
               window_left: Int32, window_right: Int32, max_seqlen_q: Optional[Int32],
               mCuSeqlensQ: Optional[cute.Tensor],
               mCuSeqlensK: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
               mSeqUsedK: Optional[cute.Tensor], sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout, copy_qk: cute.TiledCopy, copy_v: cute.TiledCopy,
               copy_o: cute.TiledCopy, tiled_mma: cute.TiledMma, mSeed: Optional[cute.Tensor],
               keep_threshold: Int32, dropout_scale: Float32, num_splits: Int32,
               blocks_per_split: Int32, aux, block_mask, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        split = Int32(0)
        if cutlass.const_expr(self.split_kv):
            split = head // mQ.shape[-2]
            head = head - split * mQ.shape[-2]
            mO = mO[(split,) + (None,) * (cute.rank(mO) - 1)]
            mLSE = mLSE[(split,) + (None,) * (cute.rank(mLSE) - 1)]
        if cutlass.const_expr(self.causal or self.has_window_right):
            # Heaviest query tiles first, so the tail of the grid is short.
            m_block = cute.arch.grid_dim()[0] - 1 - m_block
        head_kv = head // (mQ.shape[-2] // mK.shape[-2])
        seq = SeqInfo(batch, SeqInfo.extent(mQ, mCuSeqlensQ), SeqInfo.extent(mK, mCuSeqlensK),
                      mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, max_seqlen_q=max_seqlen_q)
        if m_block * self.tile_m < seq.seqlen_q:
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sK_layout)
            sV = storage.sV.get_tensor(sV_layout)
            gQ = cute.local_tile(seq.q_view(mQ, head), (self.tile_m, self.hdim), (m_block, 0))
            gK = cute.local_tile(seq.k_view(mK, head_kv), (self.tile_n, self.hdim), (None, 0))
            gV = cute.local_tile(seq.k_view(mV, head_kv), (self.tile_n, self.hdim_v), (None, 0))
            win_left = window_left if cutlass.const_expr(self.has_window_left) else None
            win_right = window_right if cutlass.const_expr(self.has_window_right) else None
            rng = block_range(m_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                              self.causal, win_left, win_right, imin=cutlass.min, imax=cutlass.max)
            states, ranges = block_mask_parts(block_mask)
            sparse = block_ranges(self, ranges, seq.batch, head, m_block)
            if cutlass.const_expr(sparse is not None):
                rng = narrow(rng, *sparse, imin=cutlass.min, imax=cutlass.max)
            if cutlass.const_expr(self.split_kv):
                rng = split_range(rng, split, num_splits, blocks_per_split, imin=cutlass.min,
                                  imax=cutlass.max)
            scores = tile_scores(self, mod_scale,
                                 AttentionMask(self.tile_m, self.tile_n, seq.seqlen_q,
                                               seq.seqlen_k, self.causal, win_left, win_right),
                                 aux, seq.batch, head, states, seq)

            thr_mma = tiled_mma.get_slice(tidx)
            acc_o = cute.make_rmem_tensor(
                thr_mma.partition_shape_C((self.tile_m, self.hdim_v)), Float32)
            acc_o.fill(0.0)
            softmax = OnlineSoftmax(scale_log2, cute.size(acc_to_mn(acc_o), mode=[0]), 4,
                                    self.ex2_per16)
            softmax.reset()
            drop = None
            if cutlass.const_expr(self.dropout):
                drop = Dropout(mSeed, keep_threshold, dropout_scale,
                               (batch, head, mQ.shape[-2]), self.tile_m, self.tile_n,
                               framed=self.dropout_frame)

            thr_qk = copy_qk.get_slice(tidx)
            thr_v = copy_v.get_slice(tidx)
            q_rows = seq.seqlen_q - m_block * self.tile_m
            load_rows(copy_qk, thr_qk.partition_S(gQ), thr_qk.partition_D(sQ),
                           thr_qk.partition_S(cute.make_identity_tensor((self.tile_m, self.hdim))),
                           q_rows)
            tKgK, tKsK = thr_qk.partition_S(gK), thr_qk.partition_D(sK)
            tKcK = thr_qk.partition_S(cute.make_identity_tensor((self.tile_n, self.hdim)))
            tVgV, tVsV = thr_v.partition_S(gV), thr_v.partition_D(sV)
            tVcV = thr_v.partition_S(cute.make_identity_tensor((self.tile_n, self.hdim_v)))
            if rng.n_block_max > rng.n_block_min:
                load_rows(copy_qk, tKgK[None, None, None, rng.n_block_max - 1], tKsK, tKcK,
                               seq.seqlen_k - (rng.n_block_max - 1) * self.tile_n)
            cute.arch.cp_async_commit_group()

            mma = MmaOperands(self, tiled_mma, thr_mma, tidx, sQ, sK, sV)
            coord_mn = acc_to_mn(thr_mma.partition_C(
                cute.make_identity_tensor((self.tile_m, self.tile_n))))
            for n_block in cutlass.range(rng.n_block_max - 1, rng.n_block_min - 1, -1, unroll=1):
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()
                load_rows(copy_v, tVgV[None, None, None, n_block], tVsV, tVcV,
                               seq.seqlen_k - n_block * self.tile_n)
                cute.arch.cp_async_commit_group()
                state = scores.tile_state(m_block, n_block)
                acc_s = mma.qk()
                acc_s_mn = acc_to_mn(acc_s)
                scores.prepare(acc_s_mn, coord_mn, m_block, n_block, rng, state=state)
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()
                if n_block > rng.n_block_min:
                    load_rows(copy_qk, tKgK[None, None, None, n_block - 1], tKsK, tKcK,
                                   seq.seqlen_k - (n_block - 1) * self.tile_n)
                cute.arch.cp_async_commit_group()
                row_scale = softmax.online_softmax(acc_s_mn)
                if cutlass.const_expr(self.dropout):
                    # After the row sums, which count every weight.
                    drop.drop(acc_s_mn, coord_mn, m_block, n_block)
                rescale_o(acc_to_mn(acc_o), row_scale)
                mma.pv(acc_s, acc_o)

            o_scale, lse = softmax.finalize(dropout_scale if cutlass.const_expr(self.dropout)
                                            else Float32(1.0))
            rescale_o(acc_to_mn(acc_o), o_scale)
            self.epilogue(acc_o, lse, sQ, sO_layout, copy_o, tiled_mma, thr_mma, tidx, seq,
                          mO, mLSE, head, m_block)

    @cute.jit
    def epilogue(self, acc_o, lse, sQ, sO_layout, copy_o, tiled_mma, thr_mma, tidx, seq,
                 mO, mLSE, head, m_block):
        """O through shared memory (reusing Q's buffer) to 128-bit stores (split-KV: the fp32
        partial from registers); LSE from the quad leader."""
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(self.split_kv):
            self.store_lse(lse, thr_mma, seq, mLSE, head, m_block)
            self.store_o_rows(acc_o, thr_mma, seq, mO, head, m_block)
        else:
            self.store_staged(acc_o, lse, sQ, sO_layout, copy_o, tiled_mma, thr_mma, tidx, seq,
                              mO, mLSE, head, m_block)

    @cute.jit
    def store_lse(self, lse, thr_mma, seq, mLSE, head, m_block):
        coord_o = acc_to_mn(thr_mma.partition_C(
            cute.make_identity_tensor((self.tile_m, self.hdim_v))))
        g_lse = seq.lse_view(mLSE, head)
        for r in cutlass.range_constexpr(cute.size(coord_o, mode=[0])):
            row = m_block * self.tile_m + coord_o[r, 0][0]
            if coord_o[0, 0][1] == 0 and row < seq.seqlen_q:
                g_lse[row] = lse[r]

    @cute.jit
    def store_o_rows(self, acc_o, thr_mma, seq, mO, head, m_block):
        """O straight from registers in mO's dtype, rows past seqlen_q skipped."""
        coord = acc_to_mn(thr_mma.partition_C(
            cute.make_identity_tensor((self.tile_m, self.hdim_v))))
        gO = cute.local_tile(seq.q_view(mO, head), (self.tile_m, self.hdim_v), (m_block, 0))
        acc_mn = acc_to_mn(acc_o)
        col0 = coord[0, 0][1]
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            row = coord[r, 0][0]
            if row < seq.seqlen_q - m_block * self.tile_m:
                g_row = cute.domain_offset((col0,), gO[row, None])
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    g_row[coord[0, c][1] - col0] = acc_mn[r, c].to(mO.element_type)

    @cute.jit
    def store_staged(self, acc_o, lse, sQ, sO_layout, copy_o, tiled_mma, thr_mma, tidx, seq,
                     mO, mLSE, head, m_block):
        cute.arch.sync_threads()
        sO = cute.make_tensor(sQ.iterator, sO_layout)
        r_o = cute.make_rmem_tensor_like(acc_o, self.dtype)
        r_o.store(acc_o.load().to(self.dtype))
        s2r_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype)
        thr_r2s = cute.make_tiled_copy_C(s2r_atom, tiled_mma).get_slice(tidx)
        cute.copy(s2r_atom, thr_r2s.retile(r_o), thr_r2s.partition_D(sO))

        self.store_lse(lse, thr_mma, seq, mLSE, head, m_block)
        cute.arch.sync_threads()
        gO = cute.local_tile(seq.q_view(mO, head), (self.tile_m, self.hdim_v), (m_block, 0))
        thr_o = copy_o.get_slice(tidx)
        tOsO = thr_o.partition_S(sO)
        tOrO = cute.make_rmem_tensor_like(tOsO, self.dtype)
        cute.copy(copy_o, tOsO, tOrO)
        tOgO = thr_o.partition_D(gO)
        tOcO = thr_o.partition_D(cute.make_identity_tensor((self.tile_m, self.hdim_v)))
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            if tOcO[0, m, 0][0] < seq.seqlen_q - m_block * self.tile_m:
                cute.copy(copy_o, tOrO[None, m, None], tOgO[None, m, None])


class MmaOperands(DslState):
    """The two GEMMs of one K/V block with their ldmatrix register pipelines.

    Built once per CTA (partitions and register fragments); `qk` and `pv` are called per block.
    """

    def __init__(self, cfg: AmpereFwd, tiled_mma, thr_mma, tidx, sQ, sK, sV):
        self.cfg = cfg
        self.tiled_mma = tiled_mma
        self.thr_mma = thr_mma
        sVt = cute.composition(sV, cute.make_layout((cfg.hdim_v, cfg.tile_n),
                                                    stride=(cfg.tile_n, 1)))
        self.tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        self.tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
        self.tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
        self.copy_q = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, cfg.dtype), tiled_mma)
        self.copy_k = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm, cfg.dtype), tiled_mma)
        self.copy_v = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm_t, cfg.dtype), tiled_mma)
        thr_q = self.copy_q.get_slice(tidx)
        thr_k = self.copy_k.get_slice(tidx)
        thr_v = self.copy_v.get_slice(tidx)
        self.tSsQ, self.tSrQ_v = thr_q.partition_S(sQ), thr_q.retile(self.tSrQ)
        self.tSsK, self.tSrK_v = thr_k.partition_S(sK), thr_k.retile(self.tSrK)
        self.tOsVt, self.tOrVt_v = thr_v.partition_S(sVt), thr_v.retile(self.tOrVt)

    @cute.jit
    def qk(self) -> cute.Tensor:
        """S = Q K[n]ᵀ, one k-block of Q and K in registers at a time."""
        acc_s = cute.make_rmem_tensor(
            self.thr_mma.partition_shape_C((self.cfg.tile_m, self.cfg.tile_n)), Float32)
        acc_s.fill(0.0)
        for k in cutlass.range_constexpr(cute.size(self.tSsQ, mode=[2])):
            cute.copy(self.copy_q, self.tSsQ[None, None, k], self.tSrQ_v[None, None, k])
            cute.copy(self.copy_k, self.tSsK[None, None, k], self.tSrK_v[None, None, k])
            cute.gemm(self.tiled_mma, acc_s, self.tSrQ[None, None, k], self.tSrK[None, None, k],
                      acc_s)
        return acc_s

    @cute.jit
    def pv(self, acc_p: cute.Tensor, acc_o: cute.Tensor):
        """O += P V[n], P converted in registers from the S accumulator."""
        r_p = cute.make_rmem_tensor_like(acc_p, self.cfg.dtype)
        r_p.store(acc_p.load().to(self.cfg.dtype))
        tOrP = acc_to_operand_a(r_p)
        num_k = cute.size(tOrP, mode=[2])
        cute.copy(self.copy_v, self.tOsVt[None, None, 0], self.tOrVt_v[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if cutlass.const_expr(k + 1 < num_k):
                cute.copy(self.copy_v, self.tOsVt[None, None, k + 1],
                          self.tOrVt_v[None, None, k + 1])
            cute.gemm(self.tiled_mma, acc_o, tOrP[None, None, k], self.tOrVt[None, None, k], acc_o)
