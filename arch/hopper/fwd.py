"""FlashAttention-3 forward on sm90a: TMA + mbarrier pipelines + WGMMA, warp-specialized, with
FA3's intra-warpgroup overlap and inter-warpgroup ping-pong, each switchable (seed 10.3.4).

One CTA per (128-row query tile, head, batch). Warpgroup 0 produces (one warp issues every TMA
load), warpgroups 1 and 2 consume: each owns 64 query rows and runs S = Q Kᵀ, the online
softmax and O += P V for them. K and V flow through two mbarrier rings that share one
producer/consumer state (stage i of the K ring and stage i of the V ring hold the same block).
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from flash_cute.block_range import block_range, needs_mask
from flash_cute.dsl_state import DslState
from flash_cute.layouts import acc_to_mn, acc_to_operand_a, assume_aligned_strides
from flash_cute.mask import AttentionMask
from flash_cute.seqlen import SeqInfo
from flash_cute.softmax import OnlineSoftmax, apply_softcap, fold_scales, rescale_o
from flash_cute.variant import Variant, kernel_head_dims, set_kernel_switches

from .config import (COMPILE_OPTIONS, CONSUMER_REGISTERS, NUM_CONSUMER_WARPGROUPS, NUM_THREADS,
                     PRODUCER_REGISTERS, SMEM_CAPACITY, TILES, FwdConfig, smem_bytes)
from .tma import (COLS_FIRST, ROWS_FIRST, make_tma_pipelines, permute, tma_load_atom,
                  tma_partition)

# Named barriers 1 and 2: the consumer warpgroups' ping-pong turns (0 is sync_threads').
_PINGPONG_BARRIER_ID = 1


class HopperFwd:
    """Forward kernel: O = softmax(Q Kᵀ · scale) V and LSE, one CTA per (query tile, head, batch).

    | warpgroup | warps | registers | role                                                  |
    |-----------|-------|-----------|-------------------------------------------------------|
    | 0         | 0     | 24        | producer: TMA of Q once, then K[n], V[n] per block     |
    | 0         | 1..3  | 24        | idle (setmaxnreg is warpgroup-wide, so they stay)      |
    | 1         | 4..7  | 240       | consumer: rows 0..63 — QKᵀ, mask, softmax, PV, store   |
    | 2         | 8..11 | 240       | consumer: rows 64..127 — same                          |

    | pipeline (PipelineTmaAsync) | stages | full barrier           | empty barrier          |
    |-----------------------------|--------|------------------------|------------------------|
    | Q                           | 1      | TMA bytes of the Q tile | 8 consumer warps      |
    | K                           | 2      | TMA bytes of a K tile  | 8 consumer warps       |
    | V                           | 2      | TMA bytes of a V tile  | 8 consumer warps       |

    | named barrier | threads | use                                                     |
    |---------------|---------|---------------------------------------------------------|
    | 1, 2          | 256     | ping-pong turns of consumer warpgroup 1, 2 (`GemmTurns`) |

    K/V blocks are visited right to left over `block_range` (masked blocks first). S = Q K[n]ᵀ
    runs with both operands in shared memory, O += P V[n] with P (16-bit) as the register A
    operand; softcap, mask and the online softmax run in registers. The schedule (`FwdConfig`):

    * ``intra_wg_overlap``: S[n-1] and P[n] V[n] are issued together; the softmax of S[n-1]
      runs while that PV is in flight, O is rescaled after it lands (`mainloop_overlapped`).
      Off: S, wait, softmax, PV, wait (`mainloop_serial`).
    * ``pingpong``: the two consumer warpgroups take turns issuing their WGMMAs, so one's
      softmax overlaps the other's GEMMs (`GemmTurns`).

    Not yet: a TMA store of O through shared memory (O is stored from registers with row
    predicates, LSE by the quad leader), a persistent scheduler, packed GQA.
    """

    def __init__(self, dtype, hdim: int, hdim_v: Optional[int] = None,
                 variant: Variant = Variant(), tile: Optional[tuple] = None):
        self.dtype = dtype
        self.hdim, self.hdim_v = kernel_head_dims("sm90", hdim, hdim_v, TILES, tile)
        config = FwdConfig(*(tile or TILES[hdim]))
        self.tile_m, self.tile_n, self.kv_stages = config[:3]
        self.intra_wg_overlap, self.pingpong = config.intra_wg_overlap, config.pingpong
        if self.tile_m != 64 * NUM_CONSUMER_WARPGROUPS:
            raise ValueError(f"tile_m must be {64 * NUM_CONSUMER_WARPGROUPS} (64 rows per consumer)")
        if self.tile_n % 16:
            raise ValueError("tile_n must be a multiple of 16 (the K of the P V WGMMA)")
        self.num_threads = NUM_THREADS
        set_kernel_switches(self, variant)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory (the kernel's SharedStorage; checked against it at compile)."""
        return smem_bytes(self.hdim, self.hdim_v, (self.tile_m, self.tile_n, self.kv_stages))

    # ---------------------------------------------------------------- host side

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                 window_right: Int32, max_seqlen_q: Int32, mCuSeqlensQ: Optional[cute.Tensor],
                 mCuSeqlensK: Optional[cute.Tensor], stream: cuda.CUstream):
        """Padded: Q [b, sq, h, d], K/V [b, sk, hk, d], LSE [b, h, sq]. Varlen: Q [tq, h, d],
        K/V [tk, hk, d], LSE [h, tq], cu_seqlens [b + 1]."""
        vec = 128 // self.dtype.width
        # TMA needs 16-byte global strides; validation guarantees them, this tells the compiler.
        mQ, mK, mV, mO = (assume_aligned_strides(t, vec) for t in (mQ, mK, mV, mO))
        mma_qk, mma_pv = self._tiled_mmas()
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.hdim), self.dtype, 1)
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.hdim), self.dtype, self.kv_stages)
        # V as the (hdim_v, tile_n) B operand, head dim contiguous: no transpose in shared memory.
        sV_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (self.tile_m, self.hdim_v, self.tile_n), self.dtype,
            self.kv_stages)

        rows_first, back_rows = ROWS_FIRST[self.varlen]
        cols_first, back_cols = COLS_FIRST[self.varlen]
        tma_q, tQ = tma_load_atom(mQ, rows_first, sQ_layout, (self.tile_m, self.hdim))
        tma_k, tK = tma_load_atom(mK, rows_first, sK_layout, (self.tile_n, self.hdim))
        tma_v, tV = tma_load_atom(mV, cols_first, sV_layout, (self.hdim_v, self.tile_n))
        tQ, tK, tV = permute(tQ, back_rows), permute(tK, back_rows), permute(tV, back_cols)

        stages = self.kv_stages

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        if cutlass.const_expr(SharedStorage.size_in_bytes() != self.smem_bytes
                              or self.smem_bytes > SMEM_CAPACITY):
            raise ValueError(f"shared memory: {SharedStorage.size_in_bytes()} B (estimated "
                             f"{self.smem_bytes}), capacity {SMEM_CAPACITY}")
        tx_bytes = tuple(cute.size_in_bytes(self.dtype, cute.slice_(layout, (None, None, 0)))
                         for layout in (sQ_layout, sK_layout, sV_layout))
        batch = SeqInfo.num_batches(mQ, mCuSeqlensQ)
        grid = (cute.ceil_div(max_seqlen_q, self.tile_m), mQ.shape[-2], batch)
        scale_log2, scale_div_cap = fold_scales(softmax_scale, softcap, self.has_softcap)
        self.kernel(
            tma_q, tQ, tma_k, tK, tma_v, tV, mO, mLSE, scale_log2, scale_div_cap, window_left,
            window_right, mCuSeqlensQ, mCuSeqlensK, sQ_layout, sK_layout, sV_layout, mma_qk,
            mma_pv, SharedStorage, tx_bytes,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def _tiled_mmas(self):
        """S = Q Kᵀ (both from shared memory, K-major) and O = P V (P from registers, V
        MN-major); one 64-row WGMMA atom per consumer warpgroup."""
        atoms = (NUM_CONSUMER_WARPGROUPS, 1, 1)
        mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, atoms,
            (64, self.tile_n))
        mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, atoms,
            (64, self.hdim_v), a_source=warpgroup.OperandSource.RMEM)
        return mma_qk, mma_pv

    # ---------------------------------------------------------------- device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               scale_log2: Float32, scale_div_cap: Float32, window_left: Int32,
               window_right: Int32, mCuSeqlensQ: Optional[cute.Tensor],
               mCuSeqlensK: Optional[cute.Tensor], sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, SharedStorage: cutlass.Constexpr,
               tx_bytes: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        pipes = make_tma_pipelines(((storage.mbar_q, 1, tx_bytes[0]),
                                    (storage.mbar_k, self.kv_stages, tx_bytes[1]),
                                    (storage.mbar_v, self.kv_stages, tx_bytes[2])))
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.causal or self.has_window_right):
            # Heaviest query tiles first, so the tail of the grid is short.
            m_block = cute.arch.grid_dim()[0] - 1 - m_block
        head_kv = head // (mQ.shape[-2] // mK.shape[-2])
        seq = SeqInfo(batch, mQ.shape[1], mK.shape[1], mCuSeqlensQ, mCuSeqlensK)
        # Uniform over the CTA (varlen tiles past the sequence), so no role is left waiting.
        if m_block * self.tile_m < seq.seqlen_q:
            win_left = window_left if cutlass.const_expr(self.has_window_left) else None
            win_right = window_right if cutlass.const_expr(self.has_window_right) else None
            rng = block_range(m_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                              self.causal, win_left, win_right, imin=cutlass.min, imax=cutlass.max)
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
                if warp_idx == 0:
                    self.produce(tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipes, seq, head,
                                 head_kv, m_block, rng)
            else:
                cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
                mask = AttentionMask(self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                     self.causal, win_left, win_right)
                self.consume(mma_qk, mma_pv, sQ, sK, sV, pipes, seq, mO, mLSE, head, m_block,
                             rng, mask, scale_log2, scale_div_cap)

    @cute.jit
    def produce(self, tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipes, seq, head, head_kv,
                m_block, rng):
        """Warp 0 of the producer warpgroup, all 32 lanes: `producer_acquire` elects the lane
        that arms the barrier, and the TMA copy elects its own issuing lane."""
        pipe_q, pipe_k, pipe_v = pipes
        gQ = cute.local_tile(seq.q_view(mQ, head), (self.tile_m, self.hdim), (m_block, 0))
        gK = cute.local_tile(seq.k_view(mK, head_kv), (self.tile_n, self.hdim), (None, 0))
        gVt = cute.local_tile(permute(seq.k_view(mV, head_kv), (1, 0)),
                              (self.hdim_v, self.tile_n), (0, None))
        tQsQ, tQgQ = tma_partition(tma_q, sQ, gQ)
        tKsK, tKgK = tma_partition(tma_k, sK, gK)
        tVsV, tVgV = tma_partition(tma_v, sV, gVt)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        for i in cutlass.range(rng.n_block_max - rng.n_block_min, unroll=1):
            n_block = rng.n_block_max - 1 - i
            pipe_k.producer_acquire(kv)
            cute.copy(tma_k, tKgK[None, n_block], tKsK[None, kv.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(kv))
            pipe_v.producer_acquire(kv)
            cute.copy(tma_v, tVgV[None, n_block], tVsV[None, kv.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(kv))
            kv.advance()

    @cute.jit
    def consume(self, mma_qk, mma_pv, sQ, sK, sV, pipes, seq, mO, mLSE, head, m_block, rng,
                mask, scale_log2, scale_div_cap):
        """One consumer warpgroup's 64 rows (thread index relative to the first consumer, so
        the tiled MMAs place warpgroup 1 on rows 0..63 and warpgroup 2 on rows 64..127)."""
        pipe_q = pipes[0]
        tidx = cute.arch.thread_idx()[0] - 128
        thr_qk, thr_pv = mma_qk.get_slice(tidx), mma_pv.get_slice(tidx)
        gemms = WgmmaOperands(self, mma_qk, mma_pv, thr_qk, thr_pv, sQ, sK, sV)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, self.hdim_v)),
                                      Float32)
        acc_o.fill(0.0)
        softmax = OnlineSoftmax(scale_log2, cute.size(acc_to_mn(acc_o), mode=[0]), 4)
        softmax.reset()
        coord_mn = acc_to_mn(thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        scores = ScoreStep(self, softmax, mask, coord_mn, m_block, rng, scale_div_cap)
        turns = GemmTurns(self.pingpong, cute.arch.make_warp_uniform(tidx // 128))
        turns.start()

        # Q is waited for even when no block is visited: its TMA must land before the CTA exits.
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_q.consumer_wait(q_state)
        if cutlass.const_expr(self.intra_wg_overlap):
            self.mainloop_overlapped(gemms, scores, turns, pipes, acc_o, rng)
        else:
            self.mainloop_serial(gemms, scores, turns, pipes, acc_o, rng)
        turns.finish()
        pipe_q.consumer_release(q_state)

        o_scale, lse = softmax.finalize()
        rescale_o(acc_to_mn(acc_o), o_scale)
        self.epilogue(acc_o, lse, thr_pv, seq, mO, mLSE, head, m_block)

    @cute.jit
    def mainloop_serial(self, gemms, scores, turns, pipes, acc_o, rng):
        """Per block: S = Q Kᵀ, wait, softmax, O += P V, wait (the tensor cores idle during
        this warpgroup's softmax unless the other warpgroup fills them: `pingpong`)."""
        _, pipe_k, pipe_v = pipes
        acc_s = gemms.new_acc_s()
        r_p = cute.make_rmem_tensor_like(acc_s, self.dtype)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        for i in cutlass.range(rng.n_block_max - rng.n_block_min, unroll=1):
            pipe_k.consumer_wait(kv)
            turns.begin()
            gemms.qk(acc_s, kv.index)
            turns.end()
            warpgroup.wait_group(0)
            pipe_k.consumer_release(kv)
            rescale_o(acc_to_mn(acc_o), scores.to_p(acc_s, rng.n_block_max - 1 - i, False, None))
            r_p.store(acc_s.load().to(self.dtype))
            pipe_v.consumer_wait(kv)
            turns.begin()
            gemms.pv(r_p, acc_o, kv.index)
            turns.end()
            warpgroup.wait_group(0)
            pipe_v.consumer_release(kv)
            kv.advance()

    @cute.jit
    def mainloop_overlapped(self, gemms, scores, turns, pipes, acc_o, rng):
        """FA3's intra-warpgroup overlap: S[n-1] = Q K[n-1]ᵀ and O += P[n] V[n] are issued
        together, so the softmax of block n-1 runs while the PV WGMMA of block n is in flight;
        O is rescaled once that PV has landed. Blocks run right to left; the first is always
        masked (harmless where it needs none), the others where `needs_mask` says so."""
        _, pipe_k, pipe_v = pipes
        acc_s = gemms.new_acc_s()
        r_p = cute.make_rmem_tensor_like(acc_s, self.dtype)
        n_max = rng.n_block_max
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        if n_max > rng.n_block_min:
            pipe_k.consumer_wait(k_state)
            turns.begin()
            gemms.qk(acc_s, k_state.index)
            turns.end()
            warpgroup.wait_group(0)
            pipe_k.consumer_release(k_state)
            scores.to_p(acc_s, n_max - 1, True, True)
            r_p.store(acc_s.load().to(self.dtype))
            v_state = k_state.clone()
            k_state.advance()
            step = OverlappedStep(gemms, scores, turns, pipe_k, pipe_v, acc_s, r_p, acc_o)
            # One loop with a run-time mask test: with the blocks split into masked and
            # unmasked loops (FA4's layout), ptxas finds too few registers to keep the WGMMAs
            # of the several loop bodies in flight and serializes every WGMMA of the kernel.
            for i in cutlass.range(n_max - 1 - rng.n_block_min, unroll=1):
                k_state, v_state = step.run(k_state, v_state, n_max - 2 - i, None)
            pipe_v.consumer_wait(v_state)
            turns.begin()
            gemms.pv(r_p, acc_o, v_state.index)
            turns.end()
            warpgroup.wait_group(0)
            pipe_v.consumer_release(v_state)

    @cute.jit
    def epilogue(self, acc_o, lse, thr_pv, seq, mO, mLSE, head, m_block):
        """O straight from registers to global memory (rows past seqlen_q skipped; in varlen
        they belong to the next sequence), LSE from the first thread of each row's quad."""
        gO = cute.local_tile(seq.q_view(mO, head), (self.tile_m, self.hdim_v), (m_block, 0))
        g_lse = seq.lse_view(mLSE, head)
        coord = acc_to_mn(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim_v))))
        acc_mn = acc_to_mn(acc_o)
        valid_rows = seq.seqlen_q - m_block * self.tile_m
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            row = coord[r, 0][0]
            if row < valid_rows:
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    gO[row, coord[0, c][1]] = acc_mn[r, c].to(self.dtype)
                if coord[0, 0][1] == 0:
                    g_lse[m_block * self.tile_m + row] = lse[r]


