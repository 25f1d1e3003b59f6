"""FlashAttention forward on sm100a (Blackwell): tcgen05 MMAs with S, P and O in tensor memory,
TMA loads, warp-specialized roles with the softmax of two Q tiles ping-ponged through the
tensor core (at hdim 256 one Q tile, its blocks' S double-buffered), the rescale of O in its
own warpgroup, and part of the exponentials by FMAs.

Compile-verified only: it cross-compiles for sm_100a and its SASS is checked on the CPU
(`tests/test_blackwell.py`), and it has not run on Blackwell hardware.
"""

import functools
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import TmemAllocator

from flash_cute.arch.sm90plus.tma import COLS_FIRST, ROWS_FIRST, permute, smem_tile, tma_partition
from flash_cute.blocks.dsl_state import DslState
from flash_cute.blocks.layouts import assume_aligned_strides, pack_heads
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
from flash_cute.blocks.softmax import LN_2, OnlineSoftmax
from flash_cute.blocks.work_loop import for_each_tile, num_sms
from flash_cute.contract.block_range import block_range, narrow_pair
from flash_cute.contract.kernel_args import FwdArgs
from flash_cute.contract.tile_order import TileOrder, launch_grid, pairs_per_section
from flash_cute.contract.variant import Variant

from .config import (
    DEFAULT_NUM_SMS,
    FWD_SCHEDULES,
    Q_STAGES,
    RESCALE_THRESHOLD,
    ROLE_REGISTERS,
    ROLE_REGISTERS_ONE_TILE,
    SMEM_CAPACITY,
    STATIC_SMEM,
    TILE_M,
    FwdSchedule,
    smem_bytes,
    tmem_plan,
)

# Warp roles (`BlackwellFwd` docstring).
_SOFTMAX1_WARP = 4  # softmax i: warps 4i .. 4i+3
_CORRECTION_WARP = 8
_MMA_WARP = 12
_LOAD_WARP = 13
_TMEM_ALLOC_BARRIER = 1
# S buffers in tensor memory: one per Q tile, or with one Q tile its blocks in turn.
_S_BUFFERS = 2
# Columns per chunk of O that the correction warpgroup moves through registers at once.
_O_CHUNK = 16
# Columns of P (fp32 words, two 16-bit values each) per tensor-memory store.
_P_CHUNK = 16
# Columns of S per pass of the mods (`BlackwellFwd._mods_in_tmem`).
_S_CHUNK = 32


