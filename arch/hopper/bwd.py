"""FlashAttention-3 backward on sm90a (recompute from LSE): TMA + mbarrier
pipelines + WGMMA, warp-specialized, the GEMMs running under the pointwise work.

Parallel over K/V tiles, like `arch.ampere.bwd`: a CTA keeps dK and dV of its tile_n keys in
registers while it walks the query tiles that see them (`m_block_range`), recomputing
P = exp2(S · scale_log2 − LSE · log2 e). dQ gets a partial sum from every K/V tile, added into
dQaccum (fp32) by bulk reduce-adds of a shared-memory tile kept in the WGMMA fragment order
(one per tile, or one per consumer warpgroup's half with `dq_per_wg`; `dq_accum`;
`HopperDqPostprocess` scales and converts it), or, where that tile does not fit
(`config.bwd_smem_plan`), by fp32 atomics into a dQaccum laid out like Q (`bwd_postprocess`).
"""

import enum
import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from flash_cute.arch.sm90plus.barriers import named_barriers
from flash_cute.arch.sm90plus.tma import (
    ROWS_FIRST,
    clear_tails,
    make_tma_pipelines,
    permute,
    smem_tile,
    swizzled_layout,
    tma_load_atom,
    tma_partition,
)
from flash_cute.blocks.bwd import (
    atomic_add_rows,
    dq_turn,
    ds_from_probs,
    p_and_ds,
    p_and_ds_dropout,
    pass_turn,
    probs,
    store_acc_tile,
    tile_row_values,
    wait_turn,
)
from flash_cute.blocks.dropout import Dropout
from flash_cute.blocks.dsl_state import DslState
from flash_cute.blocks.layouts import (
    acc_to_mn,
    acc_to_operand_a,
    assume_aligned_strides,
    transpose_view,
)
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
from flash_cute.blocks.timeline import Timeline
from flash_cute.contract.block_range import m_block_range, narrow_pair
from flash_cute.contract.kernel_args import BwdArgs
from flash_cute.contract.variant import Variant

from .config import (
    BWD_CONSUMER_REGISTERS,
    BWD_CONSUMER_WARPGROUPS,
    BWD_NUM_THREADS,
    BWD_PRODUCER_REGISTERS,
    BWD_SCHEDULES,
    BWD_SUPPORTED_HDIMS,
    SMEM_CAPACITY,
    BwdSchedule,
    bwd_mma_splits,
    bwd_smem_plan,
    check_role_registers,
    do_stages,
    dq_swapped,
    ds_stored_before_dv,
    stats_stage_rows,
)
from .dq_accum import DQ_THREADS, as_vectors, reduce_add_tile, thread_view
from .row_copy import row_store, store_tile_rows
from .wgmma import wgmma_slice

_DQ_WRITER_WARP = 1


@named_barriers
class BwdBarrier(enum.IntEnum):
    """The backward's named barriers (the pipelines use mbarriers)."""
    PDS = 1  # the 256 consumer threads around the shared P and dS tiles (and a deterministic
    #          turn of dQ atomics)
    WG0_P = 2  # 2 + w: consumer warpgroup w's P, when its dV reads only the P columns it wrote
    WG1_P = 3
    DQ_FULL = 4  # the dQ tile full / empty: the consumers (`dq_per_wg`: warpgroup 0) and the
    DQ_EMPTY = 5  # dQ-writer warp
    TAIL = 6  # the 256 consumer threads, after zeroing tile rows past a varlen sequence
    EPILOGUE = 7  # the 256 consumer threads around the dK/dV epilogue tiles in shared memory
    DQ_FULL_WG1 = 8  # `dq_per_wg`: warpgroup 1's dQ half full / empty
    DQ_EMPTY_WG1 = 9


# Warpgroup w's dQ pair is (DQ_FULL, DQ_EMPTY) + w * stride.
_DQ_WG_BARRIER_STRIDE = BwdBarrier.DQ_FULL_WG1.value - BwdBarrier.DQ_FULL.value