class WgmmaOperands(DslState):
    """The two WGMMAs of one K/V block: Q and K[stage] as shared-memory descriptors for S,
    P (registers) and V[stage] (descriptor) for O. Built once per consumer thread. Each call
    issues and commits one group; the caller waits (`warpgroup.wait_group`)."""

    def __init__(self, cfg: HopperFwd, mma_qk, mma_pv, thr_qk, thr_pv, sQ, sK, sV):
        self.cfg = cfg
        self.mma_qk, self.mma_pv = mma_qk, mma_pv
        self.thr_qk = thr_qk
        self.tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        self.tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        self.tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))

    def new_acc_s(self) -> cute.Tensor:
        return cute.make_rmem_tensor(
            self.thr_qk.partition_shape_C((self.cfg.tile_m, self.cfg.tile_n)), Float32)

    @cute.jit
    def qk(self, acc_s: cute.Tensor, stage: Int32):
        """Issue S = Q K[stage]ᵀ (overwrites acc_s)."""
        # A fresh atom per GEMM: ACCUMULATE is atom state, and an atom reused across the
        # run-time loop would carry that state as a loop value.
        atom = cute.make_mma_atom(self.mma_qk.op)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(self.tSrQ, mode=[2])):
            atom.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(atom, acc_s, self.tSrQ[None, None, k, 0], self.tSrK[None, None, k, stage],
                      acc_s)
        warpgroup.commit_group()

    @cute.jit
    def pv(self, r_p: cute.Tensor, acc_o: cute.Tensor, stage: Int32):
        """Issue O += P V[stage], P (16-bit, S's accumulator layout) as the register A operand.
        P and O must not be touched until the group has completed."""
        tOrP = acc_to_operand_a(r_p)
        atom = cute.make_mma_atom(self.mma_pv.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(atom, acc_o, tOrP[None, None, k], self.tOrV[None, None, k, stage], acc_o)
        warpgroup.commit_group()


class ScoreStep(DslState):
    """S of one block to unnormalized P in place: softcap, mask where the block needs it,
    online softmax. Returns the factor the O accumulator must be rescaled by."""

    def __init__(self, cfg: HopperFwd, softmax: OnlineSoftmax, mask: AttentionMask, coord_mn,
                 m_block, rng, scale_div_cap):
        self.cfg, self.softmax, self.mask, self.coord_mn = cfg, softmax, mask, coord_mn
        self.m_block, self.rng, self.scale_div_cap = m_block, rng, scale_div_cap

    @cute.jit
    def to_p(self, acc_s: cute.Tensor, n_block: Int32, is_first: cutlass.Constexpr[bool],
             masked: cutlass.Constexpr):
        """`masked`: True or False when the caller knows whether the block needs the mask,
        None to decide at run time (`needs_mask`)."""
        acc_s_mn = acc_to_mn(acc_s)
        if cutlass.const_expr(self.cfg.has_softcap):
            apply_softcap(acc_s_mn, self.scale_div_cap)
        if cutlass.const_expr(masked is None):
            if needs_mask(n_block, self.rng):
                self.mask.apply(acc_s_mn, self.coord_mn, self.m_block, n_block)
        elif cutlass.const_expr(masked):
            self.mask.apply(acc_s_mn, self.coord_mn, self.m_block, n_block)
        return self.softmax.online_softmax(acc_s_mn, is_first=is_first)


class OverlappedStep(DslState):
    """One block of `HopperFwd.mainloop_overlapped` after the first: issue S[n] and
    O += P[n+1] V[n+1], softmax of S[n] under the PV, then rescale O and convert P[n]."""

    def __init__(self, gemms, scores, turns, pipe_k, pipe_v, acc_s, r_p, acc_o):
        self.gemms, self.scores, self.turns = gemms, scores, turns
        self.pipe_k, self.pipe_v = pipe_k, pipe_v
        self.acc_s, self.r_p, self.acc_o = acc_s, r_p, acc_o

    @cute.jit
    def run(self, k_state, v_state, n_block: Int32, masked: cutlass.Constexpr):
        self.pipe_k.consumer_wait(k_state)
        self.turns.begin()
        self.gemms.qk(self.acc_s, k_state.index)
        self.pipe_v.consumer_wait(v_state)
        self.gemms.pv(self.r_p, self.acc_o, v_state.index)
        self.turns.end()
        # Groups complete in issue order: one left in flight means S has landed.
        warpgroup.wait_group(1)
        self.pipe_k.consumer_release(k_state)
        row_scale = self.scores.to_p(self.acc_s, n_block, False, masked)
        warpgroup.wait_group(0)
        self.pipe_v.consumer_release(v_state)
        rescale_o(acc_to_mn(self.acc_o), row_scale)
        self.r_p.store(self.acc_s.load().to(self.r_p.element_type))
        k_state.advance()
        v_state.advance()
        # Returned so the caller's loop rebinds them (the DSL carries plain locals only).
        return k_state, v_state


class GemmTurns(DslState):
    """Inter-warpgroup ping-pong (FA3): the two consumer warpgroups take turns issuing their
    WGMMAs, so one's softmax runs while the other's GEMMs hold the tensor cores.

    Named barrier 1 + w is warpgroup w's turn (256 threads: w's own `arrive_and_wait` plus the
    other warpgroup's `arrive` when it has issued). Warpgroup 1 hands the first turn to
    warpgroup 0; warpgroup 0 takes one extra turn at the end, so no arrive is left pending.
    With `enabled` False every call is a no-op.
    """

    def __init__(self, enabled: bool, wg: Int32):
        self.enabled, self.wg = enabled, wg

    def _bar(self, wg):
        return pipeline.NamedBarrier(barrier_id=_PINGPONG_BARRIER_ID + wg, num_threads=256)

    @cute.jit
    def start(self):
        if cutlass.const_expr(self.enabled):
            if self.wg == 1:
                self._bar(0).arrive()

    @cute.jit
    def begin(self):
        if cutlass.const_expr(self.enabled):
            self._bar(self.wg).arrive_and_wait()

    @cute.jit
    def end(self):
        if cutlass.const_expr(self.enabled):
            self._bar(1 - self.wg).arrive()

    @cute.jit
    def finish(self):
        if cutlass.const_expr(self.enabled):
            if self.wg == 0:
                self._bar(0).arrive_and_wait()


def registers_per_role() -> dict:
    """setmaxnreg budgets of each role, for `inspect` (the cubin reports only the launch-time
    register count, which ptxas caps at 65536 / 384 threads)."""
    return {"producer": PRODUCER_REGISTERS, "consumer": CONSUMER_REGISTERS}


def build_for_inspect(cfg):
    """Registry builder: fake padded or varlen Q/K/V/O/LSE with dynamic batch and lengths."""
    from flash_cute.jit import DTYPES, CompileSpec, fake_forward_args

    kernel = HopperFwd(DTYPES[cfg.dtype], cfg.hdim, cfg.hdim_v, Variant.from_flags(cfg.flag_dict),
                       tile=tuple(cfg.tile))
    args = fake_forward_args(DTYPES[cfg.dtype], cfg.hdim, cfg.hdim_v, kernel.varlen)
    return CompileSpec(kernel, args, dynamic_smem_bytes=kernel.smem_bytes, options=COMPILE_OPTIONS,
                       extra={"registers_per_role": registers_per_role()})