class BlackwellFwd:
    """Forward kernel: O = softmax(Q Kᵀ · scale) V and LSE over (tile of 256 rows, 128 at
    hdim 256; head; batch).

    | warps  | warpgroup | registers | role                                                 |
    |--------|-----------|-----------|------------------------------------------------------|
    | 0..3   | 0         | 192       | softmax 0: rows 0..127 (Q tile 0), one row a thread  |
    | 4..7   | 1         | 192       | softmax 1: rows 128..255 (Q tile 1)                  |
    | 8..11  | 2         | 88        | correction: rescales O_i in TMEM, then O / l → global, LSE |
    | 12     | 3         | 40        | MMA: issues every tcgen05 MMA; allocates and frees TMEM |
    | 13     | 3         | 40        | load: TMA of Q0, Q1, then K[n], V[n] per block         |
    | 14, 15 | 3         | 40        | idle (setmaxnreg is warpgroup-wide)                  |

    A thread of softmax i and of the correction warpgroup owns one row of its Q tile: TMEM
    lane = row, and a warp may touch only its quarter of the lanes (warp % 4), so the roles
    come in aligned groups of four warps.

    | tensor memory (fp32 columns, `config.tmem_plan`) | hdim_v 64 | 128     |
    |--------------------------------------------------|-----------|---------|
    | S0 = Q0 Kᵀ; P0 (16-bit) in its upper half          | 0..127    | 0..127  |
    | S1 = Q1 Kᵀ; P1 in its upper half                   | 128..255  | 128..255|
    | O0, O1                                             | 256.., 320.. | 256.., 384.. |
    (hdim 256, one Q tile: S0 0..63, S1 64..127, O 128..383.)

    | barrier                     | stages | arrivals                | meaning                 |
    |-----------------------------|--------|-------------------------|-------------------------|
    | Q ring (PipelineTmaUmma)    | q_tiles | TMA bytes / MMA commit | Q_i landed / read        |
    | K ring, V ring              | config | TMA bytes / MMA commit  | block landed / read      |
    | s_full[i] (mbarrier)        | 1      | 1 (tcgen05.commit)      | S_i = Q_i K[j]ᵀ is in TMEM |
    | p_ready[i] (mbarrier)       | 1      | 128 softmax + 128 correction | P_i written and O_i |
    |                             |        |                         | rescaled: PV_i may run  |
    | o_full[i] (mbarrier)        | 1      | 1 (tcgen05.commit)      | the tile's last PV_i done |
    |                             |        |                         | (one Q tile: each PV)   |
    | stats[i] (PipelineAsync) | 1 | 128 / 128 | softmax i's row factors (then l, m) in smem |

    hdim 256 (`FwdSchedule.q_tiles` 1, D-BW-HD256): two 256-column O accumulators fill the
    tensor memory, so a CTA runs one 128-row Q tile, softmax 1's warps idle (24 registers),
    and the two S buffers (64-key blocks, S0 at 0, S1 at 64, O at 128..383) take the tile's
    blocks in turn. The MMA warp's order: QK(0) into S0; then per block j, QK(j+1) into the
    other buffer, PV(j) (after p_ready of j's buffer), a tcgen05.commit to o_full after
    each PV. The softmax of S(j+1) runs under PV(j); the correction waits o_full for PV(j-1)
    before it rescales O for block j. s_full and p_ready carry one phase bit per buffer.

    The MMA warp's order per tile: QK0(0), QK1(0); then per block j: PV0(j-1), QK0(j), PV1(j-1),
    QK1(j); then PV0(n-1), PV1(n-1). PV_i(j-1) is issued before QK_i(j), so P_i can live in
    S_i's columns (tcgen05 MMAs of one thread run in order) and S_i(j) being ready means
    PV_i(j-1) is done: the correction warpgroup rescales O_i for block j when softmax i's
    factors for it arrive, with no barrier of its own. The rescale is skipped where no row of
    a warp moved its max (`OnlineSoftmax.update_max` with FA4's threshold).

    Softmax i per block: wait s_full, load S_i (TMEM → registers), the score mod and mask
    (`Scores`; traced or FA4-form mods run first, on S_i in TMEM 32 columns at a time,
    `_mods_in_tmem`), the row max and factor (to smem, stats[i]), the exponentials (a share
    by FMAs, `exp2_emu`), P_i to TMEM in 16-bit, fence, arrive p_ready, the row sum. At the
    tile's end it hands l and M (the scaled max, `OnlineSoftmax`) to the correction
    warpgroup, which waits o_full[i], normalizes O_i chunk by chunk from TMEM and stores its
    rows to global memory (row predicates: varlen and padding rows stay untouched), and
    writes the LSE.

    Packed GQA (``pack_gqa`` = g > 1, g dividing 128): a Q tile's rows are g query heads of
    one K/V head by 128 / g queries (row r: query r // g of head r % g), Q, O and LSE as
    `layouts.pack_heads` views, Q loaded as one TMA box; the mask and block range see queries.

    Tiles (`flash_cute.contract.tile_order`): persistent, causal and right windows heaviest first.
    Every role walks the same tiles and the same block count per tile (`block_range` of the
    CTA's tile, a block mask's span over its Q tiles; each Q tile masks its own rows), so
    their barrier phases stay in step; a tile with no block skips the MMAs and stores O = 0,
    LSE = -inf. TMEM is allocated before the roles split and freed after they join, on the
    kernel's one exit.
    """

    def pipeline(self):
        """This kernel's pipeline as data (`flash_cute.contract.pipeline`)."""
        from .pipelines import forward
        return forward(self)

    def __init__(self, dtype, hdim: int, hdim_v: Optional[int] = None,
                 variant: Variant = Variant(), schedule: Optional[tuple] = None):
        self.dtype = dtype
        self.hdim, self.hdim_v = hdim, hdim if hdim_v is None else hdim_v
        if (self.hdim, self.hdim_v) not in FWD_SCHEDULES and schedule is None:
            raise ValueError(f"no blackwell schedule for hdim {(self.hdim, self.hdim_v)}; "
                             f"have {sorted(FWD_SCHEDULES)}")
        set_kernel_switches(self, variant)
        if TILE_M % self.pack_gqa:
            raise ValueError(f"pack_gqa {self.pack_gqa} must divide the {TILE_M}-row Q tile")
        for name, on in (("dropout", self.dropout),
                         ("split_kv", self.split_kv), ("paged K/V", self.page_size > 0),
                         ("append", self.append)):
            if on:
                raise ValueError(f"the blackwell forward has no {name} yet")
        schedule = FwdSchedule(*(schedule or FWD_SCHEDULES[(self.hdim, self.hdim_v)]))
        if schedule.q_tiles not in (1, Q_STAGES):
            raise ValueError(f"q_tiles {schedule.q_tiles}: one Q tile per CTA, or two")
        self.tile_m, self.tile_n = TILE_M, schedule.tile_n
        self.k_stages, self.v_stages = schedule.k_stages, schedule.v_stages
        self.persistent = schedule.persistent
        self.q_tiles = schedule.q_tiles
        self.schedule = schedule
        self.tmem = tmem_plan(self.tile_n, self.hdim_v, self.q_tiles)
        self.block_sparse = getattr(self.mods, "sparse", False)
        self.lpt = self.causal or self.has_window_right or self.block_sparse
        self.num_threads = 512

    @property
    def ex2_emulation_fraction(self) -> float:
        return self.ex2_per16 / 16

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.hdim, self.hdim_v, self.schedule)

    # ---------------------------------------------------------------- host side

    @cute.jit
    def __call__(self, args: FwdArgs, stream: cuda.CUstream):
        """`args`: a `kernel_args.FwdArgs` (its docstring gives the layouts)."""
        vec = 128 // self.dtype.width
        mQ, mK, mV, mO = (assume_aligned_strides(t, vec) for t in (args.q, args.k, args.v,
                                                                   args.out))
        mLSE = args.lse
        if cutlass.const_expr(self.pack_gqa > 1):
            # A K/V head's query heads folded into the rows (`layouts.pack_heads`): a Q tile
            # is (pack heads) x (128 / pack queries), one TMA box.
            rows, heads = 1 - self.varlen, 2 - self.varlen
            mQ, mO = (pack_heads(t, rows, heads, self.pack_gqa) for t in (mQ, mO))
            mLSE = pack_heads(mLSE, heads, rows, self.pack_gqa)
        mma_qk, mma_pv = self._tiled_mmas()
        sQ_layout, sK_layout, sV_layout, p_layout = self._smem_layouts(mma_qk, mma_pv)
        rows_first = ROWS_FIRST[self.varlen][0]
        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_q, tQ = cute.nvgpu.make_tiled_tma_atom_A(
            op, permute(mQ, rows_first), cute.select(sQ_layout, mode=[0, 1, 2]),
            self._qk_tiler, mma_qk)
        tma_k, tK = cute.nvgpu.make_tiled_tma_atom_B(
            op, permute(mK, rows_first), cute.select(sK_layout, mode=[0, 1, 2]),
            self._qk_tiler, mma_qk)
        tma_v, tV = cute.nvgpu.make_tiled_tma_atom_B(
            op, permute(mV, COLS_FIRST[self.varlen][0]), cute.select(sV_layout, mode=[0, 1, 2]),
            self._pv_tiler, mma_pv)
        SharedStorage = self._shared_storage(sQ_layout, sK_layout, sV_layout)
        if cutlass.const_expr(SharedStorage.size_in_bytes() != self.smem_bytes
                              or self.smem_bytes + STATIC_SMEM > SMEM_CAPACITY):
            raise ValueError(f"shared memory: {SharedStorage.size_in_bytes()} B (estimated "
                             f"{self.smem_bytes}) + {STATIC_SMEM} static, capacity "
                             f"{SMEM_CAPACITY}")
        tx_bytes = tuple(cute.size_in_bytes(self.dtype, cute.select(layout, mode=[0, 1, 2]))
                         for layout in (sQ_layout, sK_layout, sV_layout))
        order = self._tile_order(mQ, mK, args.max_seqlen_q, args.cu_seqlens_q)
        grid = launch_grid(order.num_tiles, self.persistent, num_sms(DEFAULT_NUM_SMS),
                           imin=cutlass.min)
        scale_log2, mod_scale = fold_scores(self.score_mod, args.softmax_scale, args.softcap)
        self.kernel(
            tma_q, tQ, tma_k, tK, tma_v, tV, mO, mLSE, scale_log2, mod_scale,
            args.window_left, args.window_right,
            args.max_seqlen_q if cutlass.const_expr(self.varlen) else None,
            (args.cu_seqlens_q, args.cu_seqlens_k), (args.seqused_q, args.seqused_k),
            order.num_m_blocks, order.section, sQ_layout, sK_layout, sV_layout, p_layout,
            mma_qk, mma_pv, SharedStorage, tx_bytes, aux_tensors(self, args),
            block_mask_tensors(self, args),
        ).launch(grid=(grid, 1, 1), block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    @property
    def _qk_tiler(self) -> tuple:
        return (self.tile_m, self.tile_n, self.hdim)

    @property
    def _pv_tiler(self) -> tuple:
        return (self.tile_m, self.hdim_v, self.tile_n)

    def _tiled_mmas(self):
        """S = Q Kᵀ from shared memory (both K-major); O += P V with P from TMEM (K-major, as
        tcgen05 requires for a TMEM operand) and V MN-major (head dim contiguous)."""
        mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            tcgen05.CtaGroup.ONE, self._qk_tiler[:2])
        mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            tcgen05.CtaGroup.ONE, self._pv_tiler[:2], tcgen05.OperandSource.TMEM)
        return mma_qk, mma_pv

    def _smem_layouts(self, mma_qk, mma_pv):
        """Q (its tiles), the K and V rings, and P's TMEM operand layout (one stage)."""
        sQ = sm100_utils.make_smem_layout_a(mma_qk, self._qk_tiler, self.dtype, self.q_tiles)
        sK = sm100_utils.make_smem_layout_b(mma_qk, self._qk_tiler, self.dtype, self.k_stages)
        sV = sm100_utils.make_smem_layout_b(mma_pv, self._pv_tiler, self.dtype, self.v_stages)
        p = sm100_utils.make_smem_layout_a(mma_pv, self._pv_tiler, self.dtype, 1)
        return sQ, sK, sV, p

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout):
        qt, k2, v2 = self.q_tiles, 2 * self.k_stages, 2 * self.v_stages

        @cute.struct
        class SharedStorage:
            q_bars: cute.struct.MemRange[cutlass.Int64, 2 * qt]
            k_bars: cute.struct.MemRange[cutlass.Int64, k2]
            v_bars: cute.struct.MemRange[cutlass.Int64, v2]
            s_full: cute.struct.MemRange[cutlass.Int64, _S_BUFFERS]
            p_ready: cute.struct.MemRange[cutlass.Int64, _S_BUFFERS]
            o_full: cute.struct.MemRange[cutlass.Int64, qt]
            stats_bars: cute.struct.MemRange[cutlass.Int64, 2 * qt]
            tmem_addr: Int32
            # Per Q tile and row: a block's factor, or at the tile's end l, then m.
            stats: cute.struct.Align[cute.struct.MemRange[Float32, qt * TILE_M], 16]
            sQ: smem_tile(self.dtype, sQ_layout)
            sK: smem_tile(self.dtype, sK_layout)
            sV: smem_tile(self.dtype, sV_layout)

        return SharedStorage

    def _tile_order(self, mQ, mK, max_seqlen_q, cu_seqlens_q) -> TileOrder:
        """(CTA tile, head, batch) numbering; causal and right windows heaviest first, in
        L2-sized sections of heads (`tile_order`)."""
        batch = SeqInfo.num_batches(mQ, cu_seqlens_q)
        section = Int32(1)
        if cutlass.const_expr(self.lpt):
            seqlen_k = mK.shape[0] // batch if cutlass.const_expr(self.varlen) else mK.shape[1]
            kv_bytes_per_key = (self.hdim + self.hdim_v) * self.dtype.width // 8
            section = pairs_per_section(seqlen_k, kv_bytes_per_key, imax=cutlass.max)
        return TileOrder(cute.ceil_div(max_seqlen_q * self.pack_gqa, self.q_tiles * self.tile_m),
                         mQ.shape[-2], batch, section, self.lpt, self.persistent)

    # ---------------------------------------------------------------- device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, tQ: cute.Tensor, tma_k: cute.CopyAtom, tK: cute.Tensor,
               tma_v: cute.CopyAtom, tV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               scale_log2: Float32, mod_scale: Float32, window_left: Int32, window_right: Int32,
               max_seqlen_q: Optional[Int32], cu_seqlens, seqused, num_m_blocks: Int32,
               section: Int32, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, p_layout: cute.ComposedLayout,
               mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, SharedStorage: cutlass.Constexpr,
               tx_bytes: cutlass.Constexpr, aux, block_mask):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == _LOAD_WARP:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        rings = self._rings(storage, tx_bytes)
        handshakes = Handshakes(storage, self.q_tiles)
        handshakes.init(warp_idx)
        stats = self._stats_pipes(storage)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # TMEM before the roles split, freed after they join: one exit frees it.
        tmem = TmemAllocator(storage.tmem_addr.ptr, barrier_for_retrieve=pipeline.NamedBarrier(
            barrier_id=_TMEM_ALLOC_BARRIER, num_threads=self.num_threads),
            allocator_warp_id=_MMA_WARP)
        if warp_idx == _MMA_WARP:
            tmem.allocate(self.tmem.columns)
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(Float32)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sStats = storage.stats.get_tensor(cute.make_layout((TILE_M, self.q_tiles)))
        tiles = Tiles(self, num_m_blocks, section, tQ, tK, cu_seqlens, seqused, window_left,
                      window_right, max_seqlen_q, block_mask)
        tmem_tensors = TmemTensors(self, mma_qk, mma_pv, p_layout, tmem_ptr)

        registers = ROLE_REGISTERS if cutlass.const_expr(self.q_tiles == 2) \
            else ROLE_REGISTERS_ONE_TILE
        if warp_idx < _SOFTMAX1_WARP:
            cute.arch.setmaxregister_increase(registers[0])
            self.softmax_role(tiles, 0, tmem_tensors, handshakes, stats[0], sStats, scale_log2,
                              mod_scale, aux)
        elif warp_idx < _CORRECTION_WARP:
            if cutlass.const_expr(self.q_tiles == 2):
                cute.arch.setmaxregister_increase(registers[1])
                self.softmax_role(tiles, 1, tmem_tensors, handshakes, stats[1], sStats,
                                  scale_log2, mod_scale, aux)
            else:
                cute.arch.setmaxregister_decrease(registers[1])
        elif warp_idx < _MMA_WARP:
            cute.arch.setmaxregister_decrease(registers[2])
            self.correction_role(tiles, tmem_tensors, handshakes, stats, sStats, mO, mLSE,
                                 (rings[2], sV, mma_pv))
        else:
            cute.arch.setmaxregister_decrease(registers[3])
            if warp_idx == _MMA_WARP:
                self.mma_role(tiles, rings, handshakes, tmem_tensors, sQ, sK, sV, mma_qk,
                              mma_pv)
            elif warp_idx == _LOAD_WARP:
                self.load_role(tiles, rings, tma_q, tQ, tma_k, tK, tma_v, tV, sQ, sK, sV,
                               mma_qk, mma_pv)

        cute.arch.sync_threads()
        if warp_idx == _MMA_WARP:
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr, self.tmem.columns)

    def _rings(self, storage, tx_bytes):
        """The Q, K and V TMA rings: the load warp produces (one elected arrive plus the TMA's
        bytes), the MMA warp consumes (its release is a tcgen05.commit: the stage frees when
        the MMAs that read it are done)."""
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        return tuple(pipeline.PipelineTmaUmma.create(
            num_stages=stages, producer_group=one, consumer_group=one, tx_count=tx,
            barrier_storage=bars.data_ptr(), defer_sync=True)
            for bars, stages, tx in ((storage.q_bars, self.q_tiles, tx_bytes[0]),
                                     (storage.k_bars, self.k_stages, tx_bytes[1]),
                                     (storage.v_bars, self.v_stages, tx_bytes[2])))

    def _stats_pipes(self, storage):
        """Softmax i → correction: a block's row factors, then the tile's l and m."""
        group = pipeline.CooperativeGroup(pipeline.Agent.Thread, TILE_M)
        bars = storage.stats_bars.data_ptr()
        return tuple(pipeline.PipelineAsync.create(
            num_stages=1, producer_group=group, consumer_group=group,
            barrier_storage=bars + 2 * i, defer_sync=True) for i in range(self.q_tiles))

    # ---------------------------------------------------------------- load warp

    @cute.jit
    def load_role(self, tiles, rings, tma_q, tQ, tma_k, tK, tma_v, tV, sQ, sK, sV, mma_qk,
                  mma_pv):
        producer = pipeline.PipelineUserType.Producer
        states = (pipeline.make_pipeline_state(producer, self.q_tiles),
                  pipeline.make_pipeline_state(producer, self.k_stages),
                  pipeline.make_pipeline_state(producer, self.v_stages))
        step = functools.partial(self.load_tile, tiles, rings, (tma_q, tma_k, tma_v),
                                 (tQ, tK, tV), (sQ, sK, sV), mma_qk.get_slice(0),
                                 mma_pv.get_slice(0))
        states = for_each_tile(tiles, self.persistent, step, states)
        # Every stage released (its MMAs' commits landed) before the CTA may exit.
        for pipe, state in zip(rings, states):
            pipe.producer_tail(state)

    @cute.jit
    def load_tile(self, tiles, rings, atoms, coords, smem, thr_qk, thr_pv, tile: Int32,
                  q_state, k_state, v_state):
        """One tile's TMA loads: its Q tiles, then K[n] and V[n] for each block, right to
        left."""
        pipe_q, pipe_k, pipe_v = rings
        tma_q, tma_k, tma_v = atoms
        tQ, tK, tV = coords
        sQ, sK, sV = smem
        m_block, head, head_kv, seq = tiles.at(tile)
        if tiles.in_bounds(m_block, seq):
            n_min, n_max = tiles.blocks(m_block, seq, head)
            gQ = cute.flat_divide(tiles.rows_view(seq, tQ, head, True), (self.tile_m, self.hdim))
            tQsQ, tQgQ = tma_partition(tma_q, sQ, thr_qk.partition_A(gQ), 3)
            gK = cute.flat_divide(tiles.rows_view(seq, tK, head_kv, False),
                                  (self.tile_n, self.hdim))
            tKsK, tKgK = tma_partition(tma_k, sK, thr_qk.partition_B(gK), 3)
            gV = cute.flat_divide(tiles.v_view(seq, tV, head_kv), (self.hdim_v, self.tile_n))
            tVsV, tVgV = tma_partition(tma_v, sV, thr_pv.partition_B(gV), 3)
            for i in cutlass.range_constexpr(self.q_tiles):
                pipe_q.producer_acquire(q_state)
                cute.copy(tma_q, tQgQ[None, self.q_tiles * m_block + i, 0],
                          tQsQ[None, q_state.index],
                          tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                q_state.advance()
            for n in cutlass.range(n_max - 1, n_min - 1, -1, unroll=1):
                pipe_k.producer_acquire(k_state)
                cute.copy(tma_k, tKgK[None, n, 0], tKsK[None, k_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(k_state))
                k_state.advance()
                pipe_v.producer_acquire(v_state)
                cute.copy(tma_v, tVgV[None, 0, n], tVsV[None, v_state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(v_state))
                v_state.advance()
        return q_state, k_state, v_state

    # ---------------------------------------------------------------- MMA warp

    @cute.jit
    def mma_role(self, tiles, rings, handshakes, tt, sQ, sK, sV, mma_qk, mma_pv):
        consumer = pipeline.PipelineUserType.Consumer
        thr_qk, thr_pv = mma_qk.get_slice(0), mma_pv.get_slice(0)
        frags = (thr_qk.make_fragment_A(sQ), thr_qk.make_fragment_B(sK),
                 thr_pv.make_fragment_B(sV))
        states = (pipeline.make_pipeline_state(consumer, self.q_tiles),
                  pipeline.make_pipeline_state(consumer, self.k_stages),
                  pipeline.make_pipeline_state(consumer, self.v_stages), Int32(0))
        step = functools.partial(self.mma_tile, tiles, rings, handshakes, tt, frags, mma_qk,
                                 mma_pv)
        for_each_tile(tiles, self.persistent, step, states)

    @cute.jit
    def mma_tile(self, tiles, rings, handshakes, tt, frags, mma_qk, mma_pv, tile: Int32,
                 q_state, k_state, v_state, p_phase: Int32):
        """One tile's MMAs: its Q tiles waited for, then the blocks' (`_mma_two_tiles`,
        `_mma_one_tile`)."""
        m_block, head, _, seq = tiles.at(tile)
        if tiles.in_bounds(m_block, seq):
            n_min, n_max = tiles.blocks(m_block, seq, head)
            q_index = q_state.index
            for i in cutlass.range_constexpr(self.q_tiles):
                rings[0].consumer_wait(q_state)
                q_state.advance()
            if n_max > n_min:
                blocks = (rings, handshakes, tt, frags, mma_qk, mma_pv, n_min, n_max, q_index)
                if cutlass.const_expr(self.q_tiles == 2):
                    k_state, v_state, p_phase = self._mma_two_tiles(*blocks, k_state, v_state,
                                                                    p_phase)
                else:
                    k_state, v_state, p_phase = self._mma_one_tile(*blocks, k_state, v_state,
                                                                   p_phase)
            else:
                self._release_q(rings[0], q_index)
        return q_state, k_state, v_state, p_phase

    @cute.jit
    def _mma_two_tiles(self, rings, handshakes, tt, frags, mma_qk, mma_pv, n_min: Int32,
                       n_max: Int32, q_index: Int32, k_state, v_state, p_phase: Int32):
        """QK0(0), QK1(0); per further block PV0, QK0, PV1, QK1; the last PVs (`BlackwellFwd`
        docstring). p_ready's phase is one bit for both tiles."""
        pipe_q, pipe_k, pipe_v = rings
        tSrQ, tSrK, tOrV = frags
        pipe_k.consumer_wait(k_state)
        for i in cutlass.range_constexpr(Q_STAGES):
            self._gemm_qk(mma_qk, tt.s[i], tSrQ, q_index + i, tSrK, k_state.index)
            handshakes.commit(handshakes.s_full, i)
        pipe_k.consumer_release(k_state)
        k_state.advance()
        for n in cutlass.range(n_max - 2, n_min - 1, -1, unroll=1):
            pipe_v.consumer_wait(v_state)
            pipe_k.consumer_wait(k_state)
            for i in cutlass.range_constexpr(Q_STAGES):
                handshakes.wait(handshakes.p_ready, i, p_phase)
                self._gemm_pv(mma_pv, tt.o[i], tt.p_operand[i], tOrV, v_state.index,
                              n < n_max - 2)
                self._gemm_qk(mma_qk, tt.s[i], tSrQ, q_index + i, tSrK, k_state.index)
                handshakes.commit(handshakes.s_full, i)
            p_phase = p_phase ^ 1
            pipe_v.consumer_release(v_state)
            v_state.advance()
            pipe_k.consumer_release(k_state)
            k_state.advance()
        # Every QKᵀ is issued: the Q tiles free (when those MMAs are done) before the last
        # PVs, so the next tile's Q loads under them.
        self._release_q(pipe_q, q_index)
        pipe_v.consumer_wait(v_state)
        for i in cutlass.range_constexpr(Q_STAGES):
            handshakes.wait(handshakes.p_ready, i, p_phase)
            self._gemm_pv(mma_pv, tt.o[i], tt.p_operand[i], tOrV, v_state.index,
                          n_max - n_min > 1)
            handshakes.commit(handshakes.o_full, i)
        p_phase = p_phase ^ 1
        pipe_v.consumer_release(v_state)
        v_state.advance()
        return k_state, v_state, p_phase

    @cute.jit
    def _mma_one_tile(self, rings, handshakes, tt, frags, mma_qk, mma_pv, n_min: Int32,
                      n_max: Int32, q_index: Int32, k_state, v_state, p_phase: Int32):
        """One Q tile, its blocks' S in two buffers in turn (`BlackwellFwd` docstring): QK(0)
        into buffer 0; then per block the next block's QKᵀ into the other buffer before this
        block's PV, so the tensor core computes S(j+1) while the softmax works on S(j), and
        the softmax of S(j+1) runs under PV(j). o_full is committed after every PV: the
        correction rescales O for block j once PV(j-1) is done. p_ready's phase is one bit
        per buffer."""
        pipe_q, pipe_k, pipe_v = rings
        tSrQ, tSrK, tOrV = frags
        pipe_k.consumer_wait(k_state)
        self._gemm_qk(mma_qk, tt.s[0], tSrQ, q_index, tSrK, k_state.index)
        handshakes.commit(handshakes.s_full, 0)
        pipe_k.consumer_release(k_state)
        k_state.advance()
        buf = Int32(0)
        for n in cutlass.range(n_max - 1, n_min, -1, unroll=1):
            pipe_k.consumer_wait(k_state)
            self._gemm_qk(mma_qk, tt.s_at(1 - buf), tSrQ, q_index, tSrK, k_state.index)
            handshakes.commit(handshakes.s_full, 1 - buf)
            pipe_k.consumer_release(k_state)
            k_state.advance()
            p_phase = self._pv_one_tile(handshakes, tt, mma_pv, tOrV, pipe_v, v_state, buf,
                                        p_phase, n < n_max - 1)
            v_state.advance()
            buf = 1 - buf
        self._release_q(pipe_q, q_index)
        p_phase = self._pv_one_tile(handshakes, tt, mma_pv, tOrV, pipe_v, v_state, buf,
                                    p_phase, n_max - n_min > 1)
        v_state.advance()
        return k_state, v_state, p_phase

    @cute.jit
    def _pv_one_tile(self, handshakes, tt, mma_pv, tOrV, pipe_v, v_state, buf: Int32,
                     p_phase: Int32, accumulate) -> Int32:
        """O += P(buffer `buf`) V once P is written and O rescaled; o_full and the V stage's
        release follow it. Returns p_ready's phase bits (the caller advances `v_state`)."""
        pipe_v.consumer_wait(v_state)
        handshakes.wait(handshakes.p_ready, buf, (p_phase >> buf) & 1)
        self._gemm_pv(mma_pv, tt.o[0], tt.p_operand_at(buf), tOrV, v_state.index, accumulate)
        handshakes.commit(handshakes.o_full, 0)
        pipe_v.consumer_release(v_state)
        return p_phase ^ (1 << buf)

    @cute.jit
    def _release_q(self, pipe_q, q_index: Int32):
        for i in cutlass.range_constexpr(self.q_tiles):
            pipe_q.consumer_release(pipeline.PipelineState(
                self.q_tiles, Int32(0), (q_index + i) % self.q_tiles, Int32(0)))

    @cute.jit
    def _gemm_qk(self, mma, acc, tSrQ, q_index, tSrK, k_index):
        # A fresh atom per call: its accumulate field is set where the MMAs are issued, never
        # carried out of the loop or branch that set it.
        atom = cute.make_mma_atom(mma.op)
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            atom.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(atom, acc, tSrQ[None, None, k, q_index], tSrK[None, None, k, k_index], acc)

    @cute.jit
    def _gemm_pv(self, mma, acc, tOrP, tOrV, v_index, accumulate):
        atom = cute.make_mma_atom(mma.op)
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            atom.set(tcgen05.Field.ACCUMULATE, cutlass.Boolean(accumulate) | (k != 0))
            cute.gemm(atom, acc, tOrP[None, None, k], tOrV[None, None, k, v_index], acc)

    # ---------------------------------------------------------------- softmax warpgroups

    @cute.jit
    def softmax_role(self, tiles, stage: cutlass.Constexpr[int], tt, handshakes, stats, sStats,
                     scale_log2: Float32, mod_scale: Float32, aux):
        row = cute.arch.thread_idx()[0] % TILE_M
        load, store = tt.s_load(stage, row), tt.p_store(stage, row)
        rS_frag = cute.make_rmem_tensor(load[2], Float32)
        chunks = tt.s_chunks(stage, row) if cutlass.const_expr(self.mods is not None) else None
        states = (pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1), Int32(0))
        step = functools.partial(self.softmax_tile, tiles, stage, handshakes, stats, sStats,
                                 load, store, rS_frag, row, scale_log2, mod_scale,
                                 (aux, chunks))
        stats_state, _ = for_each_tile(tiles, self.persistent, step, states)
        stats.producer_tail(stats_state)

    @cute.jit
    def softmax_tile(self, tiles, stage: cutlass.Constexpr[int], handshakes, stats, sStats,
                     load, store, rS_frag, row: Int32, scale_log2: Float32, mod_scale: Float32,
                     mods, tile: Int32, stats_state, s_phase: Int32):
        """Softmax of Q tile `stage` over one tile's blocks (`BlackwellFwd` docstring). With
        one Q tile its blocks alternate between the two S buffers, from buffer 0 at each
        tile, s_full's phase one bit per buffer."""
        # The thread's row: 32x32b loads give lane `row`'s columns in order.
        rS = cute.make_tensor(rS_frag.iterator, cute.make_layout((1, self.tile_n)))
        coord = cute.domain_offset((row, 0), cute.make_identity_tensor((1, self.tile_n)))
        m_block, head, _, seq = tiles.at(tile)
        if tiles.in_bounds(m_block, seq):
            n_min, n_max = tiles.blocks(m_block, seq, head)
            q_block = self.q_tiles * m_block + stage
            mask = tiles.mask(seq)
            scores = tile_scores(self, mod_scale, mask, mods[0], seq.batch, head,
                                 tiles.block_states, seq)
            rng = mask.block_range(q_block)
            softmax = OnlineSoftmax(scale_log2, 1, 1, self.ex2_per16)
            softmax.reset()
            buf = Int32(0)
            for n in cutlass.range(n_max - 1, n_min - 1, -1, unroll=1):
                # A block mask's state of the tile: loaded once, before S is waited for.
                state = scores.tile_state(q_block, n)
                if cutlass.const_expr(self.q_tiles == 2):
                    handshakes.wait(handshakes.s_full, stage, s_phase)
                    s_phase = s_phase ^ 1
                else:
                    handshakes.wait(handshakes.s_full, buf, (s_phase >> buf) & 1)
                    s_phase = s_phase ^ (1 << buf)
                cols = buf * self.tile_n
                if cutlass.const_expr(self.mods is not None):
                    load_c, store_c, src, dst, regs = mods[1]
                    self._mods_in_tmem(scores, (load_c, store_c, self._at(src, cols),
                                                self._at(dst, cols), regs),
                                       row, q_block, n, rng, state)
                cute.copy(load[0], self._at(load[1], cols), rS_frag)
                if cutlass.const_expr(self.mods is None):
                    scores.prepare(rS, coord, q_block, n, rng)
                factor = softmax.update_max(rS, RESCALE_THRESHOLD)
                stats_state = self._hand_over(stats, stats_state, sStats, stage, row, factor[0])
                # With softcap, the pairs' aligned registers beside tanh's spill (D-BW-EX2).
                softmax.exp_and_sum(rS, factor, 0, True, self.score_mod is None, False)
                self._store_p(rS, (store[0], self._at(store[1], cols), store[2]))
                cute.arch.fence_view_async_tmem_store()
                if cutlass.const_expr(self.q_tiles == 2):
                    handshakes.arrive(handshakes.p_ready, stage)
                else:
                    handshakes.arrive(handshakes.p_ready, buf)
                    buf = 1 - buf
                # Off the path to the PV: the sum of P, once P is on its way.
                softmax.add_row_sums(rS, factor)
            stats_state = self._hand_over(stats, stats_state, sStats, stage, row,
                                          softmax.row_sum[0])
            stats_state = self._hand_over(stats, stats_state, sStats, stage, row,
                                          softmax.row_max[0])
        return stats_state, s_phase

    def _at(self, t: cute.Tensor, cols) -> cute.Tensor:
        """A view of S buffer 0 (or its P words) moved `cols` columns on: with one Q tile the
        buffer of the block at hand; with two, each softmax warpgroup's own (`cols` 0)."""
        if cutlass.const_expr(self.q_tiles == 2):
            return t
        return cute.make_tensor(t.iterator + cols, t.layout)

    @cute.jit
    def _mods_in_tmem(self, scores, chunks, row: Int32, q_block: Int32, n: Int32, rng,
                      state: Optional[Int32]):
        """The score seam with traced or FA4-form mods (`Scores.prepare`) on S_i's row in
        tensor memory, `_S_CHUNK` columns at a time, before the row is loaded whole: what
        the mods compute per column then lives beside a chunk, not beside the 128-column row
        (D-BW-MODS). `state`: the tile's block-mask state (`Scores.tile_state`; None
        without a block mask)."""
        load, store, src, dst, regs = chunks
        rC = cute.make_rmem_tensor(regs, Float32)
        for c in cutlass.range_constexpr(self.tile_n // _S_CHUNK):
            chunk = rC[None, None, c]
            cute.copy(load, src[None, None, c], chunk)
            view = cute.make_tensor(chunk.iterator, cute.make_layout((1, _S_CHUNK)))
            coord = cute.domain_offset((row, c * _S_CHUNK),
                                       cute.make_identity_tensor((1, _S_CHUNK)))
            scores.prepare(view, coord, q_block, n, rng, state=state)
            cute.copy(store, chunk, dst[None, None, c])
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def _hand_over(self, stats, state, sStats, stage: cutlass.Constexpr[int], row: Int32,
                   value: Float32):
        """Softmax → correction through shared memory, one value per row: a block's row
        factor, or at the tile's end its row sum, then its max."""
        stats.producer_acquire(state)
        sStats[row, stage] = value
        stats.producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def _store_p(self, rS: cute.Tensor, store):
        """P in 16-bit into its TMEM columns, chunk by chunk (two values per fp32 word)."""
        copy, dst, words_shape = store
        rW = cute.make_rmem_tensor(words_shape, Float32)
        for c in cutlass.range_constexpr(cute.size(dst, mode=[2])):
            chunk = rW[None, None, c]
            half = cute.make_tensor(cute.recast_ptr(chunk.iterator, dtype=self.dtype),
                                    cute.make_layout(2 * cute.size(chunk)))
            for j in cutlass.range_constexpr(2 * cute.size(chunk)):
                half[j] = rS[0, c * 2 * cute.size(chunk) + j].to(self.dtype)
            cute.copy(copy, chunk, dst[None, None, c])

    # ---------------------------------------------------------------- correction warpgroup

    @cute.jit
    def correction_role(self, tiles, tt, handshakes, stats, sStats, mO, mLSE, v_ring):
        row = cute.arch.thread_idx()[0] % TILE_M
        consumer = pipeline.PipelineUserType.Consumer
        states = (pipeline.make_pipeline_state(consumer, 1),
                  pipeline.make_pipeline_state(consumer, 1), Int32(0),
                  pipeline.make_pipeline_state(consumer, self.v_stages))
        o_chunks = tuple(tt.o_chunk(i, row) for i in range(self.q_tiles))
        pipe_v, sV, mma_pv = v_ring
        thr_pv = mma_pv.get_slice(0)
        v_tail = (pipe_v, sV, thr_pv.partition_B(
            cute.make_identity_tensor((self.hdim_v, self.tile_n))))
        step = functools.partial(self.correction_tile, tiles, handshakes, stats, sStats,
                                 o_chunks, row, mO, mLSE, v_tail)
        for_each_tile(tiles, self.persistent, step, states)

    @cute.jit
    def correction_tile(self, tiles, handshakes, stats, sStats, o_chunks, row: Int32, mO, mLSE,
                        v_tail, tile: Int32, state0, state1, o_phase: Int32, v_state):
        """Per block, each Q tile's O rescaled by its row factors; then O / l and the LSE
        (`_correct_one_tile` with one Q tile)."""
        m_block, head, _, seq = tiles.at(tile)
        if tiles.in_bounds(m_block, seq):
            n_min, n_max = tiles.blocks(m_block, seq, head)
            if cutlass.const_expr(self.varlen or self.has_seqused_k):
                if n_max > n_min:
                    self._clear_v_tail(v_tail, v_state, seq.seqlen_k - (n_max - 1) * self.tile_n,
                                       row)
                for _ in cutlass.range(n_max - n_min, unroll=1):
                    v_state.advance()
            if cutlass.const_expr(self.q_tiles == 1):
                state0, o_phase = self._correct_one_tile(handshakes, stats[0], state0, sStats,
                                                         o_chunks[0], row, n_min, n_max,
                                                         o_phase)
                state0, sum0 = self._take_stats(stats[0], state0, sStats, row, 0)
                state0, max0 = self._take_stats(stats[0], state0, sStats, row, 0)
                if n_max > n_min:
                    handshakes.wait(handshakes.o_full, 0, o_phase)
                    o_phase = o_phase ^ 1
                self._epilogue(o_chunks[0], sum0, max0, n_max > n_min, seq, head,
                               m_block * TILE_M + row, mO, mLSE)
            else:
                state0, state1, o_phase = self._correct_two_tiles(
                    handshakes, stats, sStats, o_chunks, row, mO, mLSE, m_block, head,
                    seq, n_min, n_max, state0, state1, o_phase)
            # The next tile's first PV overwrites O: its loads must have landed.
            cute.arch.fence_view_async_tmem_load()
        return state0, state1, o_phase, v_state

    @cute.jit
    def _correct_one_tile(self, handshakes, stats, state, sStats, chunks, row: Int32,
                          n_min: Int32, n_max: Int32, o_phase: Int32):
        """One Q tile's blocks: O rescaled for a block once the PV before it is done (o_full
        after every PV), then p_ready of the block's S buffer (in turn from buffer 0)."""
        buf = Int32(0)
        for n in cutlass.range(n_max - 1, n_min - 1, -1, unroll=1):
            state, factor = self._take_stats(stats, state, sStats, row, 0)
            if n < n_max - 1:
                handshakes.wait(handshakes.o_full, 0, o_phase)
                o_phase = o_phase ^ 1
                self._rescale(chunks, factor)
            handshakes.arrive(handshakes.p_ready, buf)
            buf = 1 - buf
        return state, o_phase

    @cute.jit
    def _correct_two_tiles(self, handshakes, stats, sStats, o_chunks, row: Int32, mO,
                           mLSE, m_block: Int32, head: Int32, seq, n_min: Int32, n_max: Int32,
                           state0, state1, o_phase: Int32):
        """Two Q tiles: per block each one's O rescaled (S_i(j) ready means PV_i(j-1) is
        done), then p_ready_i; at the end each O_i / l_i and its LSE."""
        for n in cutlass.range(n_max - 1, n_min - 1, -1, unroll=1):
            state0, factor0 = self._take_stats(stats[0], state0, sStats, row, 0)
            self._correct(o_chunks[0], factor0, n < n_max - 1, handshakes, 0)
            state1, factor1 = self._take_stats(stats[1], state1, sStats, row, 1)
            self._correct(o_chunks[1], factor1, n < n_max - 1, handshakes, 1)
        state0, sum0 = self._take_stats(stats[0], state0, sStats, row, 0)
        state0, max0 = self._take_stats(stats[0], state0, sStats, row, 0)
        state1, sum1 = self._take_stats(stats[1], state1, sStats, row, 1)
        state1, max1 = self._take_stats(stats[1], state1, sStats, row, 1)
        for i in cutlass.range_constexpr(Q_STAGES):
            if n_max > n_min:
                handshakes.wait(handshakes.o_full, i, o_phase)
            self._epilogue(o_chunks[i], (sum0, sum1)[i], (max0, max1)[i], n_max > n_min, seq,
                           head, (Q_STAGES * m_block + i) * TILE_M + row, mO, mLSE)
        if n_max > n_min:
            o_phase = o_phase ^ 1
        return state0, state1, o_phase

    @cute.jit
    def _clear_v_tail(self, v_tail, v_state, keys: Int32, tid: Int32):
        """Zero the rows past the sequence of the tile's first V block (its last keys) before
        any PV reads it: in varlen or a cache with seqused_k they hold the next sequence or
        unused rows, possibly NaN, and 0 x NaN is NaN. The PVs wait for this warpgroup's
        p_ready arrival, which follows the fence."""
        pipe_v, tVsV, tVcV = v_tail
        if keys < self.tile_n:
            pipe_v.consumer_wait(v_state)
            stage = tVsV[None, None, None, v_state.index]
            for i in cutlass.range(tid, cute.size(tVcV), TILE_M, unroll=1):
                if tVcV[i][1] >= keys:
                    stage[i] = stage.element_type(0)
            cute.arch.fence_view_async_shared()

    @cute.jit
    def _take_stats(self, stats, state, sStats, row: Int32, i: cutlass.Constexpr[int]):
        """(state, value): softmax i's hand-over for this thread's row."""
        stats.consumer_wait(state)
        value = sStats[row, i]
        stats.consumer_release(state)
        state.advance()
        return state, value

    @cute.jit
    def _correct(self, chunks, factor: Float32, rescale, handshakes, i: cutlass.Constexpr[int]):
        """O_i rescaled for a block that is not the tile's first; then PV_i may run."""
        if rescale:
            self._rescale(chunks, factor)
        handshakes.arrive(handshakes.p_ready, i)

    @cute.jit
    def _rescale(self, chunks, factor: Float32):
        """O_i's row times `factor` in TMEM, skipped where no row of the warp moved its max."""
        load, store, src, dst, regs = chunks
        if cute.arch.vote_ballot_sync(factor != Float32(1.0)) != 0:
            rO = cute.make_rmem_tensor(regs, Float32)
            for c in cutlass.range_constexpr(self.hdim_v // _O_CHUNK):
                cute.copy(load, src[None, None, c], rO[None, None, c])
                rO[None, None, c].store(rO[None, None, c].load() * factor)
                cute.copy(store, rO[None, None, c], dst[None, None, c])
            cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def _epilogue(self, chunks, row_sum: Float32, row_max: Float32, has_blocks, seq, head,
                  q_row: Int32, mO, mLSE):
        """O_i's row / l into the output (0 for a row that saw no key), and its LSE (`row_max`
        is the softmax's scaled max, `OnlineSoftmax`)."""
        load, _, src, _, regs = chunks
        empty = row_sum == Float32(0.0)
        scale = Float32(0.0) if empty else cute.arch.rcp_approx(row_sum)
        in_seq = q_row < seq.rows_q
        gO = seq.q_view(mO, head)
        rO = cute.make_rmem_tensor(regs, Float32)
        for c in cutlass.range_constexpr(self.hdim_v // _O_CHUNK):
            chunk = rO[None, None, c]
            chunk.fill(0.0)
            if has_blocks:
                cute.copy(load, src[None, None, c], chunk)
            out = cute.make_rmem_tensor(cute.make_layout(_O_CHUNK), mO.element_type)
            out.store((chunk.load() * scale).to(mO.element_type))
            if in_seq:
                cute.autovec_copy(out, cute.local_tile(gO, (1, _O_CHUNK), (q_row, c))[0, None])
        if in_seq:
            lse_log2 = row_max + cute.math.log2(row_sum, fastmath=True)
            seq.lse_view(mLSE, head)[q_row] = -Float32.inf if empty else lse_log2 * Float32(LN_2)


class Handshakes(DslState):
    """The raw mbarriers between the MMA warp and the softmax / correction warpgroups
    (`BlackwellFwd` docstring): per S buffer s_full (count 1, a tcgen05.commit) and p_ready
    (128 softmax + 128 correction threads); per Q tile o_full (count 1). Phases are carried
    by their waiters; `i` may be a run-time buffer index."""

    def __init__(self, storage, q_tiles: int):
        self.s_full = storage.s_full.data_ptr()
        self.p_ready = storage.p_ready.data_ptr()
        self.o_full = storage.o_full.data_ptr()
        self.q_tiles = q_tiles

    @cute.jit
    def init(self, warp_idx: Int32):
        if warp_idx == 0:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(_S_BUFFERS):
                    cute.arch.mbarrier_init(self.s_full + i, 1)
                    cute.arch.mbarrier_init(self.p_ready + i, 2 * TILE_M)
                for i in cutlass.range_constexpr(self.q_tiles):
                    cute.arch.mbarrier_init(self.o_full + i, 1)

    def wait(self, bars, i: int, phase: Int32):
        cute.arch.mbarrier_wait(bars + i, phase)

    def arrive(self, bars, i: int):
        cute.arch.mbarrier_arrive(bars + i)

    def commit(self, bars, i: int):
        """Arrive on `bars[i]` once the MMAs this thread issued so far are done."""
        with cute.arch.elect_one():
            tcgen05.commit(bars + i)


class TmemTensors(DslState):
    """S_i, O_i and P_i in tensor memory (`config.tmem_plan`), as the MMAs see them and as
    one thread's row moves through registers; `s_at` and `p_operand_at` give the S buffer
    of a run-time index (one Q tile, its blocks in turn)."""

    def __init__(self, cfg: BlackwellFwd, mma_qk, mma_pv, p_layout, tmem_ptr):
        self.cfg = cfg
        thr_qk, thr_pv = mma_qk.get_slice(0), mma_pv.get_slice(0)
        s_layout = thr_qk.make_fragment_C(thr_qk.partition_shape_C((cfg.tile_m, cfg.tile_n))).layout
        o_layout = thr_pv.make_fragment_C(thr_pv.partition_shape_C((cfg.tile_m, cfg.hdim_v))).layout
        plan = cfg.tmem
        self.s_coords = thr_qk.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        self.o_coords = thr_pv.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.hdim_v)))
        self.s = tuple(cute.make_tensor(tmem_ptr + plan.s[i], s_layout)
                       for i in range(_S_BUFFERS))
        self.o = tuple(cute.make_tensor(tmem_ptr + plan.o[i], o_layout)
                       for i in range(cfg.q_tiles))
        p_frag = thr_pv.make_fragment_A(cute.make_tensor(self.s[0].iterator, p_layout.outer))
        p_frag = p_frag[None, None, None, 0]
        self.p_operand = tuple(
            cute.make_tensor(cute.recast_ptr(tmem_ptr + plan.p[i], dtype=p_frag.dtype),
                             p_frag.layout) for i in range(_S_BUFFERS))
        self.p_words = tuple(cute.make_tensor(
            tmem_ptr + plan.p[i], cute.composition(s_layout, cute.make_layout(
                (cfg.tile_m, cfg.tile_n // 2)))) for i in range(_S_BUFFERS))

    def s_at(self, buf: Int32) -> cute.Tensor:
        """S buffer `buf` (0 or 1) as the QKᵀ MMA's accumulator."""
        s = self.s[0]
        return cute.make_tensor(s.iterator + buf * self.cfg.tile_n, s.layout)

    def p_operand_at(self, buf: Int32) -> cute.Tensor:
        """P of S buffer `buf` as the PV MMA's A operand: the address moves in fp32 columns
        before the 16-bit view is taken."""
        p = self.p_operand[0]
        words = cute.recast_ptr(p.iterator, dtype=Float32)
        return cute.make_tensor(cute.recast_ptr(words + buf * self.cfg.tile_n, dtype=p.dtype),
                                p.layout)

    def s_load(self, i: int, row: Int32):
        """(tiled copy, S_i's row `row` partitioned): 32x32b loads, a thread per lane."""
        atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        copy = tcgen05.make_tmem_copy(atom, self.s[i])
        thr = copy.get_slice(row)
        return copy, thr.partition_S(self.s[i]), thr.partition_D(self.s_coords).shape

    def s_chunks(self, i: int, row: Int32):
        """(load, store, source, destination, registers) of S_i's row by chunks of `_S_CHUNK`
        columns, read and written in place."""
        s, cfg = self.s[i], self.cfg
        chunk = cute.make_layout((cfg.tile_m, _S_CHUNK))
        view = cute.make_tensor(s.iterator, cute.composition(s.layout, chunk))
        ld = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(_S_CHUNK)),
                                 Float32)
        st = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(_S_CHUNK)),
                                 Float32)
        load, store = tcgen05.make_tmem_copy(ld, view), tcgen05.make_tmem_copy(st, view)
        split = cute.make_layout((cfg.tile_m, (_S_CHUNK, cfg.tile_n // _S_CHUNK)))
        tiled = cute.make_tensor(s.iterator, cute.composition(s.layout, split))
        coords = cute.make_tensor(self.s_coords.iterator,
                                  cute.composition(self.s_coords.layout, split))
        regs = load.get_slice(row).partition_D(coords).shape
        return (load, store, load.get_slice(row).partition_S(tiled),
                store.get_slice(row).partition_D(tiled), regs)

    def p_store(self, i: int, row: Int32):
        """(tiled copy, P_i's words for row `row` by chunk of `_P_CHUNK` columns)."""
        atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(_P_CHUNK)),
                                   Float32)
        copy = tcgen05.make_tmem_copy(atom, self.p_words[i])
        thr = copy.get_slice(row)
        coords = cute.make_tensor(self.s_coords.iterator, cute.composition(
            self.s_coords.layout, cute.make_layout((self.cfg.tile_m, self.cfg.tile_n // 2))))
        return copy, thr.partition_D(self.p_words[i]), thr.partition_S(coords).shape

    def o_chunk(self, i: int, row: Int32):
        """(load, store, source, destination) of O_i's row by chunks of `_O_CHUNK` columns."""
        o = self.o[i]
        chunk = cute.make_layout((self.cfg.tile_m, _O_CHUNK))
        view = cute.make_tensor(o.iterator, cute.composition(o.layout, chunk))
        ld = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(_O_CHUNK)),
                                 Float32)
        st = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(_O_CHUNK)),
                                 Float32)
        load = tcgen05.make_tmem_copy(ld, view)
        store = tcgen05.make_tmem_copy(st, view)
        tiled = cute.make_tensor(o.iterator, cute.composition(
            o.layout, cute.make_layout((self.cfg.tile_m, (_O_CHUNK, self.cfg.hdim_v // _O_CHUNK)))))
        coords = cute.make_tensor(self.o_coords.iterator, cute.composition(
            self.o_coords.layout, cute.make_layout(
                (self.cfg.tile_m, (_O_CHUNK, self.cfg.hdim_v // _O_CHUNK)))))
        regs = load.get_slice(row).partition_D(coords).shape
        return (load, store, load.get_slice(row).partition_S(tiled),
                store.get_slice(row).partition_D(tiled), regs)


class Tiles(DslState):
    """A CTA's tiles: number → (m_block of 256 rows, head, K/V head, `SeqInfo`), the blocks
    each visits, and the mask of its Q tiles."""

    def __init__(self, cfg: BlackwellFwd, num_m_blocks: Int32, section: Int32, tQ, tK,
                 cu_seqlens, seqused, window_left: Int32, window_right: Int32, max_seqlen_q,
                 block_mask=None):
        self.cfg = cfg
        # A block mask's states and ranges per 128-row Q tile (`FwdArgs.block_states`).
        self.block_states, self.block_ranges = block_mask_parts(block_mask)
        # TMA coordinates: (s, d, h, b), varlen (t, d, h).
        batches = cu_seqlens[0].shape[0] - 1 if cutlass.const_expr(cfg.varlen) else tQ.shape[3]
        self.order = TileOrder(num_m_blocks, tQ.shape[2], batches, section, cfg.lpt,
                               cfg.persistent)
        # Packed, a tile's head is its K/V head and Q's row mode is (pack, seqlen).
        self.qheads_per_kvhead = 1 if cfg.pack_gqa > 1 else tQ.shape[2] // tK.shape[2]
        self.seqlen_q = tQ.shape[0][1] if cutlass.const_expr(cfg.pack_gqa > 1) else tQ.shape[0]
        self.seqlen_k = tK.shape[0]
        self.cu_q, self.cu_k = cu_seqlens
        self.used_q, self.used_k = seqused
        self.win_left = window_left if cutlass.const_expr(cfg.has_window_left) else None
        self.win_right = window_right if cutlass.const_expr(cfg.has_window_right) else None
        self.max_seqlen_q = max_seqlen_q

    @property
    def num_numbers(self):
        """The tile numbers the grid walks (`for_each_tile`)."""
        return self.order.num_numbers(cute.arch.grid_dim()[0], imin=cutlass.min,
                                      imax=cutlass.max)

    def at(self, tile: Int32):
        m_block, head, batch = self.order.coords(tile, cute.arch.grid_dim()[0],
                                                 imin=cutlass.min, imax=cutlass.max)
        seq = SeqInfo(batch, self.seqlen_q, self.seqlen_k, self.cu_q, self.cu_k, self.used_q,
                      self.used_k, self.cfg.pack_gqa, max_seqlen_q=self.max_seqlen_q)
        return m_block, head, head // self.qheads_per_kvhead, seq

    def in_bounds(self, m_block: Int32, seq: SeqInfo):
        return m_block * self.cfg.q_tiles * TILE_M < seq.rows_q

    def blocks(self, m_block: Int32, seq: SeqInfo, head: Int32):
        """(n_min, n_max): the K/V blocks the CTA's tile visits, the same for every role;
        with a block mask, those between the first and the last non-empty tile of either Q
        tile (each masks the tiles empty for it by their state, `Scores.sparse_mods`)."""
        rng = block_range(m_block, self.cfg.q_tiles * TILE_M, self.cfg.tile_n, seq.seqlen_q,
                          seq.seqlen_k, self.cfg.causal, self.win_left, self.win_right,
                          self.cfg.pack_gqa, imin=cutlass.min, imax=cutlass.max)
        lo, hi = rng.n_block_min, rng.n_block_max
        if cutlass.const_expr(self.cfg.block_sparse):
            lo, hi = narrow_pair(lo, hi, *self._sparse_span(m_block, seq.batch, head),
                                 imin=cutlass.min, imax=cutlass.max)
        return lo, hi

    def _sparse_span(self, m_block: Int32, batch: Int32, head: Int32):
        """[start, end) over both Q tiles' ranges of non-empty tiles, an empty range (start
        >= end) left out (the launch pads the query tiles to whole CTA tiles, empty:
        `launch.SparseTiles`)."""
        start, end = Int32(2 ** 30), Int32(0)
        for stage in range(self.cfg.q_tiles):
            lo, hi = block_ranges(self.cfg, self.block_ranges, batch, head,
                                  self.cfg.q_tiles * m_block + stage)
            start = cutlass.select_(hi > lo, cutlass.min(start, lo), start)
            end = cutlass.select_(hi > lo, cutlass.max(end, hi), end)
        return start, end

    def mask(self, seq: SeqInfo) -> AttentionMask:
        return AttentionMask(TILE_M, self.cfg.tile_n, seq.seqlen_q, seq.seqlen_k, self.cfg.causal,
                             self.win_left, self.win_right, self.cfg.pack_gqa)

    def rows_view(self, seq: SeqInfo, t: cute.Tensor, head, is_q: bool):
        """(seqlen, d) of Q's (`is_q`) or K's TMA coordinates for one head."""
        offset = seq.offset_q * self.cfg.pack_gqa if is_q else seq.offset_k
        if cutlass.const_expr(self.cfg.varlen):
            return cute.domain_offset((offset, 0), t[None, None, head])
        return t[None, None, head, seq.batch]

    def v_view(self, seq: SeqInfo, tV: cute.Tensor, head_kv):
        """(hdim_v, seqlen_k) of V's TMA coordinates for one K/V head (head dim first)."""
        if cutlass.const_expr(self.cfg.varlen):
            return cute.domain_offset((0, seq.offset_k), tV[None, None, head_kv])
        return tV[None, None, head_kv, seq.batch]