class HopperBwd:
    """Backward kernel: one CTA per (K/V tile, query head, batch).

    | warpgroup | warps | registers | role                                                     |
    |-----------|-------|-----------|----------------------------------------------------------|
    | 0         | 0     | 24        | producer: TMA of K, V once, then Q, dO, LSE₂, Δ per tile  |
    | 0         | 1     | 24        | dQ writer (dq_tma): bulk reduce-add of each dQ tile       |
    | 0         | 2, 3  | 24        | idle (setmaxnreg is warpgroup-wide, so they stay)         |
    | 1, 2      | 4..11 | 240       | consumers: S, dP, P, dS, dV, dK, dQ (split below), store  |

    | pipeline / buffer           | stages     | filled by                | freed by              |
    |-----------------------------|------------|--------------------------|-----------------------|
    | K + V (PipelineTmaAsync)    | 1 (once)   | TMA bytes of K and V     | 8 consumer warps      |
    | Q + LSE₂ (PipelineTmaAsync) | q_stages   | TMA bytes of both tiles  | 8 warps, after dK     |
    | dO + Δ (PipelineTmaAsync)   | do_stages  | TMA bytes of both tiles  | 8 warps, after dV     |
    | P, dS tiles (shared memory) | pds_stages | consumers                | their dV, dK, dQ      |
    |   (swap_sdp: dSᵀ only)      |            |                          | dQ                    |
    | dQ tile (named barriers)    | 1          | consumers: 4 (full)      | dQ writer: 5 (empty)  |
    |   (dq_per_wg: per half)     |            | wg 0: 4, wg 1: 8         | 5, 9                  |
    | dK, dV tiles (in Q's, dO's  | 1          | consumers, between two   | their row stores      |
    |   rings, after the loop)    |            | barriers 7 of all 256    |                       |

    `config.bwd_smem_plan` picks pds_stages (q_stages where it fits, else 1) and dq_tma (the
    fp32 dQ tile in shared memory; without it, e.g. hdim 256 at 64 keys with two Q/dO stages, the
    consumers add dQ with fp32 atomics and warp 1 idles).

    Per query tile m the consumers (WGMMA; how the two warpgroups split each GEMM is
    `config.bwd_mma_splits`; a GEMM is issued and committed, and waited for only where its
    result is needed, `warpgroup.wait_group(n)`, groups completing in issue order):

    1. wait Q[m]: issue S = Q Kᵀ; wait dO[m]: issue dP = dO Vᵀ (both split over keys); read
       the thread's rows of LSE₂[m] and Δ[m] from shared memory;
    2. wait for S (dP still runs): softcap, mask, P = exp2(S·scale_log2 − LSE₂) → sP; with
       softcap both are waited for first, as dS needs tanh(S), which P overwrites;
    3. async-proxy fence, barrier on P (own warpgroup when tile_n is 128, else all 256);
       issue dV += Pᵀ dO;
    4. wait for dP: dS = P ∘ (dP − Δ) [∘ (1 − tanh²)] → sdS; fence, barrier of all 256 (dQ
       reads every key's dS); issue dQ = dS K, then dK += dSᵀ Q;
    5. wait for dV and dQ: release dO[m]; while dK runs, dQ goes to the shared dQ tile (wait
       empty, write, fence, arrive full) or to dQaccum by atomics; wait for dK: release Q[m].

    With `swap_sdp` (`config.BwdSchedule`; tile_n 128 only, the default at hdim 64, 128) steps 1-4
    run transposed: each warpgroup computes Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for its own 64 keys,
    so Pᵀ and dSᵀ sit in its registers in the layout of the A operand of dV += Pᵀ dO and
    dK += dSᵀ Q (register-A WGMMAs; no P tile, no P barrier), and only dSᵀ goes to shared
    memory, where dQ reads it as the MN-major dS. A thread then holds 16 query columns
    instead of 2 rows, so LSE₂ and Δ are read from shared memory just before their use.
    With 128 query rows (hdim 64's default; swap_sdp only) a thread holds 32 query columns:
    each statistic is kept one eighth per lane and fetched by shuffles (`ShuffledRows`), dS
    is computed and stored before dV is issued (so fp32 P, dP and the 16-bit P are never all
    live; `config.ds_stored_before_dv`, which also sets ptxas -O3), and dQ splits its 128 rows
    over the two warpgroups. With 80 query rows (hdim 128's default, as FA4's; swap_sdp only;
    dS computed before dV, stored while dV runs) WGMMA's 64-row M fits no split of the
    queries, so dQ is computed transposed, dQᵀ = Kᵀ dSᵀ (`config.dq_swapped`): each warpgroup
    64 of the head dim's rows and all 80 queries; the postprocess maps that fragment back
    (`dq_accum`).

    With `swap_dkv` (the default at hdim 256, FA4's 48 keys with two Q stages and one dO stage
    beside the dQ tile, and at hdim 192, 96 keys) dV += Pᵀ dO and dK += dSᵀ Q run
    transposed, dVᵀ += dOᵀ P and dKᵀ += Qᵀ dS: the head dim takes WGMMA's M (split by
    warpgroup where it is a multiple of 128, else the keys), so the key tile needs only a
    multiple of 16; P and dS go through shared memory, the accumulators hold dKᵀ and dVᵀ and
    leave through transposed views.

    The dQ writer, per tile: wait until the bulk add has read the previous tile, arrive empty,
    [deterministic: wait for its turn], wait full, bulk reduce-add of the tile into dQaccum
    [deterministic: wait for the add to complete, pass the turn]; with `dq_per_wg` each half
    on its own pair of barriers (both empties first, then each half's full and add).

    Then dK *= softmax_scale and dK, dV rows < seqlen_k go to global memory, per query head
    (the host sums a GQA group): 16-bit ones through the freed Q and dO rings as whole 128-bit
    rows (`store_dkv_rows`; where one dO stage holds fewer rows than the keys, as at hdim 192,
    both through Q's ring in turn), fp32 ones (GQA) straight from the accumulators.

    Rows of a Q/dO tile past seqlen_q contribute nothing: padded, they are TMA's zero fill
    in Q, dO, LSE₂ and Δ alike (P = 1 but dO = 0 and dS = 0; `stats_checked` off); varlen,
    with seqused_q (the next sequence, or padding) or with mods (which may turn a zero score
    into an overflowing one) they get LSE = +inf and Δ = 0 (`tile_row_values`), so
    P = dS = 0. K/V rows past seqlen_k are masked to P = 0.

    `deterministic`: dQ of a query tile is added by its K/V tiles in increasing order, through
    an int32 semaphore per (query tile, head, batch) in global memory (`blocks.bwd.dq_turn`).

    Not yet: LSE₂ and Δ by TMA for varlen.
    """

    def pipeline(self):
        """This kernel's pipeline as data (`flash_cute.contract.pipeline`)."""
        from .pipelines import backward
        return backward(self, BWD_PRODUCER_REGISTERS, BWD_CONSUMER_REGISTERS,
                        BWD_CONSUMER_WARPGROUPS)

    def __init__(self, dtype, hdim: int, hdim_v: Optional[int] = None,
                 variant: Variant = Variant(), schedule: Optional[tuple] = None,
                 deterministic: bool = False):
        hdim_v = hdim if hdim_v is None else hdim_v
        if schedule is None and (hdim, hdim_v) not in BWD_SUPPORTED_HDIMS:
            raise ValueError(f"no sm90 backward for hdim {hdim}/{hdim_v}; "
                             f"have {sorted(BWD_SUPPORTED_HDIMS)}")
        self.dtype = dtype
        self.hdim, self.hdim_v = hdim, hdim_v
        schedule = BwdSchedule(*(schedule or BWD_SCHEDULES[hdim]))
        self.tile_m, self.tile_n, self.q_stages, self.swap_sdp, self.swap_dkv = schedule[:5]
        self.do_stages, self.dq_per_wg = do_stages(schedule), schedule.dq_per_wg
        self.splits = bwd_mma_splits(schedule, hdim)
        self.plan = bwd_smem_plan(hdim, hdim_v, schedule)
        self.pds_stages, self.dq_tma = self.plan.pds_stages, self.plan.dq_tma
        self.dq_swap = dq_swapped(schedule)
        self.ds_stored_first = ds_stored_before_dv(schedule)
        if self.dq_per_wg and not self.dq_tma:
            raise ValueError(f"dq_per_wg needs the shared dQ tile, which {schedule} leaves no room "
                             f"for at hdim {hdim}")
        if self.dq_swap and (hdim != 2 * 64 or not self.dq_tma):
            raise ValueError(f"dQᵀ ({self.tile_m} query rows) needs hdim 128 (64 per consumer "
                             f"warpgroup) and the shared dQ tile; got hdim {hdim}, dq_tma "
                             f"{self.dq_tma}")
        self.num_threads = BWD_NUM_THREADS
        self.num_consumer_threads = 128 * BWD_CONSUMER_WARPGROUPS
        check_role_registers(BWD_PRODUCER_REGISTERS, BWD_CONSUMER_REGISTERS,
                             BWD_CONSUMER_WARPGROUPS)
        self.deterministic = deterministic
        set_kernel_switches(self, variant)
        # LSE₂ and Δ tiles by TMA; varlen reads them from global memory (D-HB-STATSTMA).
        self.stats_tma = not self.varlen
        # Padded, without seqused_q, the rows of a tile past seqlen_q are TMA's zero fill in
        # Q, dO, LSE₂ and Δ alike, so P ∘ dO = 0 and dS = 0 there: no check (D-HB-STATS).
        # Not with a mod: it may turn those rows' zero scores into any value, and one past
        # fp32's exp range makes P = inf, inf x 0 = NaN in dK and dV.
        self.stats_checked = self.varlen or self.has_seqused_q or self.mods is not None
        # 32 query columns per thread (swap_sdp, 128 rows): statistics shared by shuffles.
        self.shuffle_stats = self.swap_sdp and self.tile_m == 128

    @property
    def smem_bytes(self) -> int:
        return self.plan.smem_bytes

    @property
    def ds_reads_scores(self) -> bool:
        """Whether dS needs the (modded) scores, which P overwrites in place: a score mod's
        derivative is a function of them (softcap's is 1 − tanh², of the tanh S holds), or a
        traced mod's derivative was taken beside them (none where it is 1: a bias)."""
        if self.mods is not None:
            return self.mods.score_grad is not None
        return self.score_mod is not None

    @property
    def fused_p_ds(self) -> bool:
        """Whether P and dS are formed in one pass once S and dP have both landed: a score
        mod's derivative reads S, and dropout's draws zero both dP and the P of dV; the
        gradients of learnable captured tensors take dS there (`Scores.ds_hook`)."""
        return (self.ds_reads_scores or self.dropout
                or bool(getattr(self.mods, "aux_grads", ())))

    # ---------------------------------------------------------------- host side

    @cute.jit
    def __call__(self, args: BwdArgs, stream: cuda.CUstream):
        """`args`: a `kernel_args.BwdArgs` with LSE₂ and Δ rows 16-byte aligned
        (`launch_bwd._Scratch`: they are TMA-loaded) and, when deterministic, the dQ
        semaphores. dQaccum, zeroed: with the shared dQ tile (`dq_tma`) the fragment-order
        tiles of `host_dq_layout.accum_shape`, else like Q."""
        mLSElog2, mDelta, mdQaccum, mdK, mdV = (args.lse_log2, args.delta, args.dq_accum,
                                                args.dk, args.dv)
        mCuSeqlensQ = args.cu_seqlens_q
        vec = 128 // self.dtype.width
        # TMA needs 16-byte global strides; validation guarantees them, this tells the compiler.
        mQ, mK, mV, mdO = (assume_aligned_strides(t, vec) for t in (args.q, args.k, args.v,
                                                                      args.dout))
        if cutlass.const_expr(mdK.element_type == self.dtype):
            # Allocated by `launch_bwd.BackwardLaunch`, compact: 128-bit row stores
            # (`store_dkv_rows`).
            mdK, mdV = (assume_aligned_strides(t, vec) for t in (mdK, mdV))
        layouts = self._smem_layouts()
        sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout, sdQ_layout = layouts
        mmas = self._tiled_mmas()

        order, back = ROWS_FIRST[self.varlen]
        tma_q, tQ = tma_load_atom(mQ, order, sQ_layout, (self.tile_m, self.hdim))
        tma_do, tdO = tma_load_atom(mdO, order, sdO_layout, (self.tile_m, self.hdim_v))
        tma_k, tK = tma_load_atom(mK, order, sK_layout, (self.tile_n, self.hdim))
        tma_v, tV = tma_load_atom(mV, order, sV_layout, (self.tile_n, self.hdim_v))
        tQ, tdO, tK, tV = (permute(t, back) for t in (tQ, tdO, tK, tV))
        # LSE₂ and Δ [b, h, sq] (varlen [h, tq] as [1, h, tq]): one tile_m-row box of fp32
        # per query tile.
        tma_lse, tLSE, tma_delta, tDelta = None, mLSElog2, None, mDelta
        if cutlass.const_expr(self.stats_tma):
            tma_lse, tLSE = self._row_stats_atom(mLSElog2)
            tma_delta, tDelta = self._row_stats_atom(mDelta)
        if cutlass.const_expr(self.dq_tma):
            # Fragment-order tiles (`dq_accum`), each 16-byte aligned for the bulk reduce-add.
            mdQaccum = assume_aligned_strides(mdQaccum, 4)

        SharedStorage = self._shared_storage(layouts)
        if cutlass.const_expr(SharedStorage.size_in_bytes() != self.smem_bytes
                              or self.smem_bytes > SMEM_CAPACITY):
            raise ValueError(f"shared memory: {SharedStorage.size_in_bytes()} B (estimated "
                             f"{self.smem_bytes}), capacity {SMEM_CAPACITY}")
        one_stage = lambda layout: cute.size_in_bytes(  # noqa: E731
            self.dtype, cute.slice_(layout, (None, None, 0)))
        stats_bytes = self.tile_m * 4 if self.stats_tma else 0
        tx_bytes = (one_stage(sK_layout) + one_stage(sV_layout),
                    one_stage(sQ_layout) + stats_bytes, one_stage(sdO_layout) + stats_bytes)
        batch = SeqInfo.num_batches(mQ, mCuSeqlensQ)
        grid = (cute.ceil_div(args.max_seqlen_k, self.tile_n), mQ.shape[-2], batch)
        scale_log2, mod_scale = fold_scores(self.score_mod, args.softmax_scale, args.softcap)
        self.kernel(
            tma_q, tQ, tma_do, tdO, tma_k, tK, tma_v, tV, mdQaccum, tma_lse, tLSE,
            tma_delta, tDelta, mdK, mdV, args.dq_semaphores, args.softmax_scale, scale_log2,
            mod_scale, args.window_left, args.window_right,
            args.max_seqlen_q if cutlass.const_expr(self.varlen) else None, mCuSeqlensQ,
            args.cu_seqlens_k,
            args.seqused_q, args.seqused_k, *layouts, *mmas,
            args.rng_seed, args.keep_threshold, args.dropout_scale, mQ.shape[-2],
            aux_tensors(self, args), block_mask_tensors(self, args), args.timeline, SharedStorage,
            tx_bytes,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def _row_stats_atom(self, t: cute.Tensor):
        """TMA atom and coordinate tensor of a padded [b, h, sq] per-row fp32 vector."""
        t = assume_aligned_strides(t, 4)
        atom, coords = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), permute(t, (2, 1, 0)),
            cute.make_layout(self.tile_m), (self.tile_m,))
        return atom, permute(coords, (2, 1, 0))

    def _shared_storage(self, layouts):
        """The CTA's shared memory, as `config.bwd_smem_plan` sizes it."""
        sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout, sdQ_layout = layouts
        q_stages, do_count, dtype = self.q_stages, self.do_stages, self.dtype
        stats_rows = stats_stage_rows(self.tile_m)

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * q_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * do_count]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, stats_rows * q_stages], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, stats_rows * do_count], 128]
            sQ: smem_tile(dtype, sQ_layout)
            sdO: smem_tile(dtype, sdO_layout)
            sK: smem_tile(dtype, sK_layout)
            sV: smem_tile(dtype, sV_layout)
            if not self.swap_sdp:
                sP: smem_tile(dtype, sPdS_layout)
            sdS: smem_tile(dtype, sPdS_layout)
            if self.dq_tma:
                sdQ: smem_tile(Float32, sdQ_layout)

        return SharedStorage

    def _smem_layouts(self):
        """(Q, dO, K, V, P/dS, dQ) shared-memory layouts: the 16-bit tiles (rows, cols, stages),
        K-major (cols contiguous) and swizzled, then the flat dQ tile.

        Each 16-bit tile is also read transposed (Qᵀ, dOᵀ as dK/dV's B, Kᵀ as dQ's B, Pᵀ, dSᵀ
        as dK/dV's A), i.e. MN-major, where a warpgroup's operand may be half the tile's
        columns. A swizzle atom may not straddle that half, so each atom is sized for the
        narrowest transposed use (FA3's trick to keep one copy of each tile). The fp32 dQ
        tile is flat, in the accumulators' fragment order (`dq_accum`)."""
        dkv_m, dkv_n = self.splits["dkv"]
        dq_m, dq_n = self.splits["dq"]

        def layout(rows, cols, stages, major_size):
            return swizzled_layout(self.dtype, (rows, cols, stages), major_size)

        # swap_sdp: dSᵀ (keys x queries, as computed), read by dQ as the MN-major dS (its A,
        # rows split by warpgroup; with dq_swap its B, every query per warpgroup).
        # dq_swap: Kᵀ is dQᵀ's A, its head dim split by warpgroup.
        ds_major = self.tile_m // (dq_n if self.dq_swap else dq_m)
        k_major = self.hdim // (dq_m if self.dq_swap else dq_n)
        pds = (layout(self.tile_n, self.tile_m, self.pds_stages, ds_major)
               if self.swap_sdp
               else layout(self.tile_m, self.tile_n, self.pds_stages, self._pds_major()))
        # Q and dO are read transposed by dK/dV: as B (split N) or, with swap_dkv, as A (M).
        qdo_split = dkv_m if self.swap_dkv else dkv_n
        return (layout(self.tile_m, self.hdim, self.q_stages, self.hdim // qdo_split),
                layout(self.tile_m, self.hdim_v, self.do_stages, self.hdim_v // qdo_split),
                layout(self.tile_n, self.hdim, 1, k_major),
                layout(self.tile_n, self.hdim_v, 1, self.hdim_v), pds,
                cute.make_layout(self.tile_m * self.hdim))

    def _pds_major(self) -> int:
        """Columns of the P/dS tile's swizzle atom: a warpgroup's share of dK/dV's reads, and
        with swap_dkv also of its S columns (24 at tile_n 48, which no 16-column atom tiles)."""
        dkv_m, dkv_n = self.splits["dkv"]
        if cutlass.const_expr(self.swap_dkv):
            return math.gcd(self.tile_n // dkv_n, self.tile_n // self.splits["sdp"][1])
        return self.tile_n // dkv_m

    def _tiled_mmas(self):
        """(S/dP, dK, dV, dQ) WGMMAs, every operand from shared memory.

        S = Q Kᵀ and dP = dO Vᵀ: both K-major. dV = Pᵀ dO and dK = dSᵀ Q: both operands are
        transposed views (MN-major). dQ = dS K: dS K-major, Kᵀ MN-major.
        swap_sdp: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (K-major); dV and dK take Pᵀ and dSᵀ from registers
        (A from registers is K-major); dQ reads dS as the MN-major view of the dSᵀ tile."""
        K, MN = OperandMajorMode.K, OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM

        def mma(a_major, b_major, split, n, a_source=warpgroup.OperandSource.SMEM):
            wg_m, wg_n = split
            return sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, a_major, b_major, Float32, (wg_m, wg_n, 1),
                (64, n // wg_n), a_source=a_source)

        s = self.splits
        if cutlass.const_expr(self.swap_sdp):
            # dQ = dS K, or dQᵀ = Kᵀ dSᵀ (dq_swap: N is the queries).
            dq_n = self.tile_m if self.dq_swap else self.hdim
            return (mma(K, K, s["sdp"], self.tile_m), mma(K, MN, s["dkv"], self.hdim, rmem),
                    mma(K, MN, s["dkv"], self.hdim_v, rmem), mma(MN, MN, s["dq"], dq_n))
        if cutlass.const_expr(self.swap_dkv):
            # dKᵀ = Qᵀ dS, dVᵀ = dOᵀ P: (hdim, tile_n), both operands MN-major views.
            return (mma(K, K, s["sdp"], self.tile_n), mma(MN, MN, s["dkv"], self.tile_n),
                    mma(MN, MN, s["dkv"], self.tile_n), mma(K, MN, s["dq"], self.hdim))
        return (mma(K, K, s["sdp"], self.tile_n), mma(MN, MN, s["dkv"], self.hdim),
                mma(MN, MN, s["dkv"], self.hdim_v), mma(K, MN, s["dq"], self.hdim))

    # ---------------------------------------------------------------- device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom,
               mdO: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom,
               mV: cute.Tensor, mdQaccum: cute.Tensor,
               tma_lse: cute.CopyAtom, mLSElog2: cute.Tensor, tma_delta: cute.CopyAtom,
               mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
               mdQsem: Optional[cute.Tensor], softmax_scale: Float32, scale_log2: Float32,
               mod_scale: Float32, window_left: Int32, window_right: Int32,
               max_seqlen_q: Optional[Int32],
               mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sPdS_layout: cute.ComposedLayout, sdQ_layout: cute.Layout,
               mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma, mma_dv: cute.TiledMma,
               mma_dq: cute.TiledMma, mSeed: Optional[cute.Tensor], keep_threshold: Int32,
               dropout_scale: Float32, nheads: Int32, aux, block_mask,
               mTimeline: Optional[cute.Tensor], SharedStorage: cutlass.Constexpr,
               tx_bytes: cutlass.Constexpr):
        layouts = (sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout, sdQ_layout)
        mmas = (mma_sdp, mma_dk, mma_dv, mma_dq)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_do, tma_k, tma_v, tma_lse, tma_delta):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # K and V share one barrier (one expect_tx of both tiles' bytes), as do Q and LSE₂,
        # dO and Δ.
        pipes = make_tma_pipelines(((storage.mbar_kv, 1, tx_bytes[0]),
                                    (storage.mbar_q, self.q_stages, tx_bytes[1]),
                                    (storage.mbar_do, self.do_stages, tx_bytes[2])),
                                   4 * BWD_CONSUMER_WARPGROUPS)
        smem = SmemTiles(self, storage, layouts)

        n_block, head, batch = cute.arch.block_idx()
        head_kv = head // (mQ.shape[-2] // mK.shape[-2])
        seq = SeqInfo(batch, SeqInfo.extent(mQ, mCuSeqlensQ), SeqInfo.extent(mK, mCuSeqlensK),
                      mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, max_seqlen_q=max_seqlen_q)
        # Uniform over the CTA (varlen tiles past the sequence), so no role is left waiting.
        if n_block * self.tile_n < seq.seqlen_k:
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
            order = None
            if cutlass.const_expr(self.deterministic):
                order = DqOrder(self, mdQsem, seq, head, n_block, win_left, win_right)
            trace = self._trace(mTimeline, n_block, head, batch, m_min)
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(BWD_PRODUCER_REGISTERS)
                if warp_idx == 0:
                    self.produce((tma_q, tma_do, tma_k, tma_v, tma_lse, tma_delta),
                                 (mQ, mdO, mK, mV, mLSElog2, mDelta), smem, pipes, seq, head,
                                 head_kv, n_block, m_min, m_max, trace)
                if cutlass.const_expr(self.dq_tma):
                    if warp_idx == _DQ_WRITER_WARP:
                        self.write_dq(mdQaccum, smem, seq, head, order, m_min, m_max)
            else:
                cute.arch.setmaxregister_increase(BWD_CONSUMER_REGISTERS)
                tidx = cute.arch.thread_idx()[0] - 128
                step = BwdStep(self, tidx, seq, mmas, smem, (mLSElog2, mDelta), mdQaccum, head,
                               scale_log2, mod_scale, win_left, win_right, order,
                               self.cta_dropout((mSeed, keep_threshold, dropout_scale, nheads),
                                                seq, head), aux, states, trace)
                self.consume(step, smem, pipes, m_min, m_max, n_block)
                mark(trace, "epilogue_start", Int32(-1))
                self.store_dkv(step, mmas, tidx, seq, smem, mdK, mdV, head, n_block,
                               softmax_scale)
                mark(trace, "epilogue_end", Int32(-1))

    def _trace(self, mTimeline, n_block: Int32, head: Int32, batch: Int32, m_min: Int32):
        """This warp's timeline recorder (None without `timeline`): the first CTAs of head 0
        of batch entry 0 record; a "block" is a query tile, visited left to right."""
        if cutlass.const_expr(not self.timeline):
            return None
        on = (n_block < mTimeline.shape[0]) & (head == 0) & (batch == 0)
        return Timeline.of_warp(mTimeline, on, m_min, descending=False)

    def cta_dropout(self, dropout_args, seq: SeqInfo, head: Int32) -> Optional[Dropout]:
        """This CTA's `Dropout` (None without): its (batch entry, query head) draws, in the
        S accumulator's order (transposed with swap_sdp)."""
        if cutlass.const_expr(not self.dropout):
            return None
        seed, threshold, scale, nheads = dropout_args
        wg_cols = self.tile_n // self.splits["sdp"][1]
        return Dropout(seed, threshold, scale, (seq.batch, head, nheads), self.tile_m,
                       self.tile_n, rows_first=not self.swap_sdp, aligned=wg_cols % 16 == 0,
                       framed=self.dropout_frame)

    @cute.jit
    def store_dkv(self, step, mmas, tidx, seq, smem, mdK, mdV, head, n_block, softmax_scale):
        """dK *= softmax_scale; dK, dV rows < seqlen_k to global memory: 16-bit ones through
        shared memory (`store_dkv_rows`: dK in Q's ring and dV in dO's, or both in turn in
        Q's where one dO stage holds fewer rows than the keys), fp32 ones (GQA, summed by the
        host) straight from registers."""
        step.acc_dk.store(step.acc_dk.load() * softmax_scale)
        if cutlass.const_expr(step.dropout is not None):
            step.acc_dv.store(step.acc_dv.load() * step.dropout.scale)
        kv_rows = seq.seqlen_k - n_block * self.tile_n
        outs = ((step.acc_dk, mmas[1], mdK, self.hdim, smem.sQ),
                (step.acc_dv, mmas[2], mdV, self.hdim_v, smem.sdO))
        q_fits = self.q_stages * self.tile_m >= self.tile_n
        if cutlass.const_expr(mdK.element_type == self.dtype and q_fits):
            if cutlass.const_expr(self.do_stages * self.tile_m >= self.tile_n):
                self.store_dkv_rows(outs, tidx, seq, head, n_block, kv_rows)
            else:
                # One dO stage holds fewer rows than the keys (hdim 192's 96): dK, then dV,
                # through Q's ring.
                self.store_dkv_rows(outs[:1], tidx, seq, head, n_block, kv_rows)
                self.store_dkv_rows(((step.acc_dv, mmas[2], mdV, self.hdim_v, smem.sQ),),
                                    tidx, seq, head, n_block, kv_rows)
        else:
            for acc, mma, m_out, cols, _ in outs:
                store_acc_tile(mma, tidx, acc, seq.k_view(m_out, head), (self.tile_n, cols),
                               n_block, kv_rows, self.swap_dkv)

    @cute.jit
    def store_dkv_rows(self, outs, tidx, seq, head, n_block, kv_rows):
        """dK into the Q ring's shared memory and dV into dO's (both free once the two
        warpgroups' last GEMMs are done), then whole 128-bit rows to global memory. Straight
        from the accumulators a warp's store covers 8 rows in 4-byte pieces, and that
        epilogue is a larger share of a CTA the shorter the query sequence.

        The tiles take the swizzle of the rings they reuse (the atom of `_smem_layouts`, sized
        for a warpgroup's columns), so the accumulator's 8 rows of a store land in 8 different
        16-byte chunks. With swap_dkv the accumulators hold dKᵀ and dVᵀ and go in through a
        transposed view, one 16-bit store per element (FA4 transposes with stmatrix; not
        done here yet)."""
        epilogue = pipeline.NamedBarrier(barrier_id=BwdBarrier.EPILOGUE.value,
                                         num_threads=self.num_consumer_threads)
        epilogue.arrive_and_wait()
        dkv_n = self.splits["dkv"][1]
        tiles = []
        for acc, mma, m_out, cols, ring in outs:
            layout = swizzled_layout(self.dtype, (self.tile_n, cols), cols // dkv_n)
            s_tile = cute.make_tensor(ring.iterator, layout.outer)
            r = cute.make_rmem_tensor_like(acc, self.dtype)
            r.store(acc.load().to(self.dtype))
            # swap_dkv: the accumulator holds dKᵀ / dVᵀ, written through the transposed view.
            acc_view = transpose_view(s_tile) if cutlass.const_expr(self.swap_dkv) else s_tile
            cute.autovec_copy(r, mma.get_slice(tidx).partition_C(acc_view))
            tiles.append(s_tile)
        epilogue.arrive_and_wait()
        for (_, _, m_out, cols, _), s_tile in zip(outs, tiles):
            g = cute.local_tile(seq.k_view(m_out, head), (self.tile_n, cols), (n_block, 0))
            store_tile_rows(row_store(self.dtype, cols, self.num_consumer_threads), tidx,
                            s_tile, g, kv_rows)

    @cute.jit
    def produce(self, atoms, tensors, smem, pipes, seq, head, head_kv, n_block, m_min, m_max,
                trace=None):
        """Warp 0, all 32 lanes: `producer_acquire` elects the lane that arms the barrier, the
        TMA copy elects its own issuing lane. K and V are loaded even when no query tile sees
        this block, so the consumers' one wait is unconditional."""
        tma_q, tma_do, tma_k, tma_v, tma_lse, tma_delta = atoms
        mQ, mdO, mK, mV, mLSE, mDelta = tensors
        pipe_kv, pipe_q, pipe_do = pipes
        gQ = cute.local_tile(seq.q_view(mQ, head), (self.tile_m, self.hdim), (None, 0))
        gdO = cute.local_tile(seq.q_view(mdO, head), (self.tile_m, self.hdim_v), (None, 0))
        gK = cute.local_tile(seq.k_view(mK, head_kv), (self.tile_n, self.hdim), (n_block, 0))
        gV = cute.local_tile(seq.k_view(mV, head_kv), (self.tile_n, self.hdim_v), (n_block, 0))
        tQsQ, tQgQ = tma_partition(tma_q, smem.sQ, gQ)
        tdOsdO, tdOgdO = tma_partition(tma_do, smem.sdO, gdO)
        tKsK, tKgK = tma_partition(tma_k, smem.sK, gK)
        tVsV, tVgV = tma_partition(tma_v, smem.sV, gV)
        stats = None
        if cutlass.const_expr(self.stats_tma):
            stats = [tma_partition(atom, s, cute.local_tile(seq.lse_view(m, head), (self.tile_m,),
                                                            (None,)), rank=1)
                     for atom, s, m in ((tma_lse, smem.sLSE, mLSE),
                                        (tma_delta, smem.sDelta, mDelta))]

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        bar = pipe_kv.producer_get_barrier(kv_state)
        cute.copy(tma_k, tKgK, tKsK[None, 0], tma_bar_ptr=bar)
        cute.copy(tma_v, tVgV, tVsV[None, 0], tma_bar_ptr=bar)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        do_state = self.do_ring_state(pipeline.PipelineUserType.Producer)
        tiles = (tQgQ, tQsQ, tdOgdO, tdOsdO, stats)
        for m_block in cutlass.range(m_min, m_max, unroll=1):
            if cutlass.const_expr(do_state is None):
                self.load_q_do(atoms, tiles, pipe_q, pipe_do, q_state, q_state, m_block)
            else:
                self.load_q_do(atoms, tiles, pipe_q, pipe_do, q_state, do_state, m_block)
            mark(trace, "load_issued", m_block)
            q_state.advance()
            if cutlass.const_expr(do_state is not None):
                do_state.advance()

    @cute.jit
    def load_q_do(self, atoms, tiles, pipe_q, pipe_do, q_state, do_state, m_block: Int32):
        """TMA of query tile `m_block`'s Q with its LSE₂ rows, and of its dO with its Δ rows,
        into their rings' stages."""
        tma_q, tma_do, _, _, tma_lse, tma_delta = atoms
        tQgQ, tQsQ, tdOgdO, tdOsdO, stats = tiles
        lse, delta = stats if cutlass.const_expr(self.stats_tma) else (None, None)
        self.load_stage(pipe_q, q_state, (tma_q, tQgQ, tQsQ), (tma_lse, lse), m_block)
        self.load_stage(pipe_do, do_state, (tma_do, tdOgdO, tdOsdO), (tma_delta, delta), m_block)

    @cute.jit
    def load_stage(self, pipe, state, tile, row_stats, m_block: Int32):
        """One ring stage: (atom, global, shared) `tile`'s query tile `m_block` and, by TMA,
        its rows of LSE₂ or Δ (`row_stats`: atom, (shared, global)), on one barrier."""
        atom, t_global, t_smem = tile
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        cute.copy(atom, t_global[None, m_block], t_smem[None, state.index], tma_bar_ptr=bar)
        if cutlass.const_expr(self.stats_tma):
            stats_atom, (s_stats, g_stats) = row_stats
            cute.copy(stats_atom, g_stats[None, m_block], s_stats[None, state.index],
                      tma_bar_ptr=bar)

    @cute.jit
    def write_dq(self, mdQaccum, smem, seq, head, order, m_min, m_max):
        """Warp 1: the bulk reduce-add of each query tile's dQ partial from the shared dQ tile
        into its dQaccum tile (`dq_accum`; one lane issues it, bulk groups are that lane's,
        and every lane waits on its own). With `dq_per_wg` the tile is two parts, one per
        consumer warpgroup, each added as soon as its warpgroup has filled it.

        The rows of a tile past seqlen_q are added too, into this sequence's own tile. They
        are exactly ±0: dS = P ∘ (dP − Δ) = ±0 there (padded: dO, hence dP, and Δ are TMA's
        zero fill; varlen or seqused_q: LSE = +inf, `tile_row_values`, so P = 0) and dQ =
        dS K = ±0; adding ±0 changes no dQaccum value (never −0: it starts at +0), in any
        order, so determinism holds too. That needs finite values in the rows TMA reads: the
        consumers zero the Q, dO, K and V rows past a varlen sequence first
        (`BwdStep.clear_tail`)."""
        parts = BWD_CONSUMER_WARPGROUPS if self.dq_per_wg else 1
        barriers = [_dq_barriers(self, part) for part in range(parts)]
        for m_block in cutlass.range(m_min, m_max, unroll=1):
            for part in cutlass.range_constexpr(parts):
                if cutlass.const_expr(not self.deterministic):
                    # The previous tile's add of this part has read it (deterministic: it
                    # has completed). wait_group(N) leaves at most the N newest groups
                    # pending, and part 0's add is the older of the `parts` outstanding.
                    cute.arch.cp_async_bulk_wait_group(parts - 1 - part, read=True)
                barriers[part][1].arrive()
            if cutlass.const_expr(self.deterministic):
                order.wait(m_block)
                # The adds before ours were observed through the generic proxy; ours go
                # through the async one.
                cute.arch.fence_proxy("async.global")
            for part in cutlass.range_constexpr(parts):
                barriers[part][0].arrive_and_wait()
                reduce_add_tile(mdQaccum, smem.sdQ, seq, head, m_block, self.tile_m, self.hdim,
                                part, parts)
                cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.deterministic):
                # The add must be done in global memory, not just read, before the next
                # K/V tile's add may start.
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                cute.arch.fence_proxy("async.global")
                with cute.arch.elect_one():
                    order.signal(m_block)
        # Shared memory must outlive the last read.
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def consume(self, step, smem, pipes, m_min, m_max, n_block):
        """Both consumer warpgroups, in lockstep over the query tiles (they share P and dS)."""
        pipe_kv, pipe_q, pipe_do = pipes
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        if cutlass.const_expr(self.varlen or self.has_seqused_k):
            step.clear_tail((smem.sK[None, None, 0], smem.sV[None, None, 0]),
                            step.seq.seqlen_k - n_block * self.tile_n, self.tile_n)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        do_state = self.do_ring_state(pipeline.PipelineUserType.Consumer)
        for m_block in cutlass.range(m_min, m_max, unroll=1):
            if cutlass.const_expr(do_state is None):
                step.run(pipe_q, pipe_do, q_state, q_state, m_block, n_block)
            else:
                step.run(pipe_q, pipe_do, q_state, do_state, m_block, n_block)
            q_state.advance()
            if cutlass.const_expr(do_state is not None):
                do_state.advance()
        pipe_kv.consumer_release(kv_state)

    def do_ring_state(self, user):
        """The dO ring's own pipeline state, or None where it has as many stages as Q's (then
        Q's state indexes both, one register per tile). The loops advance the states in their
        own bodies: the DSL carries across iterations only what a loop body mutates."""
        if cutlass.const_expr(self.do_stages == self.q_stages):
            return None
        return pipeline.make_pipeline_state(user, self.do_stages)


def _dq_barriers(cfg: HopperBwd, wg: int = 0):
    """(full, empty) named barriers of the dQ tile: the 256 consumer threads and warp 1, or
    (`dq_per_wg`) of warpgroup `wg`'s half: its 128 threads and warp 1."""
    full, empty = dq_barrier_ids(cfg, wg)
    n = dq_barrier_threads(cfg)
    return (pipeline.NamedBarrier(barrier_id=full, num_threads=n),
            pipeline.NamedBarrier(barrier_id=empty, num_threads=n))


def dq_barrier_threads(cfg: HopperBwd) -> int:
    """Threads that meet at a dQ barrier: the consumers that fill the tile (one warpgroup's
    with `dq_per_wg`) and the writer warp."""
    return (128 if cfg.dq_per_wg else cfg.num_consumer_threads) + 32


def dq_barrier_ids(cfg: HopperBwd, wg):
    """(full, empty) barrier ids of warpgroup `wg`'s dQ half (an int, or the warp-uniform
    run-time index), or of the whole tile without `dq_per_wg`."""
    step = _DQ_WG_BARRIER_STRIDE * wg if cfg.dq_per_wg else 0
    return BwdBarrier.DQ_FULL.value + step, BwdBarrier.DQ_EMPTY.value + step


class ShuffledRows:
    """A thread's query columns of LSE₂ or Δ under swap_sdp with 128 query rows, kept one
    eighth per thread (FA3's shuffled statistics): in WGMMA's accumulator a column depends
    only on the lane's position in its quad (lane % 4) and the register, so the 8 lanes of a
    warp with the same lane % 4 hold the same 32 columns. Lane 4k + q keeps columns
    [4k, 4k + 4) of them, and ``[r]`` fetches column r from lane 4 (r // 4) + q by a warp
    shuffle: 4 registers per statistic instead of 32, which is what keeps the WGMMAs of the
    128 x 128 tile in flight (with 32, ptxas spills and serializes them).
    Lives only within straight-line code of one query tile."""

    LANES_PER_QUAD = 4
    SHARES = 32 // LANES_PER_QUAD  # the quads of a warp

    def __init__(self, vals: cute.Tensor, pos_in_quad):
        self.vals, self.pos_in_quad = vals, pos_in_quad
        self.per_lane = cute.size(vals)

    def __getitem__(self, r: int):
        src = (r // self.per_lane) * self.LANES_PER_QUAD + self.pos_in_quad
        return cute.arch.shuffle_sync(self.vals[r % self.per_lane], src)


class SmemTiles(DslState):
    """The shared-memory tensors of one CTA, each (rows, cols, stages)."""

    def __init__(self, cfg: HopperBwd, storage, layouts):
        get = lambda field, layout: field.get_tensor(layout.outer, swizzle=layout.inner)  # noqa: E731
        sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout, sdQ_layout = layouts
        self.sQ = get(storage.sQ, sQ_layout)
        self.sdO = get(storage.sdO, sdO_layout)
        self.sK = get(storage.sK, sK_layout)
        self.sV = get(storage.sV, sV_layout)
        self.sP = None if cfg.swap_sdp else get(storage.sP, sPdS_layout)
        self.sdS = get(storage.sdS, sPdS_layout)
        self.sdQ = storage.sdQ.get_tensor(sdQ_layout) if cfg.dq_tma else None
        # LSE₂ rides with Q's ring, Δ with dO's: each has its ring's stages.
        stats = [cute.make_layout((cfg.tile_m, stages), stride=(1, stats_stage_rows(cfg.tile_m)))
                 for stages in (cfg.q_stages, cfg.do_stages)]
        self.sLSE = storage.sLSE.get_tensor(stats[0])
        self.sDelta = storage.sDelta.get_tensor(stats[1])


class DqOrder(DslState):
    """Deterministic dQ for one CTA (K/V tile `n_block` of one head and batch): its turn at
    each query tile (`blocks.bwd.dq_turn`) and that tile's semaphore."""

    def __init__(self, cfg: HopperBwd, mdQsem: cute.Tensor, seq: SeqInfo, head, n_block,
                 win_left, win_right):
        self.cfg, self.seq, self.n_block = cfg, seq, n_block
        self.win_left, self.win_right = win_left, win_right
        self.sem = mdQsem[seq.batch, head, None]

    def _ptr(self, m_block):
        return self.sem.iterator + cute.crd2idx(m_block, self.sem.layout)

    @cute.jit
    def wait(self, m_block: Int32):
        cfg = self.cfg
        turn = dq_turn(self.n_block, m_block, cfg.tile_m, cfg.tile_n, self.seq.seqlen_q,
                       self.seq.seqlen_k, cfg.causal, self.win_left, self.win_right)
        wait_turn(self._ptr(m_block), turn)

    @cute.jit
    def signal(self, m_block: Int32):
        pass_turn(self._ptr(m_block))


class BwdStep(DslState):
    """One consumer thread's view of the five GEMMs and the per-query-tile math; holds the dK
    and dV accumulators across the loop."""

    def __init__(self, cfg: HopperBwd, tidx, seq, mmas, smem: SmemTiles, stats, mdQaccum, head,
                 scale_log2, mod_scale, win_left, win_right, order, dropout=None, aux=None,
                 block_states=None, trace=None):
        self.cfg, self.seq, self.tidx, self.order = cfg, seq, tidx, order
        self.trace = trace
        self.dropout = dropout
        self.scale_log2 = scale_log2
        self.win_left, self.win_right = win_left, win_right
        mma_sdp, mma_dk, mma_dv, mma_dq = mmas
        self.mma_sdp, self.mma_dk, self.mma_dv, self.mma_dq = mmas
        thr_sdp, thr_dk = mma_sdp.get_slice(tidx), mma_dk.get_slice(tidx)
        thr_dv, thr_dq = mma_dv.get_slice(tidx), mma_dq.get_slice(tidx)
        self.thr_sdp, self.thr_dq = thr_sdp, thr_dq
        # Consumer warpgroup 0 or 1, warp-uniform: shared-memory operands are partitioned at
        # the warpgroup's slice (`wgmma_slice`), barrier ids live in uniform registers.
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 - 1

        self._init_operands(cfg, wg, smem)
        self.acc_dk = cute.make_rmem_tensor(thr_dk.partition_shape_C(dkv_shape(cfg, cfg.hdim)),
                                            Float32)
        self.acc_dv = cute.make_rmem_tensor(
            thr_dv.partition_shape_C(dkv_shape(cfg, cfg.hdim_v)), Float32)
        self.acc_dk.fill(0.0)
        self.acc_dv.fill(0.0)

        self.coord_s = self.scores_view(thr_sdp.partition_C(_score_coords(cfg)))
        self.sLSE, self.sDelta = smem.sLSE, smem.sDelta
        self.sQ, self.sdO = smem.sQ, smem.sdO
        # Without their TMA (varlen): the (seqlen_q,) global views.
        self.g_lse, self.g_delta = (seq.lse_view(t, head) for t in stats)
        self.scores = tile_scores(cfg, mod_scale,
                                  AttentionMask(cfg.tile_m, cfg.tile_n, seq.seqlen_q,
                                                seq.seqlen_k, cfg.causal, win_left, win_right),
                                  aux, seq.batch, head, block_states, seq)
        # P and dS leave the S accumulator layout by stmatrix: four 8x8 blocks per
        # instruction, one row address per lane, so few shared-memory addresses stay live.
        # A warpgroup's tile_n / 2 keys: 24 at tile_n 48 (swap_dkv) take pairs of blocks.
        cols = cfg.tile_n // cfg.splits["sdp"][1] if not cfg.swap_sdp else 16
        self.r2s_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False,
                                              num_matrices=4 if cols % 16 == 0 else 2),
            cfg.dtype)
        self.thr_r2s = cute.make_tiled_copy_C(self.r2s_atom, mma_sdp).get_slice(tidx)
        self.tPsP = None if cfg.swap_sdp else self.thr_r2s.partition_D(smem.sP)
        self.tdSsdS = self.thr_r2s.partition_D(smem.sdS)
        self.pds_barrier = pipeline.NamedBarrier(barrier_id=BwdBarrier.PDS.value,
                                                 num_threads=cfg.num_consumer_threads)
        self.wg, self.wg_p_barrier_id = wg, BwdBarrier.WG0_P.value + wg
        self._init_dq(cfg, tidx, seq, mma_dq, smem, mdQaccum, head)

    def _init_operands(self, cfg, wg, smem):
        """The shared-memory operand fragments of the five GEMMs at warpgroup `wg`'s slice
        (`wgmma_slice`): which tile is A and which B follows swap_sdp, swap_dkv and dq_swap."""
        mma_sdp, mma_dk, mma_dv, mma_dq = self.mma_sdp, self.mma_dk, self.mma_dv, self.mma_dq

        def frag_a(mma, s):
            w = wgmma_slice(mma, wg)
            return w.make_fragment_A(w.partition_A(s))

        def frag_b(mma, s):
            w = wgmma_slice(mma, wg)
            return w.make_fragment_B(w.partition_B(s))

        if cutlass.const_expr(cfg.swap_sdp):
            # Sᵀ = K Qᵀ, dPᵀ = V dOᵀ; Pᵀ and dSᵀ stay in registers as dV's and dK's A.
            self.tSrK, self.tSrQ = frag_a(mma_sdp, smem.sK), frag_b(mma_sdp, smem.sQ)
            self.tdPrV, self.tdPrdO = frag_a(mma_sdp, smem.sV), frag_b(mma_sdp, smem.sdO)
            if cutlass.const_expr(cfg.dq_swap):
                self.tdQrdS = frag_b(mma_dq, transpose_view(smem.sdS))
            else:
                self.tdQrdS = frag_a(mma_dq, transpose_view(smem.sdS))
        else:
            self.tSrQ, self.tSrK = frag_a(mma_sdp, smem.sQ), frag_b(mma_sdp, smem.sK)
            self.tdPrdO, self.tdPrV = frag_a(mma_sdp, smem.sdO), frag_b(mma_sdp, smem.sV)
            self.tdQrdS = frag_a(mma_dq, smem.sdS)
        if cutlass.const_expr(cfg.swap_dkv):
            # dVᵀ = dOᵀ P, dKᵀ = Qᵀ dS: the transposed views swap operand roles.
            self.tdVrdOt = frag_a(mma_dv, transpose_view(smem.sdO))
            self.tdKrQt = frag_a(mma_dk, transpose_view(smem.sQ))
            self.tdVrPt = frag_b(mma_dv, transpose_view(smem.sP))
            self.tdKrdSt = frag_b(mma_dk, transpose_view(smem.sdS))
        else:
            if cutlass.const_expr(not cfg.swap_sdp):
                self.tdVrPt = frag_a(mma_dv, transpose_view(smem.sP))
                self.tdKrdSt = frag_a(mma_dk, transpose_view(smem.sdS))
            self.tdVrdOt = frag_b(mma_dv, transpose_view(smem.sdO))
            self.tdKrQt = frag_b(mma_dk, transpose_view(smem.sQ))
        if cutlass.const_expr(cfg.dq_swap):
            self.tdQrKt = frag_a(mma_dq, transpose_view(smem.sK))
        else:
            self.tdQrKt = frag_b(mma_dq, transpose_view(smem.sK))

    def _init_dq(self, cfg, tidx, seq, mma_dq, smem, mdQaccum, head):
        """dQ's way out: the shared fragment-order dQ tile (`dq_accum`) or atomics."""
        if cutlass.const_expr(cfg.dq_tma):
            self.tdQsdQ = thread_view(smem.sdQ, tidx, cfg.tile_m * cfg.hdim // DQ_THREADS)
        else:
            self.coord_dq = acc_to_mn(self.thr_dq.partition_C(
                cute.make_identity_tensor((cfg.tile_m, cfg.hdim))))
            self.g_dq = seq.q_view(mdQaccum, head)

    @cute.jit
    def clear_tail(self, tiles, valid_rows: Int32, rows: int):
        """Zero the rows >= valid_rows of (shared-memory) tiles TMA loaded past the end of a
        varlen or seqused sequence (`sm90plus.tma.clear_tails`). Keys there have P = 0 and queries
        P = 0 (LSE₂ = +inf), but NaN or inf in those rows (the next sequence, or the unused tail of
        the packed tensor) would still reach dP = dO Vᵀ, S = Q Kᵀ, dQ = dS K or dV = Pᵀ dO as
        0 x NaN. Uniform over the CTA, so both warpgroups meet at its barrier."""
        if valid_rows < rows:
            clear_tails(tiles, valid_rows, 0, self.tidx, self.cfg.num_consumer_threads,
                        BwdBarrier.TAIL.value)

    @cute.jit
    def clear_q_tail(self, pipe_do, q_state, do_state, m_block: Int32):
        """Varlen or seqused_q: the query tile that ends the sequence gets its Q and dO rows
        past it zeroed
        (`clear_tail`) before any GEMM reads them; dO is waited for first."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.varlen or cfg.has_seqused_q):
            valid = self.seq.seqlen_q - m_block * cfg.tile_m
            if valid < cfg.tile_m:
                pipe_do.consumer_wait(do_state)
                self.clear_tail((self.sQ[None, None, q_state.index],
                                 self.sdO[None, None, do_state.index]), valid, cfg.tile_m)

    @cute.jit
    def row_values(self, m_block: Int32, stage, lse: cutlass.Constexpr[bool]):
        """This thread's query rows of LSE₂ (+inf outside the sequence) or Δ (0 outside) of
        tile `m_block` (`tile_row_values`): from shared memory, or without their TMA from
        global memory, clamped to the sequence's last row. With `shuffle_stats`, a
        `ShuffledRows` of them."""
        cfg = self.cfg
        outside = Float32.inf if lse else Float32(0.0)
        valid_rows = self.seq.seqlen_q - m_block * cfg.tile_m
        clamp = not cfg.stats_tma
        if cutlass.const_expr(cfg.stats_tma):
            t = (self.sLSE if lse else self.sDelta)[None, stage]
        else:
            t = cute.local_tile(self.g_lse if lse else self.g_delta, (cfg.tile_m,), (m_block,))
        checked = cfg.stats_checked
        if cutlass.const_expr(cfg.shuffle_stats):
            lane = cute.arch.lane_idx()
            quad_size = ShuffledRows.LANES_PER_QUAD
            vals = tile_row_values(self.coord_s, valid_rows, t, outside, clamp,
                                   ShuffledRows.SHARES, lane // quad_size, checked)
            return ShuffledRows(vals, lane % quad_size)
        return tile_row_values(self.coord_s, valid_rows, t, outside, clamp, checked=checked)

    @cute.jit
    def row_stats(self, m_block: Int32, q_stage, do_stage):
        """(LSE₂, Δ) of this thread's query rows of tile `m_block` (stages of the Q and dO
        rings they came with)."""
        return (self.row_values(m_block, q_stage, True),
                self.row_values(m_block, do_stage, False))

    def scores_view(self, acc: cute.Tensor) -> cute.Tensor:
        """A score-shaped accumulator (or its coordinates) as (query rows, key cols), the
        blocks' view: with swap_sdp the accumulator holds Sᵀ, so its (rows, cols) swap."""
        mn = acc_to_mn(acc)
        if cutlass.const_expr(self.cfg.swap_sdp):
            return permute(mn, (1, 0))
        return mn

    @cute.jit
    def run(self, pipe_q, pipe_do, q_state, do_state, m_block: Int32, n_block: Int32):
        """Query tile `m_block` against this CTA's keys (steps 1-5 of `HopperBwd`)."""
        if cutlass.const_expr(self.cfg.swap_sdp):
            self.run_swapped(pipe_q, pipe_do, q_state, do_state, m_block, n_block)
        else:
            self.run_smem_p(pipe_q, pipe_do, q_state, do_state, m_block, n_block)

    @cute.jit
    def issue_s_dp(self, pipe_q, pipe_do, q_state, do_state, m_block: Int32):
        """Step 1: wait for Q[m] (zeroing its rows past the sequence), issue S = Q Kᵀ; wait
        for dO[m], issue dP = dO Vᵀ (with swap_sdp Sᵀ = K Qᵀ and dPᵀ = V dOᵀ). Neither is
        waited for; returns their accumulators."""
        q_stage, do_stage = q_state.index, do_state.index
        mark(self.trace, "wait_start", m_block)
        pipe_q.consumer_wait(q_state)
        mark(self.trace, "wait_end", m_block)
        self.clear_q_tail(pipe_do, q_state, do_state, m_block)
        acc_s = self.new_acc_s()
        if cutlass.const_expr(self.cfg.swap_sdp):
            gemm(self.mma_sdp, acc_s, self.tSrK, self.tSrQ, 0, q_stage, False)
        else:
            gemm(self.mma_sdp, acc_s, self.tSrQ, self.tSrK, q_stage, 0, False)
        pipe_do.consumer_wait(do_state)
        acc_dp = self.new_acc_s()
        if cutlass.const_expr(self.cfg.swap_sdp):
            gemm(self.mma_sdp, acc_dp, self.tdPrV, self.tdPrdO, 0, do_stage, False)
        else:
            gemm(self.mma_sdp, acc_dp, self.tdPrdO, self.tdPrV, do_stage, 0, False)
        mark(self.trace, "qk_issued", m_block)
        return acc_s, acc_dp

    @cute.jit
    def run_swapped(self, pipe_q, pipe_do, state, do_state, m_block: Int32, n_block: Int32):
        """swap_sdp: Sᵀ and dPᵀ per warpgroup's 64 keys; dV += Pᵀ dO and dK += dSᵀ Q with A
        from registers; only dSᵀ goes to shared memory, for dQ. Q and dO have as many stages
        (`config.bwd_mma_splits`), so Q's stage index also serves dO, Δ and P/dS."""
        cfg = self.cfg
        stage = state.index
        pds = stage if cutlass.const_expr(cfg.pds_stages > 1) else 0
        tile_state = self.scores.tile_state(m_block, n_block)
        acc_s, acc_dp = self.issue_s_dp(pipe_q, pipe_do, state, do_state, m_block)
        s_qk, dp_qk = self.scores_view(acc_s), self.scores_view(acc_dp)
        g_qk = self.grad_view(acc_s, self.scores_view)
        if cutlass.const_expr(cfg.pds_stages == 1):
            self.pds_barrier.arrive_and_wait()
        warpgroup.wait_group(0 if cutlass.const_expr(cfg.fused_p_ds) else 1)
        mark(self.trace, "qk_done", m_block)
        mark(self.trace, "softmax_start", m_block)
        self.mask_scores(s_qk, m_block, n_block, g_qk, tile_state)
        # A thread holds 16 (at 80 rows 20, at 128 rows 32) queries' columns here, not 2 rows:
        # LSE₂ and Δ are each read just before their use, so that both are never live at once.
        # Beyond 64 query rows: dS before dV is issued, so that the fp32 P, dP and the 16-bit P
        # that dV reads from registers are never all live (with them, ptxas spills and
        # serializes the WGMMAs); dV then overlaps only dK and dQ. At 128 rows dS is also
        # stored first (`config.ds_stored_before_dv`).
        ds_first = cfg.fused_p_ds or cfg.tile_m != 64
        if cutlass.const_expr(ds_first):
            if cutlass.const_expr(not cfg.fused_p_ds):
                warpgroup.wait_group(0)
                probs(s_qk, self.row_values(m_block, stage, True), self.scale_log2)
                ds_from_probs(s_qk, dp_qk, self.row_values(m_block, stage, False))
            else:
                self.p_ds(s_qk, dp_qk, self.row_stats(m_block, stage, stage), m_block,
                          n_block, g_qk)
            r_p = self.to_dtype(acc_s)
            if cutlass.const_expr(cfg.ds_stored_first):
                r_ds = self.store_ds(acc_dp, pds)
            gemm_rs(self.mma_dv, self.acc_dv, acc_to_operand_a(r_p), self.tdVrdOt, stage)
            if cutlass.const_expr(not cfg.ds_stored_first):
                r_ds = self.store_ds(acc_dp, pds)
        else:
            probs(s_qk, self.row_values(m_block, stage, True), self.scale_log2)
            r_p = self.to_dtype(acc_s)
            gemm_rs(self.mma_dv, self.acc_dv, acc_to_operand_a(r_p), self.tdVrdOt, stage)
            warpgroup.wait_group(1)  # dP; dV still runs
            ds_from_probs(s_qk, dp_qk, self.row_values(m_block, stage, False))
            r_ds = self.store_ds(acc_dp, pds)
        mark(self.trace, "softmax_end", m_block)
        cute.arch.fence_view_async_shared()
        self.pds_barrier.arrive_and_wait()
        acc_dq = self.new_acc_dq()
        if cutlass.const_expr(cfg.dq_swap):
            gemm(self.mma_dq, acc_dq, self.tdQrKt, self.tdQrdS, 0, pds, False)
        else:
            gemm(self.mma_dq, acc_dq, self.tdQrdS, self.tdQrKt, pds, 0, False)
        gemm_rs(self.mma_dk, self.acc_dk, acc_to_operand_a(r_ds), self.tdKrQt, stage)
        mark(self.trace, "pv_issued", m_block)
        self.finish_dq(pipe_q, pipe_do, state, do_state, acc_dq, m_block)

    @cute.jit
    def store_ds(self, acc_dp, pds):
        """dS (in dP's accumulator) to 16 bits, into shared memory stage `pds`; returns the
        16-bit fragment (dK's register A)."""
        r_ds = self.to_dtype(acc_dp)
        cute.copy(self.r2s_atom, self.thr_r2s.retile(r_ds), self.tdSsdS[None, None, None, pds])
        return r_ds

    @cute.jit
    def run_smem_p(self, pipe_q, pipe_do, q_state, do_state, m_block: Int32, n_block: Int32):
        """P and dS both through shared memory (tile_n 64, or swap_dkv)."""
        cfg = self.cfg
        stage, do_stage = q_state.index, do_state.index
        # Stage m's index: consecutive query tiles alternate P/dS buffers. A warpgroup writes
        # tile m+1's only after the dS barrier of tile m, which the other reaches after its
        # tile m-1 GEMMs (the last readers of that buffer) completed.
        pds = stage if cutlass.const_expr(cfg.pds_stages > 1) else 0
        tile_state = self.scores.tile_state(m_block, n_block)
        acc_s, acc_dp = self.issue_s_dp(pipe_q, pipe_do, q_state, do_state, m_block)
        lse, delta = self.row_stats(m_block, stage, do_stage)
        s_mn, dp_mn = acc_to_mn(acc_s), acc_to_mn(acc_dp)
        g_mn = self.grad_view(acc_s, acc_to_mn)
        if cutlass.const_expr(cfg.pds_stages == 1):
            # One P/dS buffer: both warpgroups' GEMMs of the previous tile are done with it.
            self.pds_barrier.arrive_and_wait()
        # A score mod's derivative (softcap's) reads S, which P overwrites: S and dP are both
        # waited for.
        warpgroup.wait_group(0 if cutlass.const_expr(cfg.fused_p_ds) else 1)
        mark(self.trace, "qk_done", m_block)
        mark(self.trace, "softmax_start", m_block)
        self.mask_scores(s_mn, m_block, n_block, g_mn, tile_state)
        if cutlass.const_expr(cfg.fused_p_ds):
            self.p_ds(s_mn, dp_mn, (lse, delta), m_block, n_block, g_mn)
        else:
            probs(s_mn, lse, self.scale_log2)
        self.to_smem(acc_s, self.tPsP, pds)
        # Generic-proxy stores must be made visible to the async proxy that WGMMA reads
        # shared memory through, and every warp's part of the P that dV reads must be written.
        cute.arch.fence_view_async_shared()
        self.p_barrier()
        if cutlass.const_expr(cfg.swap_dkv):
            gemm(self.mma_dv, self.acc_dv, self.tdVrdOt, self.tdVrPt, do_stage, pds, True)
        else:
            gemm(self.mma_dv, self.acc_dv, self.tdVrPt, self.tdVrdOt, pds, do_stage, True)
        if cutlass.const_expr(not cfg.fused_p_ds):
            warpgroup.wait_group(1)  # dP; dV still runs
            ds_from_probs(s_mn, dp_mn, delta)
        self.to_smem(acc_dp, self.tdSsdS, pds)
        mark(self.trace, "softmax_end", m_block)
        cute.arch.fence_view_async_shared()
        self.pds_barrier.arrive_and_wait()
        self.dq_and_dk(pipe_q, pipe_do, q_state, do_state, pds, m_block)

    @cute.jit
    def dq_and_dk(self, pipe_q, pipe_do, q_state, do_state, pds, m_block: Int32):
        """Step 5: dQ = dS K and dK += dSᵀ Q; dQ leaves while dK runs."""
        cfg = self.cfg
        acc_dq = self.new_acc_dq()
        gemm(self.mma_dq, acc_dq, self.tdQrdS, self.tdQrKt, pds, 0, False)
        if cutlass.const_expr(cfg.swap_dkv):
            gemm(self.mma_dk, self.acc_dk, self.tdKrQt, self.tdKrdSt, q_state.index, pds, True)
        else:
            gemm(self.mma_dk, self.acc_dk, self.tdKrdSt, self.tdKrQt, pds, q_state.index, True)
        mark(self.trace, "pv_issued", m_block)
        self.finish_dq(pipe_q, pipe_do, q_state, do_state, acc_dq, m_block)

    @cute.jit
    def finish_dq(self, pipe_q, pipe_do, q_state, do_state, acc_dq, m_block: Int32):
        """With dV, dQ and then dK in flight: dQ leaves while dK runs, then Q and dO are
        released."""
        cfg = self.cfg
        warpgroup.wait_group(1)  # dV and dQ; dK still runs
        pipe_do.consumer_release(do_state)
        if cutlass.const_expr(cfg.dq_tma):
            self.dq_to_smem(acc_dq)
        else:
            self.dq_atomic(acc_dq, m_block)
        warpgroup.wait_group(0)
        mark(self.trace, "pv_done", m_block)
        pipe_q.consumer_release(q_state)

    @cute.jit
    def p_ds(self, s_mn: cute.Tensor, dp_mn: cute.Tensor, stats, m_block: Int32,
             n_block: Int32, grad_mn=None):
        """S → P and dP → dS in one pass (`HopperBwd.fused_p_ds`), with dropout's draws where
        the kernel has them; `grad_mn`: a traced mod's derivative (`grad_view`)."""
        lse, delta = stats
        hook = self.scores.ds_hook(self.coord_s, m_block, n_block)
        if cutlass.const_expr(self.dropout is None):
            p_and_ds(s_mn, dp_mn, lse, delta, self.scale_log2, self.cfg.score_mod, grad_mn,
                     hook)
        else:
            p_and_ds_dropout(s_mn, dp_mn, lse, delta, self.scale_log2, self.cfg.score_mod,
                             self.dropout, self.coord_s, m_block, n_block, grad_mn, hook)

    def grad_view(self, acc_s: cute.Tensor, view):
        """A register fragment for a traced score mod's derivative, in S's `view` (None unless
        the mod has one that is not 1)."""
        if cutlass.const_expr(not self.scores.needs_grad):
            return None
        return view(cute.make_rmem_tensor_like(acc_s, Float32))

    @cute.jit
    def mask_scores(self, s_mn: cute.Tensor, m_block: Int32, n_block: Int32, grad_mn=None,
                    state=None):
        """The score seam: score mod, then the mask where this block needs it
        (`flash_cute.blocks.score.Scores`); `state`: the tile's block-mask state, loaded early."""
        self.scores.prepare(s_mn, self.coord_s, m_block, n_block, grad_mn=grad_mn, state=state)

    @cute.jit
    def p_barrier(self):
        """P of the dV GEMM written: with tile_n 128 a warpgroup's dV rows are the keys whose
        S (and P) columns it computed itself, so its own 128 threads suffice; else (and with
        swap_dkv, where a warpgroup's dVᵀ rows are head-dim rows over every key) all 256."""
        if cutlass.const_expr(self.cfg.splits["dkv"] == (2, 1) and not self.cfg.swap_dkv):
            cute.arch.barrier(barrier_id=self.wg_p_barrier_id, number_of_threads=128)
        else:
            self.pds_barrier.arrive_and_wait()

    @cute.jit
    def to_smem(self, acc: cute.Tensor, t_smem: cute.Tensor, stage):
        """A score-shaped fp32 accumulator, converted to 16 bits, into stage `stage` of a
        P/dS tile."""
        r = self.to_dtype(acc)
        cute.copy(self.r2s_atom, self.thr_r2s.retile(r), t_smem[None, None, None, stage])

    @cute.jit
    def to_dtype(self, acc: cute.Tensor) -> cute.Tensor:
        r = cute.make_rmem_tensor_like(acc, self.cfg.dtype)
        r.store(acc.load().to(self.cfg.dtype))
        return r

    def new_acc_dq(self) -> cute.Tensor:
        """dQ's accumulator: (tile_m, hdim), or dQᵀ's (hdim, tile_m) with dq_swap; either
        leaves in fragment order (`dq_accum`), mapped back by the postprocess."""
        cfg = self.cfg
        shape = (cfg.hdim, cfg.tile_m) if cfg.dq_swap else (cfg.tile_m, cfg.hdim)
        return cute.make_rmem_tensor(self.thr_dq.partition_shape_C(shape), Float32)

    def new_acc_s(self) -> cute.Tensor:
        return cute.make_rmem_tensor(self.thr_sdp.partition_shape_C(_score_shape(self.cfg)),
                                     Float32)

    @cute.jit
    def dq_to_smem(self, acc_dq: cute.Tensor):
        """dQ partial into the shared dQ tile (`dq_per_wg`: this warpgroup's half), once the
        dQ writer's bulk add has read the last one."""
        full, empty = _dq_barriers(self.cfg, self.wg)
        empty.arrive_and_wait()
        cute.autovec_copy(as_vectors(acc_dq), self.tdQsdQ)
        # The bulk add reads the tile through the async proxy.
        cute.arch.fence_view_async_shared()
        full.arrive()

    @cute.jit
    def dq_atomic(self, acc_dq: cute.Tensor, m_block: Int32):
        """dQ partial = dS K[n]; fp32 atomics into the in-bounds rows of this query tile, in
        turn when deterministic (every thread waits for the turn; all 256 threads' atomics are
        made visible at gpu scope before one thread passes it)."""
        if cutlass.const_expr(self.cfg.deterministic):
            self.order.wait(m_block)
        g_dq = cute.local_tile(self.g_dq, (self.cfg.tile_m, self.cfg.hdim), (m_block, 0))
        atomic_add_rows(acc_to_mn(acc_dq), self.coord_dq, g_dq,
                        self.seq.seqlen_q - m_block * self.cfg.tile_m)
        if cutlass.const_expr(self.cfg.deterministic):
            cute.arch.fence_acq_rel_gpu()
            self.pds_barrier.arrive_and_wait()
            if self.tidx == 0:
                self.order.signal(m_block)


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
         stage_a, stage_b, accumulate: cutlass.Constexpr[bool]):
    """Issue acc (+)= A[stage_a] · B[stage_b] over every k-block as one committed WGMMA group,
    without waiting: the caller waits (`warpgroup.wait_group`) where it reads acc, or before
    the shared-memory operands are overwritten.

    A fresh atom per GEMM: ACCUMULATE is atom state, and an atom reused across the run-time
    loop would carry it as a loop value. `accumulate=False` zero-initializes acc. The fence
    orders earlier ordinary accesses to acc's registers before the WGMMAs."""
    atom = cute.make_mma_atom(tiled_mma.op)
    # The stage first, then the k-blocks: each k-block's descriptor is then the stage's plus a
    # constant (FA4's form), not rebuilt from (k, stage).
    a, b = tA[None, None, None, stage_a], tB[None, None, None, stage_b]
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        atom.set(warpgroup.Field.ACCUMULATE, accumulate or k != 0)
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
    warpgroup.commit_group()


