"""FlashAttention-2 backward on sm80 (recompute from LSE, FA2's work split).

Parallel over K/V tiles: a CTA keeps dK and dV of its keys in registers while it walks the query
tiles that see them, recomputing P = exp2(S · scale_log2 − LSE · log2 e) from the forward's LSE.
dQ gets a partial sum from every K/V tile, added with fp32 atomics into a buffer laid out like Q;
the postprocess kernel scales and converts it.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_cute.blocks.bwd import (
    atomic_add_rows,
    p_and_ds,
    p_and_ds_dropout,
    row_stats,
    store_acc_tile,
)
from flash_cute.blocks.dropout import Dropout
from flash_cute.blocks.dsl_state import DslState
from flash_cute.blocks.layouts import acc_to_mn, assume_aligned_strides, transpose_view
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
from flash_cute.contract.block_range import m_block_range, narrow_pair
from flash_cute.contract.kernel_args import BwdArgs
from flash_cute.contract.variant import Variant

from .config import BWD_SCHEDULES, bwd_smem_bytes
from .mma import SmemGemm, tiled_mma
from .tiles import gmem_tiled_copy, load_rows, smem_layout


class AmpereBwd:
    """Backward kernel: one CTA per (K/V tile, query head, batch).

    | warps        | role                                                                  |
    |--------------|-----------------------------------------------------------------------|
    | 0..7 (all)   | cp.async loads; S = Q Kᵀ and dP = dO Vᵀ; P, dS to shared memory;       |
    |              | dV += Pᵀ dO, dK += dSᵀ Q; dQ = dS K added to dQaccum with fp32 atomics |

    | stage (per query tile m) | what                                                  |
    |--------------------------|-------------------------------------------------------|
    | 1 | wait for Q[m], dO[m]; S = Q Kᵀ, softcap, mask, dP = dO Vᵀ                      |
    | 2 | P = exp2(S·scale_log2 − LSE₂), dS = P ∘ (dP − Δ) [∘ (1 − tanh²)], both to smem  |
    | 3 | dV += Pᵀ dO, dK += dSᵀ Q, dQ = dS K → atomics; then cp.async Q[m+1], dO[m+1]    |

    dK/dV are written per query head; the host sums them over a GQA group. With seqused_q /
    seqused_k the lengths are those (`SeqInfo`): Q/dO and K/V rows past them are zero-filled on
    load and get no dQ atomics or dK/dV stores.
    """

    def pipeline(self):
        """This kernel's pipeline as data (`flash_cute.contract.pipeline`)."""
        from .pipelines import backward
        return backward(self)

    def __init__(self, dtype, hdim: int, hdim_v: Optional[int] = None,
                 variant: Variant = Variant(), schedule: Optional[tuple] = None,
                 deterministic: bool = False):
        if deterministic:
            raise ValueError("the ampere backward adds dQ with fp32 atomics: not deterministic")
        hdim_v = hdim if hdim_v is None else hdim_v
        self.dtype = dtype
        self.hdim, self.hdim_v = hdim, hdim_v
        schedule = schedule or BWD_SCHEDULES[hdim]
        self.tile_m, self.tile_n, self.num_warps = schedule[:3]
        self.warps_sdp, self.warps_dkv, self.warps_dq, self.num_stages = schedule[3:]
        self.num_threads = 32 * self.num_warps
        set_kernel_switches(self, variant)

    @property
    def smem_bytes(self) -> int:
        return bwd_smem_bytes(self.hdim, self.hdim_v)

    @cute.jit
    def __call__(self, args: BwdArgs, stream: cuda.CUstream):
        """`args`: a `kernel_args.BwdArgs`, dQaccum laid out like Q (`launch_bwd.RowDqAccum`)."""
        vec = 128 // self.dtype.width
        mQ, mK, mV, mdO = (assume_aligned_strides(t, vec) for t in (args.q, args.k, args.v,
                                                                      args.dout))
        mCuSeqlensQ = args.cu_seqlens_q
        layouts = (smem_layout(self.tile_m, self.hdim, self.num_stages),
                   smem_layout(self.tile_m, self.hdim_v, self.num_stages),
                   smem_layout(self.tile_n, self.hdim), smem_layout(self.tile_n, self.hdim_v),
                   smem_layout(self.tile_m, self.tile_n))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[0])], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[1])], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[2])], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[3])], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[4])], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[4])], 1024]

        batch = SeqInfo.num_batches(mQ, mCuSeqlensQ)
        grid = (cute.ceil_div(args.max_seqlen_k, self.tile_n), mQ.shape[-2], batch)
        scale_log2, mod_scale = fold_scores(self.score_mod, args.softmax_scale, args.softcap)
        self.kernel(
            mQ, mK, mV, mdO, args.lse_log2, args.delta, args.dq_accum, args.dk, args.dv,
            args.softmax_scale, scale_log2, mod_scale, args.window_left, args.window_right,
            args.max_seqlen_q if cutlass.const_expr(self.varlen) else None, mCuSeqlensQ,
            args.cu_seqlens_k, args.seqused_q, args.seqused_k, *layouts,
            gmem_tiled_copy(self.dtype, self.num_threads, self.hdim),
            gmem_tiled_copy(self.dtype, self.num_threads, self.hdim_v),
            tiled_mma(self.dtype, self.warps_sdp), tiled_mma(self.dtype, self.warps_dkv),
            tiled_mma(self.dtype, self.warps_dq), args.rng_seed, args.keep_threshold,
            args.dropout_scale, aux_tensors(self, args), block_mask_tensors(self, args),
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSElog2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32, scale_log2: Float32,
               mod_scale: Float32, window_left: Int32, window_right: Int32,
               max_seqlen_q: Optional[Int32],
               mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, copy_qk: cute.TiledCopy, copy_v: cute.TiledCopy,
               mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dq: cute.TiledMma,
               mSeed: Optional[cute.Tensor], keep_threshold: Int32, dropout_scale: Float32,
               aux, block_mask, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head, batch = cute.arch.block_idx()
        head_kv = head // (mQ.shape[-2] // mK.shape[-2])
        seq = SeqInfo(batch, SeqInfo.extent(mQ, mCuSeqlensQ), SeqInfo.extent(mK, mCuSeqlensK),
                      mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, max_seqlen_q=max_seqlen_q)
        if n_block * self.tile_n < seq.seqlen_k:
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sdO = storage.sdO.get_tensor(sdO_layout)
            sK = storage.sK.get_tensor(sK_layout)
            sV = storage.sV.get_tensor(sV_layout)
            sP = storage.sP.get_tensor(sP_layout)
            sdS = storage.sdS.get_tensor(sP_layout)
            win_left = window_left if cutlass.const_expr(self.has_window_left) else None
            win_right = window_right if cutlass.const_expr(self.has_window_right) else None
            m_min, m_max = m_block_range(n_block, self.tile_m, self.tile_n, seq.seqlen_q,
                                         seq.seqlen_k, self.causal, win_left, win_right,
                                         imin=cutlass.min, imax=cutlass.max)
            states, ranges = block_mask_parts(block_mask)
            sparse = block_ranges(self, ranges, seq.batch, head, n_block)
            if cutlass.const_expr(sparse is not None):
                m_min, m_max = narrow_pair(m_min, m_max, *sparse, imin=cutlass.min,
                                           imax=cutlass.max)

            loader = TileLoader(self, tidx, seq, copy_qk, copy_v, mQ, mdO, sQ, sdO, head)
            thr_qk, thr_v = copy_qk.get_slice(tidx), copy_v.get_slice(tidx)
            kv_rows = seq.seqlen_k - n_block * self.tile_n
            gK = cute.local_tile(seq.k_view(mK, head_kv), (self.tile_n, self.hdim), (n_block, 0))
            gV = cute.local_tile(seq.k_view(mV, head_kv), (self.tile_n, self.hdim_v), (n_block, 0))
            load_rows(copy_qk, thr_qk.partition_S(gK), thr_qk.partition_D(sK),
                      thr_qk.partition_S(cute.make_identity_tensor((self.tile_n, self.hdim))),
                      kv_rows)
            load_rows(copy_v, thr_v.partition_S(gV), thr_v.partition_D(sV),
                      thr_v.partition_S(cute.make_identity_tensor((self.tile_n, self.hdim_v))),
                      kv_rows)
            if m_max > m_min:
                loader.load(m_min, 0)
            cute.arch.cp_async_commit_group()

            gemm_s = SmemGemm(mma_sdp, tidx, self.dtype, sQ, sK)
            gemm_dp = SmemGemm(mma_sdp, tidx, self.dtype, sdO, sV)
            gemm_dv = SmemGemm(mma_dkv, tidx, self.dtype, transpose_view(sP), transpose_view(sdO),
                               True, True)
            gemm_dk = SmemGemm(mma_dkv, tidx, self.dtype, transpose_view(sdS), transpose_view(sQ),
                               True, True)
            gemm_dq = SmemGemm(mma_dq, tidx, self.dtype, sdS, transpose_view(sK), False, True)
            acc_dk = gemm_dk.new_acc((self.tile_n, self.hdim))
            acc_dv = gemm_dv.new_acc((self.tile_n, self.hdim_v))
            drop = None
            if cutlass.const_expr(self.dropout):
                # With warps side by side in N a thread's 8-column atoms are 32 columns
                # apart (`mma.tiled_mma`), not in pairs.
                drop = Dropout(mSeed, keep_threshold, dropout_scale,
                               (batch, head, mQ.shape[-2]), self.tile_m, self.tile_n,
                               aligned=self.warps_sdp[1] == 1, framed=self.dropout_frame)
            step = BwdStep(self, tidx, seq, mma_sdp, mma_dq, mLSElog2, mDelta, mdQaccum, head,
                           sP, sdS, scale_log2, mod_scale, win_left, win_right, drop, aux,
                           states)
            for m_block in cutlass.range(m_min, m_max, unroll=1):
                stage = (m_block - m_min) % self.num_stages
                if cutlass.const_expr(self.num_stages > 1):
                    # The other stage was released by the barrier that ended tile m-1.
                    if m_block + 1 < m_max:
                        loader.load(m_block + 1, 1 - stage)
                    cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(1)
                else:
                    cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()
                step.compute_p_ds(gemm_s, gemm_dp, m_block, n_block, stage)
                cute.arch.sync_threads()
                gemm_dv.run(acc_dv, stage)
                gemm_dk.run(acc_dk, stage)
                step.dq_atomic(gemm_dq, m_block)
                cute.arch.sync_threads()
                if cutlass.const_expr(self.num_stages == 1):
                    if m_block + 1 < m_max:
                        loader.load(m_block + 1, 0)
                    cute.arch.cp_async_commit_group()

            acc_dk.store(acc_dk.load() * softmax_scale)
            if cutlass.const_expr(self.dropout):
                acc_dv.store(acc_dv.load() * dropout_scale)
            store_acc_tile(mma_dkv, tidx, acc_dk, seq.k_view(mdK, head), (self.tile_n, self.hdim),
                           n_block, kv_rows)
            store_acc_tile(mma_dkv, tidx, acc_dv, seq.k_view(mdV, head), (self.tile_n, self.hdim_v),
                           n_block, kv_rows)


class TileLoader(DslState):
    """cp.async of the Q and dO tiles of query block m (rows past seqlen_q zero-filled)."""

    def __init__(self, cfg: AmpereBwd, tidx, seq, copy_qk, copy_v, mQ, mdO, sQ, sdO, head):
        thr_qk, thr_v = copy_qk.get_slice(tidx), copy_v.get_slice(tidx)
        self.cfg, self.seq = cfg, seq
        self.copy_qk, self.copy_v = copy_qk, copy_v
        gQ = cute.local_tile(seq.q_view(mQ, head), (cfg.tile_m, cfg.hdim), (None, 0))
        gdO = cute.local_tile(seq.q_view(mdO, head), (cfg.tile_m, cfg.hdim_v), (None, 0))
        self.tQgQ, self.tQsQ = thr_qk.partition_S(gQ), thr_qk.partition_D(sQ)
        self.tdOgdO, self.tdOsdO = thr_v.partition_S(gdO), thr_v.partition_D(sdO)
        self.tQcQ = thr_qk.partition_S(cute.make_identity_tensor((cfg.tile_m, cfg.hdim)))
        self.tdOcdO = thr_v.partition_S(cute.make_identity_tensor((cfg.tile_m, cfg.hdim_v)))

    @cute.jit
    def load(self, m_block: Int32, stage):
        rows = self.seq.seqlen_q - m_block * self.cfg.tile_m
        sQ, sdO = self.tQsQ, self.tdOsdO
        if cutlass.const_expr(self.cfg.num_stages > 1):
            sQ, sdO = sQ[None, None, None, stage], sdO[None, None, None, stage]
        load_rows(self.copy_qk, self.tQgQ[None, None, None, m_block], sQ, self.tQcQ, rows)
        load_rows(self.copy_v, self.tdOgdO[None, None, None, m_block], sdO, self.tdOcdO, rows)


class BwdStep(DslState):
    """The per-query-tile math: P and dS into shared memory, and the dQ partial sum."""

    def __init__(self, cfg: AmpereBwd, tidx, seq, mma_sdp, mma_dq, mLSElog2, mDelta, mdQaccum,
                 head, sP, sdS, scale_log2, mod_scale, win_left, win_right, dropout=None,
                 aux=None, block_states=None):
        self.cfg, self.seq, self.head = cfg, seq, head
        self.dropout = dropout
        self.scale_log2 = scale_log2
        self.win_left, self.win_right = win_left, win_right
        thr_sdp = mma_sdp.get_slice(tidx)
        self.coord_s = acc_to_mn(thr_sdp.partition_C(
            cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))))
        self.coord_dq = acc_to_mn(mma_dq.get_slice(tidx).partition_C(
            cute.make_identity_tensor((cfg.tile_m, cfg.hdim))))
        self.g_lse = seq.lse_view(mLSElog2, head)
        self.g_delta = seq.lse_view(mDelta, head)
        self.g_dq = seq.q_view(mdQaccum, head)
        self.scores = tile_scores(cfg, mod_scale,
                                  AttentionMask(cfg.tile_m, cfg.tile_n, seq.seqlen_q,
                                                seq.seqlen_k, cfg.causal, win_left, win_right),
                                  aux, seq.batch, head, block_states, seq)
        r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cfg.dtype,
                                       num_bits_per_copy=2 * cfg.dtype.width)
        self.r2s_atom = r2s_atom
        self.thr_r2s = cute.make_tiled_copy_C(r2s_atom, mma_sdp).get_slice(tidx)
        self.tPsP = self.thr_r2s.partition_D(sP)
        self.tdSsdS = self.thr_r2s.partition_D(sdS)

    @cute.jit
    def compute_p_ds(self, gemm_s: SmemGemm, gemm_dp: SmemGemm, m_block: Int32, n_block: Int32,
                     stage):
        cfg = self.cfg
        lse, delta = row_stats(self.coord_s, m_block, cfg.tile_m, self.seq.seqlen_q, self.g_lse,
                               self.g_delta)
        state = self.scores.tile_state(m_block, n_block)
        acc_s = gemm_s.new_acc((cfg.tile_m, cfg.tile_n))
        gemm_s.run(acc_s, stage)
        s_mn = acc_to_mn(acc_s)
        grad_mn = None
        if cutlass.const_expr(self.scores.needs_grad):
            grad_mn = acc_to_mn(cute.make_rmem_tensor_like(acc_s, Float32))
        self.scores.prepare(s_mn, self.coord_s, m_block, n_block, grad_mn=grad_mn, state=state)
        acc_dp = gemm_dp.new_acc((cfg.tile_m, cfg.tile_n))
        gemm_dp.run(acc_dp, stage)
        dp_mn = acc_to_mn(acc_dp)
        hook = self.scores.ds_hook(self.coord_s, m_block, n_block)
        if cutlass.const_expr(self.dropout is None):
            p_and_ds(s_mn, dp_mn, lse, delta, self.scale_log2, cfg.score_mod, grad_mn, hook)
        else:
            p_and_ds_dropout(s_mn, dp_mn, lse, delta, self.scale_log2, cfg.score_mod,
                             self.dropout, self.coord_s, m_block, n_block, grad_mn, hook)
        r_p = cute.make_rmem_tensor_like(acc_s, cfg.dtype)
        r_p.store(acc_s.load().to(cfg.dtype))
        r_ds = cute.make_rmem_tensor_like(acc_dp, cfg.dtype)
        r_ds.store(acc_dp.load().to(cfg.dtype))
        cute.copy(self.r2s_atom, self.thr_r2s.retile(r_p), self.tPsP)
        cute.copy(self.r2s_atom, self.thr_r2s.retile(r_ds), self.tdSsdS)

    @cute.jit
    def dq_atomic(self, gemm_dq: SmemGemm, m_block: Int32):
        """dQ partial = dS K[n]; fp32 atomics into the rows of this query tile."""
        cfg = self.cfg
        acc_dq = gemm_dq.new_acc((cfg.tile_m, cfg.hdim))
        gemm_dq.run(acc_dq)
        g_dq = cute.local_tile(self.g_dq, (cfg.tile_m, cfg.hdim), (m_block, 0))
        atomic_add_rows(acc_to_mn(acc_dq), self.coord_dq, g_dq,
                        self.seq.seqlen_q - m_block * cfg.tile_m)
