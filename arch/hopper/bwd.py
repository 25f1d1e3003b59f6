"""FlashAttention-3 backward on sm90a (seed 10.3.2 recompute, 10.3.4 FA3): TMA + mbarrier
pipelines + WGMMA, warp-specialized. First cut: the real FA3 structure, correctness over speed.

Parallel over K/V tiles, like `arch.ampere.bwd`: a CTA keeps dK and dV of its tile_n keys in
registers while it walks the query tiles that see them (`m_block_range`), recomputing
P = exp2(S · scale_log2 − LSE · log2 e). dQ gets a partial sum from every K/V tile, added with
fp32 atomics into dQaccum (laid out like Q); `bwd_postprocess` scales and converts it.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from flash_cute.bwd_blocks import atomic_add_rows, p_and_ds, row_stats, store_acc_tile
from flash_cute.block_range import block_range, m_block_range, needs_mask
from flash_cute.dsl_state import DslState
from flash_cute.layouts import acc_to_mn, assume_aligned_strides, transpose_view
from flash_cute.mask import AttentionMask
from flash_cute.seqlen import SeqInfo
from flash_cute.softmax import apply_softcap, fold_scales
from flash_cute.variant import Variant, set_kernel_switches

from .config import (BWD_COMPILE_OPTIONS, BWD_SUPPORTED_HDIMS, BWD_TILES, CONSUMER_REGISTERS,
                     NUM_CONSUMER_WARPGROUPS, NUM_THREADS, PRODUCER_REGISTERS, SMEM_CAPACITY,
                     bwd_mma_splits, bwd_smem_bytes)
from .fwd import _ROWS_FIRST, _permute

# Named barrier of the 256 consumer threads around the shared P and dS tiles (id 0 is
# sync_threads'; the pipelines use mbarriers).
_PDS_BARRIER_ID = 1


class HopperBwd:
    """Backward kernel: one CTA per (K/V tile, query head, batch).

    | warpgroup | warps | registers | role                                                     |
    |-----------|-------|-----------|----------------------------------------------------------|
    | 0         | 0     | 24        | producer: TMA of K, V once, then Q[m], dO[m] per tile     |
    | 0         | 1..3  | 24        | idle (setmaxnreg is warpgroup-wide, so they stay)         |
    | 1, 2      | 4..11 | 240       | consumers: S, dP, P, dS, dV, dK, dQ (split below), store  |

    | pipeline (PipelineTmaAsync) | stages   | full barrier             | empty barrier      |
    |-----------------------------|----------|--------------------------|--------------------|
    | K + V                       | 1 (once) | TMA bytes of K and V     | 8 consumer warps   |
    | Q                           | q_stages | TMA bytes of a Q tile    | 8 consumer warps   |
    | dO                          | q_stages | TMA bytes of a dO tile   | 8 consumer warps   |

    Per query tile m the consumers (WGMMA; how the two warpgroups split each GEMM is
    `config.bwd_mma_splits`):

    1. wait Q[m]: S = Q Kᵀ; softcap, mask; wait dO[m]: dP = dO Vᵀ (both split over keys);
    2. P = exp2(S·scale_log2 − LSE₂), dS = P ∘ (dP − Δ) [∘ (1 − tanh²)] in registers;
    3. barrier (the previous tile's GEMMs are done with sP, sdS), P and dS to shared memory,
       async-proxy fence, barrier;
    4. dV += Pᵀ dO, dK += dSᵀ Q, dQ = dS K; release Q[m] and dO[m]; dQ to dQaccum with fp32
       atomics (a TMA reduce-add, `CopyReduceBulkTensorTileS2GOp`, through shared memory by a
       dedicated warp is the FA3 way and the next step).

    Then dK *= softmax_scale and dK, dV rows < seqlen_k go from registers to global memory,
    per query head (the host sums a GQA group). Rows of a Q/dO tile past seqlen_q (zero-filled
    by TMA, or the next varlen sequence) get LSE = +inf, so P = dS = 0 there; K/V rows past
    seqlen_k are masked to P = 0.

    Not yet (first cut): dQ by TMA reduce-add, P/dS double buffering, P kept in registers for
    dV (FA3's RS variant), overlap of the GEMMs with the pointwise work, deterministic dQ, a TMA
    store of dK/dV.
    """

    def __init__(self, dtype, hdim: int, hdim_v: Optional[int] = None,
                 variant: Variant = Variant(), tile: Optional[tuple] = None):
        hdim_v = hdim if hdim_v is None else hdim_v
        if tile is None and (hdim, hdim_v) not in BWD_SUPPORTED_HDIMS:
            raise ValueError(f"no sm90 backward for hdim {hdim}/{hdim_v}; "
                             f"have {sorted(BWD_SUPPORTED_HDIMS)}")
        self.dtype = dtype
        self.hdim, self.hdim_v = hdim, hdim_v
        self.tile_m, self.tile_n, self.q_stages = tile or BWD_TILES[hdim]
        self.splits = bwd_mma_splits((self.tile_m, self.tile_n, self.q_stages))
        self.num_threads = NUM_THREADS
        self.num_consumer_threads = 128 * NUM_CONSUMER_WARPGROUPS
        set_kernel_switches(self, variant)

    @property
    def smem_bytes(self) -> int:
        return bwd_smem_bytes(self.hdim, self.hdim_v, (self.tile_m, self.tile_n, self.q_stages))

    # ---------------------------------------------------------------- host side

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSElog2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor,
                 mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32, softcap: Float32,
                 window_left: Int32, window_right: Int32, max_seqlen_k: Int32,
                 mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        """`AmpereBwd.__call__`'s contract: Q/dO/dQaccum like Q, K/V like K, dK/dV
        [.., nheads, d] (per query head; dtype or fp32), LSElog2 and Delta like the forward's
        LSE (see `flash_cute.bwd_prep`)."""
        vec = 128 // self.dtype.width
        # TMA needs 16-byte global strides; validation guarantees them, this tells the compiler.
        mQ, mK, mV, mdO = (assume_aligned_strides(t, vec) for t in (mQ, mK, mV, mdO))
        layouts = self._smem_layouts()
        sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout = layouts
        mmas = self._tiled_mmas()

        order, back = _ROWS_FIRST[self.varlen]
        tma_q, tQ = self._tma_load(mQ, order, sQ_layout, (self.tile_m, self.hdim))
        tma_do, tdO = self._tma_load(mdO, order, sdO_layout, (self.tile_m, self.hdim_v))
        tma_k, tK = self._tma_load(mK, order, sK_layout, (self.tile_n, self.hdim))
        tma_v, tV = self._tma_load(mV, order, sV_layout, (self.tile_n, self.hdim_v))
        tQ, tdO, tK, tV = (_permute(t, back) for t in (tQ, tdO, tK, tV))

        stages = self.q_stages

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]

        if cutlass.const_expr(SharedStorage.size_in_bytes() != self.smem_bytes
                              or self.smem_bytes > SMEM_CAPACITY):
            raise ValueError(f"shared memory: {SharedStorage.size_in_bytes()} B (estimated "
                             f"{self.smem_bytes}), capacity {SMEM_CAPACITY}")
        one_stage = lambda layout: cute.size_in_bytes(  # noqa: E731
            self.dtype, cute.slice_(layout, (None, None, 0)))
        tx_bytes = (one_stage(sK_layout) + one_stage(sV_layout), one_stage(sQ_layout),
                    one_stage(sdO_layout))
        batch = SeqInfo.num_batches(mQ, mCuSeqlensQ)
        grid = (cute.ceil_div(max_seqlen_k, self.tile_n), mQ.shape[-2], batch)
        scale_log2, scale_div_cap = fold_scales(softmax_scale, softcap, self.has_softcap)
        self.kernel(
            tma_q, tQ, tma_do, tdO, tma_k, tK, tma_v, tV, mLSElog2, mDelta, mdQaccum, mdK, mdV,
            softmax_scale, scale_log2, scale_div_cap, window_left, window_right, mCuSeqlensQ,
            mCuSeqlensK, *layouts, *mmas, SharedStorage, tx_bytes,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def _smem_layouts(self):
        """(Q, dO, K, V, P/dS) shared-memory layouts, each (rows, cols, stages), K-major (cols
        contiguous) and swizzled.

        Each tile is also read transposed (Qᵀ, dOᵀ as dK/dV's B, Kᵀ as dQ's B, Pᵀ, dSᵀ as
        dK/dV's A), i.e. MN-major, where a warpgroup's operand may be half the tile's
        columns. A swizzle atom may not straddle that half, so each atom is sized for the
        narrowest transposed use (FA3's trick to keep one copy of each tile)."""
        dkv_m, dkv_n = self.splits["dkv"]
        dq_n = self.splits["dq"][1]

        def layout(rows, cols, stages, major_size):
            kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, major_size)
            atom = warpgroup.make_smem_layout_atom(kind, self.dtype)
            return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))

        return (layout(self.tile_m, self.hdim, self.q_stages, self.hdim // dkv_n),
                layout(self.tile_m, self.hdim_v, self.q_stages, self.hdim_v // dkv_n),
                layout(self.tile_n, self.hdim, 1, self.hdim // dq_n),
                layout(self.tile_n, self.hdim_v, 1, self.hdim_v),
                layout(self.tile_m, self.tile_n, 1, self.tile_n // dkv_m))

    def _tiled_mmas(self):
        """(S/dP, dK, dV, dQ) WGMMAs, every operand from shared memory.

        S = Q Kᵀ and dP = dO Vᵀ: both K-major. dV = Pᵀ dO and dK = dSᵀ Q: both operands are
        transposed views (MN-major). dQ = dS K: dS K-major, Kᵀ MN-major."""
        K, MN = OperandMajorMode.K, OperandMajorMode.MN

        def mma(a_major, b_major, split, n):
            wg_m, wg_n = split
            return sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, a_major, b_major, Float32, (wg_m, wg_n, 1),
                (64, n // wg_n))

        s = self.splits
        return (mma(K, K, s["sdp"], self.tile_n), mma(MN, MN, s["dkv"], self.hdim),
                mma(MN, MN, s["dkv"], self.hdim_v), mma(K, MN, s["dq"], self.hdim))

    @staticmethod
    def _tma_load(t: cute.Tensor, order, staged_layout, tile):
        """TMA atom over the whole tensor (the kernel picks its tile by coordinates), with one
        stage of `staged_layout` as the shared-memory box."""
        return cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), _permute(t, order),
            cute.slice_(staged_layout, (None, None, 0)), tile)

    # ---------------------------------------------------------------- device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom,
               mdO: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom,
               mV: cute.Tensor, mLSElog2: cute.Tensor, mDelta: cute.Tensor,
               mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32,
               scale_log2: Float32, scale_div_cap: Float32, window_left: Int32,
               window_right: Int32, mCuSeqlensQ: Optional[cute.Tensor],
               mCuSeqlensK: Optional[cute.Tensor], sQ_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout,
               mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma, mma_dv: cute.TiledMma,
               mma_dq: cute.TiledMma, SharedStorage: cutlass.Constexpr,
               tx_bytes: cutlass.Constexpr):
        layouts = (sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout)
        mmas = (mma_sdp, mma_dk, mma_dv, mma_dq)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_do, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # Every thread takes part: warp 0 initializes the barriers, all see them.
        pipes = self._make_pipelines(storage, tx_bytes)
        smem = SmemTiles(storage, layouts)

        n_block, head, batch = cute.arch.block_idx()
        head_kv = head // (mQ.shape[-2] // mK.shape[-2])
        seq = SeqInfo(batch, mQ.shape[1], mK.shape[1], mCuSeqlensQ, mCuSeqlensK)
        # Uniform over the CTA (varlen tiles past the sequence), so no role is left waiting.
        if n_block * self.tile_n < seq.seqlen_k:
            win_left = window_left if cutlass.const_expr(self.has_window_left) else None
            win_right = window_right if cutlass.const_expr(self.has_window_right) else None
            m_min, m_max = m_block_range(n_block, self.tile_m, self.tile_n, seq.seqlen_q,
                                         seq.seqlen_k, self.causal, win_left, win_right,
                                         imin=cutlass.min, imax=cutlass.max)
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
                if warp_idx == 0:
                    self.produce((tma_q, tma_do, tma_k, tma_v), (mQ, mdO, mK, mV), smem, pipes,
                                 seq, head, head_kv, n_block, m_min, m_max)
            else:
                cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
                tidx = cute.arch.thread_idx()[0] - 128
                step = BwdStep(self, tidx, seq, mmas, smem, mLSElog2, mDelta, mdQaccum, head,
                               scale_log2, scale_div_cap, win_left, win_right)
                self.consume(step, pipes, m_min, m_max, n_block)
                step.acc_dk.store(step.acc_dk.load() * softmax_scale)
                kv_rows = seq.seqlen_k - n_block * self.tile_n
                store_acc_tile(mmas[1], tidx, step.acc_dk, seq.k_view(mdK, head),
                               (self.tile_n, self.hdim), n_block, kv_rows)
                store_acc_tile(mmas[2], tidx, step.acc_dv, seq.k_view(mdV, head),
                               (self.tile_n, self.hdim_v), n_block, kv_rows)

    def _make_pipelines(self, storage, tx_bytes):
        """(K+V, Q, dO) TMA pipelines; empty barriers count one arrive per consumer warp, full
        ones one producer arrive plus the stage's TMA bytes. K and V share one barrier (one
        expect_tx of both tiles' bytes)."""
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * NUM_CONSUMER_WARPGROUPS)
        make = lambda bars, stages, tx: pipeline.PipelineTmaAsync.create(  # noqa: E731
            num_stages=stages, producer_group=producer, consumer_group=consumers, tx_count=tx,
            barrier_storage=bars.data_ptr(), defer_sync=True)
        pipes = (make(storage.mbar_kv, 1, tx_bytes[0]),
                 make(storage.mbar_q, self.q_stages, tx_bytes[1]),
                 make(storage.mbar_do, self.q_stages, tx_bytes[2]))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return pipes

    @cute.jit
    def produce(self, atoms, tensors, smem, pipes, seq, head, head_kv, n_block, m_min, m_max):
        """Warp 0, all 32 lanes: `producer_acquire` elects the lane that arms the barrier, the
        TMA copy elects its own issuing lane. K and V are loaded even when no query tile sees
        this block, so the consumers' one wait is unconditional."""
        tma_q, tma_do, tma_k, tma_v = atoms
        mQ, mdO, mK, mV = tensors
        pipe_kv, pipe_q, pipe_do = pipes
        gQ = cute.local_tile(seq.q_view(mQ, head), (self.tile_m, self.hdim), (None, 0))
        gdO = cute.local_tile(seq.q_view(mdO, head), (self.tile_m, self.hdim_v), (None, 0))
        gK = cute.local_tile(seq.k_view(mK, head_kv), (self.tile_n, self.hdim), (n_block, 0))
        gV = cute.local_tile(seq.k_view(mV, head_kv), (self.tile_n, self.hdim_v), (n_block, 0))
        tQsQ, tQgQ = _tma_partition(tma_q, smem.sQ, gQ)
        tdOsdO, tdOgdO = _tma_partition(tma_do, smem.sdO, gdO)
        tKsK, tKgK = _tma_partition(tma_k, smem.sK, gK)
        tVsV, tVgV = _tma_partition(tma_v, smem.sV, gV)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        bar = pipe_kv.producer_get_barrier(kv_state)
        cute.copy(tma_k, tKgK, tKsK[None, 0], tma_bar_ptr=bar)
        cute.copy(tma_v, tVgV, tVsV[None, 0], tma_bar_ptr=bar)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        for m_block in cutlass.range(m_min, m_max, unroll=1):
            pipe_q.producer_acquire(state)
            cute.copy(tma_q, tQgQ[None, m_block], tQsQ[None, state.index],
                      tma_bar_ptr=pipe_q.producer_get_barrier(state))
            pipe_do.producer_acquire(state)
            cute.copy(tma_do, tdOgdO[None, m_block], tdOsdO[None, state.index],
                      tma_bar_ptr=pipe_do.producer_get_barrier(state))
            state.advance()

    @cute.jit
    def consume(self, step, pipes, m_min, m_max, n_block):
        """Both consumer warpgroups, in lockstep over the query tiles (they share P and dS)."""
        pipe_kv, pipe_q, pipe_do = pipes
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        for m_block in cutlass.range(m_min, m_max, unroll=1):
            step.run(pipe_q, pipe_do, state, m_block, n_block)
            state.advance()
        pipe_kv.consumer_release(kv_state)


def _tma_partition(atom, s: cute.Tensor, g: cute.Tensor):
    """TMA partition (no multicast) of a staged shared-memory tile and its global tile(s)."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                 cute.group_modes(g, 0, 2))


class SmemTiles(DslState):
    """The shared-memory tensors of one CTA, each (rows, cols, stages)."""

    def __init__(self, storage, layouts):
        get = lambda field, layout: field.get_tensor(layout.outer, swizzle=layout.inner)  # noqa: E731
        sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout = layouts
        self.sQ = get(storage.sQ, sQ_layout)
        self.sdO = get(storage.sdO, sdO_layout)
        self.sK = get(storage.sK, sK_layout)
        self.sV = get(storage.sV, sV_layout)
        self.sP = get(storage.sP, sPdS_layout)
        self.sdS = get(storage.sdS, sPdS_layout)


class BwdStep(DslState):
    """One consumer thread's view of the five GEMMs and the per-query-tile math; holds the dK
    and dV accumulators across the loop."""

    def __init__(self, cfg: HopperBwd, tidx, seq, mmas, smem: SmemTiles, mLSElog2, mDelta,
                 mdQaccum, head, scale_log2, scale_div_cap, win_left, win_right):
        self.cfg, self.seq = cfg, seq
        self.scale_log2, self.scale_div_cap = scale_log2, scale_div_cap
        self.win_left, self.win_right = win_left, win_right
        mma_sdp, mma_dk, mma_dv, mma_dq = mmas
        self.mma_sdp, self.mma_dk, self.mma_dv, self.mma_dq = mmas
        thr_sdp, thr_dk = mma_sdp.get_slice(tidx), mma_dk.get_slice(tidx)
        thr_dv, thr_dq = mma_dv.get_slice(tidx), mma_dq.get_slice(tidx)
        self.thr_sdp, self.thr_dq = thr_sdp, thr_dq
        frag_a = lambda thr, s: thr.make_fragment_A(thr.partition_A(s))  # noqa: E731
        frag_b = lambda thr, s: thr.make_fragment_B(thr.partition_B(s))  # noqa: E731
        self.tSrQ, self.tSrK = frag_a(thr_sdp, smem.sQ), frag_b(thr_sdp, smem.sK)
        self.tdPrdO, self.tdPrV = frag_a(thr_sdp, smem.sdO), frag_b(thr_sdp, smem.sV)
        self.tdVrPt = frag_a(thr_dv, transpose_view(smem.sP))
        self.tdVrdOt = frag_b(thr_dv, transpose_view(smem.sdO))
        self.tdKrdSt = frag_a(thr_dk, transpose_view(smem.sdS))
        self.tdKrQt = frag_b(thr_dk, transpose_view(smem.sQ))
        self.tdQrdS = frag_a(thr_dq, smem.sdS)
        self.tdQrKt = frag_b(thr_dq, transpose_view(smem.sK))

        self.acc_dk = cute.make_rmem_tensor(thr_dk.partition_shape_C((cfg.tile_n, cfg.hdim)),
                                            Float32)
        self.acc_dv = cute.make_rmem_tensor(thr_dv.partition_shape_C((cfg.tile_n, cfg.hdim_v)),
                                            Float32)
        self.acc_dk.fill(0.0)
        self.acc_dv.fill(0.0)

        self.coord_s = acc_to_mn(thr_sdp.partition_C(
            cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))))
        self.coord_dq = acc_to_mn(thr_dq.partition_C(
            cute.make_identity_tensor((cfg.tile_m, cfg.hdim))))
        self.g_lse = seq.lse_view(mLSElog2, head)
        self.g_delta = seq.lse_view(mDelta, head)
        self.g_dq = seq.q_view(mdQaccum, head)
        self.mask = AttentionMask(cfg.tile_m, cfg.tile_n, seq.seqlen_q, seq.seqlen_k, cfg.causal,
                                  win_left, win_right)
        # P and dS leave the S accumulator layout two 16-bit columns (32 bits) at a time
        # (stmatrix is the faster way; its fragment order differs from the accumulator's).
        r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cfg.dtype,
                                       num_bits_per_copy=2 * cfg.dtype.width)
        self.r2s_atom = r2s_atom
        self.thr_r2s = cute.make_tiled_copy_C(r2s_atom, mma_sdp).get_slice(tidx)
        self.tPsP = self.thr_r2s.partition_D(smem.sP[None, None, 0])
        self.tdSsdS = self.thr_r2s.partition_D(smem.sdS[None, None, 0])
        self.pds_barrier = pipeline.NamedBarrier(barrier_id=_PDS_BARRIER_ID,
                                                 num_threads=cfg.num_consumer_threads)

    @cute.jit
    def run(self, pipe_q, pipe_do, state, m_block: Int32, n_block: Int32):
        """Query tile `m_block` against this CTA's keys (steps 1-4 of `HopperBwd`)."""
        cfg = self.cfg
        stage = state.index
        # Global loads issued first, so their latency hides under the two GEMMs.
        lse, delta = row_stats(self.coord_s, m_block, self.cfg.tile_m, self.seq.seqlen_q,
                               self.g_lse, self.g_delta)
        pipe_q.consumer_wait(state)
        acc_s = wgmma(self.mma_sdp, self.new_acc_s(), self.tSrQ, self.tSrK, stage, 0, False)
        s_mn = acc_to_mn(acc_s)
        if cutlass.const_expr(cfg.has_softcap):
            apply_softcap(s_mn, self.scale_div_cap)
        rng = block_range(m_block, cfg.tile_m, cfg.tile_n, self.seq.seqlen_q, self.seq.seqlen_k,
                          cfg.causal, self.win_left, self.win_right,
                          imin=cutlass.min, imax=cutlass.max)
        if needs_mask(n_block, rng):
            self.mask.apply(s_mn, self.coord_s, m_block, n_block)
        pipe_do.consumer_wait(state)
        acc_dp = wgmma(self.mma_sdp, self.new_acc_s(), self.tdPrdO, self.tdPrV, stage, 0, False)
        p_and_ds(s_mn, acc_to_mn(acc_dp), lse, delta, self.scale_log2, self.cfg.has_softcap)

        r_p, r_ds = self.to_16bit(acc_s), self.to_16bit(acc_dp)
        # The previous tile's dV/dK/dQ GEMMs (of both warpgroups) are done with sP and sdS.
        self.pds_barrier.arrive_and_wait()
        cute.copy(self.r2s_atom, self.thr_r2s.retile(r_p), self.tPsP)
        cute.copy(self.r2s_atom, self.thr_r2s.retile(r_ds), self.tdSsdS)
        # Generic-proxy stores must be made visible to the async proxy that WGMMA reads
        # shared memory through, and both warpgroups' halves must be written.
        cute.arch.fence_view_async_shared()
        self.pds_barrier.arrive_and_wait()

        wgmma(self.mma_dv, self.acc_dv, self.tdVrPt, self.tdVrdOt, 0, stage, True)
        wgmma(self.mma_dk, self.acc_dk, self.tdKrdSt, self.tdKrQt, 0, stage, True)
        acc_dq = cute.make_rmem_tensor(
            self.thr_dq.partition_shape_C((cfg.tile_m, cfg.hdim)), Float32)
        acc_dq = wgmma(self.mma_dq, acc_dq, self.tdQrdS, self.tdQrKt, 0, 0, False)
        pipe_do.consumer_release(state)
        pipe_q.consumer_release(state)
        self.dq_atomic(acc_dq, m_block)

    @cute.jit
    def to_16bit(self, acc: cute.Tensor) -> cute.Tensor:
        r = cute.make_rmem_tensor_like(acc, self.cfg.dtype)
        r.store(acc.load().to(self.cfg.dtype))
        return r

    def new_acc_s(self) -> cute.Tensor:
        return cute.make_rmem_tensor(
            self.thr_sdp.partition_shape_C((self.cfg.tile_m, self.cfg.tile_n)), Float32)

    @cute.jit
    def dq_atomic(self, acc_dq: cute.Tensor, m_block: Int32):
        """dQ partial = dS K[n]; fp32 atomics into the in-bounds rows of this query tile."""
        g_dq = cute.local_tile(self.g_dq, (self.cfg.tile_m, self.cfg.hdim), (m_block, 0))
        atomic_add_rows(acc_to_mn(acc_dq), self.coord_dq, g_dq,
                        self.seq.seqlen_q - m_block * self.cfg.tile_m)


@cute.jit
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
          stage_a, stage_b, accumulate: cutlass.Constexpr[bool]) -> cute.Tensor:
    """acc (+)= A[stage_a] · B[stage_b] over every k-block, issued, committed and waited for.

    A fresh atom per GEMM: ACCUMULATE is atom state, and an atom reused across the run-time
    loop would carry it as a loop value. `accumulate=False` zero-initializes acc."""
    atom = cute.make_mma_atom(tiled_mma.op)
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        atom.set(warpgroup.Field.ACCUMULATE, accumulate or k != 0)
        cute.gemm(atom, acc, tA[None, None, k, stage_a], tB[None, None, k, stage_b], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
    return acc


def registers_per_role() -> dict:
    """setmaxnreg budgets of each role, for `inspect`."""
    return {"producer": PRODUCER_REGISTERS, "consumer": CONSUMER_REGISTERS}


def fake_backward_args(dtype, hdim: int, hdim_v: int, varlen: bool, dkv_fp32: bool = False):
    """Fake arguments of a backward main kernel (`AmpereBwd`/`HopperBwd` argument list) with
    dynamic batch, heads and lengths, padded or varlen, for cross-compiling."""
    from flash_cute.jit import dynamic_dim, fake_stream, fake_tensor

    h, hk = dynamic_dim(), dynamic_dim()
    if varlen:
        tq, tk, b1 = dynamic_dim(), dynamic_dim(), dynamic_dim()
        qs, ks, rows = (tq,), (tk,), (h, tq)
        cu = (fake_tensor(Int32, (b1,), align=4), fake_tensor(Int32, (b1,), align=4))
    else:
        b, sq, sk = dynamic_dim(), dynamic_dim(), dynamic_dim()
        qs, ks, rows = (b, sq), (b, sk), (b, h, sq)
        cu = (None, None)
    dkv_dtype, dkv_align = (Float32, 4) if dkv_fp32 else (dtype, 16)
    return (fake_tensor(dtype, qs + (h, hdim)), fake_tensor(dtype, ks + (hk, hdim)),
            fake_tensor(dtype, ks + (hk, hdim_v)), fake_tensor(dtype, qs + (h, hdim_v)),
            fake_tensor(Float32, rows, align=4), fake_tensor(Float32, rows, align=4),
            fake_tensor(Float32, qs + (h, hdim), align=4),
            fake_tensor(dkv_dtype, ks + (h, hdim), align=dkv_align),
            fake_tensor(dkv_dtype, ks + (h, hdim_v), align=dkv_align),
            Float32(0.125), Float32(1.0), Int32(0), Int32(0), Int32(1)) + cu + (fake_stream(),)


def build_for_inspect(cfg):
    """Registry builder: fake padded or varlen tensors with dynamic batch, heads and lengths."""
    from flash_cute.jit import DTYPES, CompileSpec

    dtype = DTYPES[cfg.dtype]
    kernel = HopperBwd(dtype, cfg.hdim, cfg.hdim_v, Variant.from_flags(cfg.flag_dict),
                       tile=tuple(cfg.tile))
    args = fake_backward_args(dtype, cfg.hdim, cfg.hdim_v, kernel.varlen,
                              cfg.flag_dict.get("dkv_fp32", False))
    return CompileSpec(kernel, args, dynamic_smem_bytes=kernel.smem_bytes, options=BWD_COMPILE_OPTIONS,
                       extra={"registers_per_role": registers_per_role()})