def dkv_shape(cfg: HopperBwd, cols: int) -> tuple:
    """dK's or dV's accumulator tile: (keys, cols), or with swap_dkv (cols, keys)."""
    return (cols, cfg.tile_n) if cfg.swap_dkv else (cfg.tile_n, cols)


def _score_shape(cfg: HopperBwd) -> tuple:
    """The S/dP accumulator's (M, N): (queries, keys), or (keys, queries) with swap_sdp."""
    return (cfg.tile_n, cfg.tile_m) if cfg.swap_sdp else (cfg.tile_m, cfg.tile_n)


def _score_coords(cfg: HopperBwd) -> cute.Tensor:
    """(query, key) coordinates laid out like the S/dP accumulator's tile: with swap_sdp,
    position (key, query) holds the coordinate (query, key)."""
    ident = cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))
    if cutlass.const_expr(cfg.swap_sdp):
        return cute.composition(ident, cute.make_layout((cfg.tile_n, cfg.tile_m),
                                                        stride=(cfg.tile_m, 1)))
    return ident


@cute.jit
def gemm_rs(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
            stage_b):
    """Issue acc += A · B[stage_b] with A (16-bit, a converted accumulator viewed by
    `acc_to_operand_a`) from registers, as one committed group; A's registers must stay
    untouched until it completes."""
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, True)
    b = tB[None, None, None, stage_b]
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        cute.gemm(atom, acc, tA[None, None, k], b[None, None, k], acc)
    warpgroup.commit_group()


def mark(trace, event: str, block: Int32):
    """A phase boundary on the timeline (nothing without `timeline`)."""
    if cutlass.const_expr(trace is not None):
        trace.record(event, block)


def registers_per_role() -> dict:
    """setmaxnreg budgets of each role, for `inspect`."""
    return {"producer": BWD_PRODUCER_REGISTERS, "consumer": BWD_CONSUMER_REGISTERS}
