"""FlashAttention backward on sm100a (Blackwell): tcgen05 MMAs with Sᵀ, dPᵀ, dV, dK and dQ in
tensor memory, recomputed from the LSE, a K/V tile per cluster: one CTA at hdim 64, from 128
up a pair of CTAs whose MMAs (cta_group::2) span 2 x 128 keys (2 x 64 at hdim 256) and which
hand each other the rows of dS the dQ MMA needs.

Compile-verified only: it cross-compiles for sm_100a and its SASS is checked on the CPU
(`tests/test_blackwell_bwd.py`), its design by CPU models (`tests/test_blackwell_bwd_model.py`);
it has not run on Blackwell hardware.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import TmemAllocator

from flash_cute.arch.sm90plus.tma import COLS_FIRST, ROWS_FIRST, permute, smem_tile, tma_partition
from flash_cute.blocks.bwd import pass_turn
from flash_cute.blocks.dsl_state import DslState
from flash_cute.blocks.layouts import assume_aligned_strides
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

from . import pair
from .config import (
    BWD_ROLE_REGISTERS,
    BWD_SCHEDULES,
    RING_STAGE_BARRIERS,
    SMEM_CAPACITY,
    STATIC_SMEM,
    BwdSchedule,
    acc_columns,
    bwd_smem_bytes,
    bwd_tmem_plan,
    bwd_tmem_waits,
    chunk_of,
    compute_query,
    compute_thread,
    dq_turn_of_pair,
    dq_turn_pending,
    ds_words_first,
    folds,
    pair_exchange_first,
    pair_kv_first,
    pair_q_first,
    query_owner,
    shares_transposed,
    stats_entry,
    stats_slot,
    wg_query_columns,
)

# Warp roles (`BlackwellBwd` docstring).
_COMPUTE_WARP = 4  # compute w: warps 4 + 4w .. 7 + 4w
_MMA_WARP = 12
_LOAD_WARP = 13
_RELAY_WARP = 14
_TAIL_WARP = 15
# Named barriers: TMEM address, each compute warpgroup's LSE₂/Δ rows, the reduce warps.
_TMEM_ALLOC_BARRIER = 1
_STATS_BARRIER = 2  # and 3
_XCHG_BARRIER = 4  # and 5
_REDUCE_BARRIER = 6
# Compute 0's loads of Sᵀ before compute 1's stores of P words (`_in_order`).
_S_ORDER_BARRIER = 7
# Columns of dK / dV a compute thread moves from TMEM at once in the epilogue, and of dPᵀ
# per pass of dS (registers: P's 64 columns stay beside one chunk).
_EPI_CHUNK = 16
_DS_CHUNK = 8
_LANE = 1 << 16  # a TMEM address's lane step
_MMA_NAMES = ("s", "dp", "dv", "dk", "dq")


class BlackwellBwd:
    """Backward main kernel: dQaccum += dS K · (the postprocess scales), dK = dSᵀ Q · scale,
    dV = Pᵀ dO, over (K/V tile of cta_group x 128 keys, 2 x 64 at hdim 256; query head;
    batch); P and dS are recomputed from LSE₂ and Δ (`bwd_prep`).

    | warps  | warpgroup | registers | role                                                 |
    |--------|-----------|-----------|------------------------------------------------------|
    | 0..3   | 0         | 88        | dQ reduce: dQ from TMEM, fp32 atomics into dQaccum   |
    |        |           |           | (deterministic: in the query tile's turn)            |
    | 4..7   | 1         | 160       | compute 0: query columns 0..63 of Sᵀ and dPᵀ, one key |
    |        |           |           | a thread: P, dS to TMEM (hdim 256: to shared memory, |
    |        |           |           | columns 0..31 and 64..95, half a key a thread), dS to |
    |        |           |           | shared memory; then dV and dK's first half out       |
    | 8..11  | 2         | 160       | compute 1: query columns 64..127 (hdim 256: 32..63,   |
    |        |           |           | 96..127), and the second half                        |
    | 12     | 3         | 104       | MMA (the leader CTA only): every tcgen05 MMA; TMEM   |
    | 13     | 3         | 104       | load: TMA of K, V (and Kᵀ) once, Q, dO (and Qᵀ, dOᵀ) |
    |        |           |           | per query tile                                       |
    | 14     | 3         | 104       | relay (the pair's CTA 1): its dS complete → leader   |
    | 15     | 3         | 104       | tail (varlen, seqused): each stage landed, its rows  |
    |        |           |           | past the sequence zeroed → the leader's ready        |

    The pair (hdim ≥ 128, cluster 2 x 1 x 1): each CTA holds its 128 keys of K and V (the
    MMAs' M half) and half of every B operand (`config.pair_*`): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ take
    64 query rows of Q and dO from each CTA; dV = Pᵀ dO and dK = dSᵀ Q take half the head
    dim of dOᵀ and Qᵀ from each; dQ = dS K (M = the 128 query rows, 64 per CTA, K = the 256
    keys) takes half the head dim of Kᵀ from each, and dS's 64 query rows of all 256 keys
    from each CTA's shared memory. Compute warpgroup w of CTA r computes query columns
    64w.. of its keys: w = r writes them into its own dS, w ≠ r stages them and one lane
    bulk-copies them into the peer's (`pair.copy_to_peer`, completing on the peer's
    SDS_FULL with its bytes). One CTA (hdim 64): the same with cta_group::1, no copy.

    hdim 256 (`config.folds`, D-BW-BWD-HD256): the pair over 128 keys, 64 a CTA, so the
    key-side MMAs run at M = 128 and each CTA's 64 rows fold into 128 lanes by halves of N
    (lane = key + 64 x (column // (N / 2))). A compute thread holds half a key's row: 32
    query columns of its lane's half (`config.compute_thread`, `compute_query`); its lane
    half, not its warpgroup, says whose dQ rows its dS is (`query_owner`), and the peer's
    rows come from half the warps of both warpgroups, which meet at one named barrier
    before warpgroup 0's lane copies them. Pᵀ and dSᵀ reach the dV and dK MMAs through
    shared memory ("pt", "dst"), which the next query tile's stores may overwrite once its
    S_FULL (committed after those MMAs) has landed.

    | tensor memory (`config.bwd_tmem_plan`) | 64  | 128              | (192, 128)       | 256 |
    |----------------------------------------|-----|------------------|------------------|-----|
    | dV                                     | 0   | 0                | 0                | 0   |
    | dK                                     | 64  | 128              | 128              | 128 |
    | Sᵀ (Pᵀ 16-bit in its lower half)        | 128 | 256              | 320              | 256 |
    | dPᵀ (dSᵀ from a quarter in)             | 256 | 384              | 384 (Sᵀ's upper) | 320 |
    | dQ                                     | 384 | 320 (Sᵀ's upper) | 416 (dPᵀ's end)  | 384 |
    (At 256 Pᵀ and dSᵀ are in shared memory, not in Sᵀ's and dPᵀ's columns.)

    Two 16-bit values share a column: compute 1's P words lie over compute 0's Sᵀ columns
    32..63, so compute 1 stores them after compute 0 has loaded (a named barrier); dSᵀ's
    words start a quarter into dPᵀ, over each warpgroup's own columns, stored in
    `config.chunk_of`'s order over chunks already read (D-BW-BWD-WORDS).

    | barrier (`pair`)  | where  | arrivals             | meaning                            |
    |-------------------|--------|----------------------|------------------------------------|
    | K/V, Q, dO rings  | both   | TMA bytes / commit   | PipelineTmaUmma (pair: the leader's |
    | (Qᵀ, dOᵀ rings)   |        |                      | full barrier counts both CTAs')    |
    | ring ready        | leader | tail warp x g        | varlen, seqused: the stage's rows  |
    |                   |        |                      | past the sequence zeroed; the MMA  |
    |                   |        |                      | waits for it instead of full (the  |
    |                   |        |                      | peer's full: the leader's arrival) |
    | S_FULL, DP_FULL   | both   | 1 commit (multicast) | Sᵀ / dPᵀ of the step in TMEM        |
    | S_READ            | leader | compute warps x g    | Sᵀ in registers (dPᵀ may overwrite) |
    | P_FULL, DS_FULL   | leader | compute warps x g    | Pᵀ / dSᵀ in TMEM (hdim 256: shared  |
    |                   |        |                      | memory): dV / dK may run           |
    | SDS_FULL          | both   | local writers (+ the | dS of the CTA's query rows in      |
    |                   |        | peer's armed copy)   | shared memory                      |
    | PEER_SDS          | leader | 1 (relay)            | the peer's SDS_FULL                |
    | SDS_EMPTY         | both   | 1 commit             | dQ MMA done: dS may be rewritten   |
    | DQ_FULL           | both   | 1 commit             | dQ in TMEM                         |
    | DQ_READ           | leader | reduce warps x g     | dQ in registers (`bwd_tmem_waits`)  |
    | DKV_FULL          | both   | 1 commit             | the tile's last dK / dV MMA done   |

    The MMA warp per query tile: S, [S_READ] dP, [P_FULL] dV, [DS_FULL] dK, [SDS_FULL,
    PEER_SDS] dQ; DQ_READ of the previous tile before S or before dQ, as the plan's aliasing
    needs (`config.bwd_tmem_waits`, replayed by the model). Every role walks the same query
    tiles (`m_block_range` at the cluster's key span); a cluster with none stores dK = dV = 0.
    TMEM is allocated before the roles split and freed once after they join; no role returns
    early.
    """

    def pipeline(self):
        """This kernel's pipeline as data (`flash_cute.contract.pipeline`)."""
        from .pipelines import backward
        return backward(self)

    def __init__(self, dtype, hdim: int, hdim_v: Optional[int] = None,
                 variant: Variant = Variant(), schedule: Optional[tuple] = None,
                 deterministic: bool = False):
        self.dtype = dtype
        self.hdim, self.hdim_v = hdim, hdim if hdim_v is None else hdim_v
        dims = (self.hdim, self.hdim_v)
        if dims not in BWD_SCHEDULES and schedule is None:
            raise ValueError(f"no blackwell backward for hdim {dims}; have "
                             f"{sorted(BWD_SCHEDULES)}")
        set_kernel_switches(self, variant)
        for name, on in (("dropout", self.dropout), ("split_kv", self.split_kv),
                         ("paged K/V", self.page_size > 0), ("append", self.append),
                         ("pack_gqa", self.pack_gqa > 1),
                         ("learnable captured tensors",
                          bool(getattr(self.mods, "aux_grads", ())))):
            if on:
                raise ValueError(f"the blackwell backward has no {name} yet")
        schedule = BwdSchedule(*(schedule or BWD_SCHEDULES[dims]))
        self.schedule = schedule
        self.tile_m, self.tile_n, self.q_stages = schedule[:3]
        self.cta_group, self.do_stages = schedule.cta_group, schedule.do_stages
        self.pair = self.cta_group == 2
        self.tmem = bwd_tmem_plan(self.hdim, self.hdim_v, schedule)
        self.waits = bwd_tmem_waits(self.tmem)
        self.shared_t = shares_transposed(self.hdim, self.hdim_v, schedule)
        self.separate_t = self.pair and not self.shared_t
        self.deterministic = deterministic
        self.block_sparse = bool(getattr(self.mods, "sparse", False))
        # Rows past a sequence inside the tensors (varlen, seqused): zeroed before the MMAs
        # read them (`tail_role`); elsewhere a TMA zero-fills past the tensor's end.
        self.tails = self.varlen or self.has_seqused_q or self.has_seqused_k
        self.num_threads = 512
        # Folded (hdim 256): a thread's lane holds half its key's row (`config.folds`), and
        # Pᵀ and dSᵀ go to the dV and dK MMAs through shared memory.
        self.folded = folds(schedule)
        # Query rows of a CTA's half (the dQ MMA's M half); query columns of a compute
        # thread: 64 (its warpgroup's half of the tile), folded 32 (its warpgroup's half of
        # its lane's half).
        self.half_m = self.tile_m // self.cta_group
        self.wg_cols = wg_query_columns(schedule)

    @property
    def smem_bytes(self) -> int:
        return bwd_smem_bytes(self.hdim, self.hdim_v, self.schedule)

    # ---------------------------------------------------------------- host side

    @cute.jit
    def __call__(self, args: BwdArgs, stream: cuda.CUstream):
        """`args`: a `kernel_args.BwdArgs`; dQaccum like q (fp32, zeroed), dq_semaphores
        [b, h, query tiles] when deterministic."""
        vec = 128 // self.dtype.width
        mQ, mK, mV, mdO = (assume_aligned_strides(t, vec) for t in (args.q, args.k, args.v,
                                                                      args.dout))
        mmas = self._tiled_mmas()
        layouts = self._smem_layouts(mmas)
        cluster = cute.tiled_divide(cute.make_layout(self.schedule.cluster),
                                    (mmas["s"].thr_id.shape,))
        atoms = self._tma_atoms(mQ, mK, mV, mdO, mmas, layouts, cluster)
        SharedStorage = self._shared_storage(layouts)
        if cutlass.const_expr(SharedStorage.size_in_bytes() != self.smem_bytes
                              or self.smem_bytes + STATIC_SMEM > SMEM_CAPACITY):
            raise ValueError(f"shared memory: {SharedStorage.size_in_bytes()} B (estimated "
                             f"{self.smem_bytes}) + {STATIC_SMEM} static, capacity "
                             f"{SMEM_CAPACITY}")
        batch = SeqInfo.num_batches(mQ, args.cu_seqlens_q)
        span = self.cta_group * self.tile_n
        grid = (cute.ceil_div(args.max_seqlen_k, span) * self.cta_group, mQ.shape[-2], batch)
        scale_log2, mod_scale = fold_scores(self.score_mod, args.softmax_scale, args.softcap)
        self.kernel(
            tuple(atoms[n] for n in self._atom_names), args.dq_accum, args.lse_log2,
            args.delta, args.dk, args.dv,
            args.dq_semaphores, args.softmax_scale, scale_log2, mod_scale, args.window_left,
            args.window_right, args.max_seqlen_q if cutlass.const_expr(self.varlen) else None,
            (args.cu_seqlens_q, args.cu_seqlens_k), (args.seqused_q, args.seqused_k),
            mQ.shape[-2] // mK.shape[-2], tuple(layouts[n] for n in self._layout_names),
            tuple(mmas[n] for n in _MMA_NAMES), aux_tensors(self, args),
            block_mask_tensors(self, args), SharedStorage, self._tx_bytes(layouts),
        ).launch(grid=grid, block=[self.num_threads, 1, 1], cluster=self.schedule.cluster,
                 stream=stream, min_blocks_per_mp=1)

    @property
    def _atom_names(self) -> tuple:
        return ("k", "v", "q", "do") + (("qt", "dot", "kt") if self.pair else ())

    @property
    def _layout_names(self) -> tuple:
        return ("k", "v", "q", "do", "qt", "dot", "kt", "ds", "p", "dst") + (
            ("xchg",) if self.pair else ())

    def _tilers(self) -> dict:
        """(M, N, K) of each MMA: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dV = Pᵀ dO, dK = dSᵀ Q, dQ = dS K."""
        span, tm = self.cta_group * self.tile_n, self.tile_m
        return {"s": (span, tm, self.hdim), "dp": (span, tm, self.hdim_v),
                "dv": (span, self.hdim_v, tm), "dk": (span, self.hdim, tm),
                "dq": (tm, self.hdim, span)}

    def _tiled_mmas(self) -> dict:
        """Sᵀ and dPᵀ read K-major K, V, Q, dO; dV and dK read Pᵀ and dSᵀ from TMEM (K-major,
        as tcgen05 requires of a TMEM operand; folded, from shared memory) and dO, Q
        MN-major (head dim contiguous); dQ reads dS MN-major (query rows contiguous, as the
        compute threads write a key's row of them) and K MN-major."""
        K, MN = OperandMajorMode.K, OperandMajorMode.MN
        group = tcgen05.CtaGroup.TWO if self.pair else tcgen05.CtaGroup.ONE
        # Folded, Pᵀ and dSᵀ come from shared memory (K-major: a key's queries contiguous).
        tmem = tcgen05.OperandSource.SMEM if self.folded else tcgen05.OperandSource.TMEM
        t = self._tilers()

        def mma(a, b, name, source=tcgen05.OperandSource.SMEM):
            return sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, a, b, Float32,
                                                      group, t[name][:2], source)
        return {"s": mma(K, K, "s"), "dp": mma(K, K, "dp"), "dv": mma(K, MN, "dv", tmem),
                "dk": mma(K, MN, "dk", tmem), "dq": mma(MN, MN, "dq")}

    def _smem_layouts(self, mmas) -> dict:
        """Each operand's staged shared-memory layout, and Pᵀ's and dSᵀ's TMEM operand
        layouts. With one CTA, Qᵀ, dOᵀ and Kᵀ are MN-major views of the Q, dO and K tiles."""
        t, d = self._tilers(), self.dtype
        a = sm100_utils.make_smem_layout_a
        b = sm100_utils.make_smem_layout_b
        out = {"k": a(mmas["s"], t["s"], d, 1), "v": a(mmas["dp"], t["dp"], d, 1),
               "q": b(mmas["s"], t["s"], d, self.q_stages),
               "do": b(mmas["dp"], t["dp"], d, self.do_stages),
               "qt": b(mmas["dk"], t["dk"], d, self.q_stages),
               "dot": b(mmas["dv"], t["dv"], d, self.do_stages),
               "kt": b(mmas["dq"], t["dq"], d, 1), "ds": a(mmas["dq"], t["dq"], d, 1),
               "p": a(mmas["dv"], t["dv"], d, 1), "dst": a(mmas["dk"], t["dk"], d, 1)}
        if cutlass.const_expr(self.pair):
            # The peer's share of dS, staged: the same rows over this CTA's keys only.
            out["xchg"] = a(mmas["dq"], (self.tile_m, self.hdim, self.tile_n), d, 1)
        return out

    def _tma_atoms(self, mQ, mK, mV, mdO, mmas, layouts, cluster) -> dict:
        """TMA atoms and coordinate tensors: K and V as A operands, Q and dO (and with the
        pair Qᵀ, dOᵀ, Kᵀ over head-dim-first views) as B operands, projected through their
        MMAs (with the pair, each CTA's copy fills its half; the leader's barrier counts
        both)."""
        rows, cols = ROWS_FIRST[self.varlen][0], COLS_FIRST[self.varlen][0]
        t = self._tilers()
        if cutlass.const_expr(self.pair):
            op_a = sm100_utils.cluster_shape_to_tma_atom_A(self.schedule.cluster,
                                                           mmas["s"].thr_id)
            op_b = sm100_utils.cluster_shape_to_tma_atom_B(self.schedule.cluster,
                                                           mmas["s"].thr_id)
        else:
            op_a = op_b = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)

        def one(layout):
            return cute.select(layout, mode=[0, 1, 2])
        shape = cluster.shape
        out = {"k": cute.nvgpu.make_tiled_tma_atom_A(op_a, permute(mK, rows), one(layouts["k"]),
                                                     t["s"], mmas["s"], shape),
               "v": cute.nvgpu.make_tiled_tma_atom_A(op_a, permute(mV, rows), one(layouts["v"]),
                                                     t["dp"], mmas["dp"], shape),
               "q": cute.nvgpu.make_tiled_tma_atom_B(op_b, permute(mQ, rows), one(layouts["q"]),
                                                     t["s"], mmas["s"], shape),
               "do": cute.nvgpu.make_tiled_tma_atom_B(op_b, permute(mdO, rows),
                                                      one(layouts["do"]), t["dp"], mmas["dp"],
                                                      shape)}
        if cutlass.const_expr(self.pair):
            out["qt"] = cute.nvgpu.make_tiled_tma_atom_B(op_b, permute(mQ, cols),
                                                         one(layouts["qt"]), t["dk"],
                                                         mmas["dk"], shape)
            out["dot"] = cute.nvgpu.make_tiled_tma_atom_B(op_b, permute(mdO, cols),
                                                          one(layouts["dot"]), t["dv"],
                                                          mmas["dv"], shape)
            out["kt"] = cute.nvgpu.make_tiled_tma_atom_B(op_b, permute(mK, cols),
                                                         one(layouts["kt"]), t["dq"],
                                                         mmas["dq"], shape)
        return out

    def _tx_bytes(self, layouts) -> dict:
        """Bytes each ring's full barrier expects per stage: with the pair the leader's
        barrier receives both CTAs' copies."""
        def size(name):
            return cute.size_in_bytes(self.dtype, cute.select(layouts[name], mode=[0, 1, 2]))
        g = self.cta_group
        kv = size("k") + size("v") + (size("kt") if self.pair else 0)
        return {"kv": kv * g, "q": size("q") * g, "do": size("do") * g,
                "qt": size("qt") * g, "dot": size("dot") * g}

    def _shared_storage(self, layouts):
        """As `config.bwd_smem_bytes` sizes it: barriers, TMEM address, LSE₂ and Δ, tiles."""
        qs, ds = self.q_stages, self.do_stages
        sep = self.separate_t
        n_stats = 2 * 2 * self.tile_m

        @cute.struct
        class SharedStorage:
            kv_bars: cute.struct.MemRange[cutlass.Int64, RING_STAGE_BARRIERS]
            q_bars: cute.struct.MemRange[cutlass.Int64, RING_STAGE_BARRIERS * qs]
            do_bars: cute.struct.MemRange[cutlass.Int64, RING_STAGE_BARRIERS * ds]
            if sep:
                qt_bars: cute.struct.MemRange[cutlass.Int64, RING_STAGE_BARRIERS * qs]
                dot_bars: cute.struct.MemRange[cutlass.Int64, RING_STAGE_BARRIERS * ds]
            sync_bars: cute.struct.MemRange[cutlass.Int64, pair.COUNT]
            tmem_dealloc: cutlass.Int64
            tmem_addr: Int32
            stats: cute.struct.Align[cute.struct.MemRange[Float32, n_stats], 16]
            sK: smem_tile(self.dtype, layouts["k"])
            sV: smem_tile(self.dtype, layouts["v"])
            sQ: smem_tile(self.dtype, layouts["q"])
            sdO: smem_tile(self.dtype, layouts["do"])
            sdS: smem_tile(self.dtype, layouts["ds"])
            if self.pair:
                sKt: smem_tile(self.dtype, layouts["kt"])
                sXchg: smem_tile(self.dtype, layouts["xchg"])
            if self.folded:
                sPt: smem_tile(self.dtype, layouts["p"])
                sdSt: smem_tile(self.dtype, layouts["dst"])
            if sep:
                sQt: smem_tile(self.dtype, layouts["qt"])
                sdOt: smem_tile(self.dtype, layouts["dot"])

        return SharedStorage

    # ---------------------------------------------------------------- device side

    @cute.kernel
    def kernel(self, atoms, mdQaccum: cute.Tensor, mLSElog2: cute.Tensor, mDelta: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mdQsem: Optional[cute.Tensor],
               softmax_scale: Float32, scale_log2: Float32, mod_scale: Float32,
               window_left: Int32, window_right: Int32, max_seqlen_q: Optional[Int32],
               cu_seqlens, seqused, qheads_per_kvhead: Int32, layouts, mmas, aux, block_mask,
               SharedStorage: cutlass.Constexpr, tx_bytes: cutlass.Constexpr):
        atoms = dict(zip(self._atom_names, atoms))
        layouts = dict(zip(self._layout_names, layouts))
        mmas = dict(zip(_MMA_NAMES, mmas))
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == _LOAD_WARP:
            for name in self._atom_names:
                cpasync.prefetch_descriptor(atoms[name][0])
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        rings = self._rings(storage, tx_bytes)
        for ring in rings.values():
            ring.init(warp_idx)
        sync = pair.PairSync(storage.sync_bars.data_ptr(), self.cta_group)
        sync.init(warp_idx)
        # Its constructor initializes the pair's TMEM dealloc barrier, with the others.
        tmem = self._tmem_allocator(storage, True)
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.pair):
            # The peer's first remote arrivals need this CTA's barriers initialized.
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        if warp_idx == _MMA_WARP:
            tmem.allocate(self.tmem.columns)
        tmem.wait_for_alloc()
        # Read again where it is used (each role, the free): a value kept from here would
        # stay live through every role.
        tmem_ptr = storage.tmem_addr.ptr

        # Each role derives its tile and views after taking its registers: nothing computed
        # before the split stays live through it.
        where = (cu_seqlens, seqused, window_left, window_right, max_seqlen_q, atoms["q"][1],
                 atoms["k"][1], qheads_per_kvhead, block_mask)
        if warp_idx < _COMPUTE_WARP:
            cute.arch.setmaxregister_decrease(BWD_ROLE_REGISTERS[0])
            self.reduce_role(Work(self, *where), sync, tmem_ptr, mdQaccum, mdQsem)
        elif warp_idx < _MMA_WARP:
            cute.arch.setmaxregister_increase(BWD_ROLE_REGISTERS[1])
            # Each warpgroup's own code: its query columns, chunk order and turn at the
            # named barriers are compile-time.
            compute = (Work(self, *where), sync, tmem_ptr, Smem(self, storage, layouts),
                       storage, mLSElog2, mDelta, mdK, mdV, softmax_scale, scale_log2,
                       mod_scale, aux)
            if warp_idx < _COMPUTE_WARP + 4:
                self.compute_role(*compute, 0)
            else:
                self.compute_role(*compute, 1)
        else:
            cute.arch.setmaxregister_decrease(BWD_ROLE_REGISTERS[3])
            if warp_idx == _MMA_WARP:
                work = Work(self, *where)
                if work.is_leader:
                    self.mma_role(work, sync, rings, tmem_ptr, Smem(self, storage, layouts),
                                  mmas, layouts)
            elif warp_idx == _LOAD_WARP:
                self.load_role(Work(self, *where), rings, atoms, Smem(self, storage, layouts),
                               mmas)
            elif warp_idx == _RELAY_WARP:
                if cutlass.const_expr(self.pair):
                    work = Work(self, *where)
                    if not work.is_leader:
                        self.relay_role(work, sync)
            elif warp_idx == _TAIL_WARP:
                if cutlass.const_expr(self.tails):
                    self.tail_role(Work(self, *where), rings, atoms,
                                   Smem(self, storage, layouts))

        if cutlass.const_expr(self.pair):
            # No CTA of the pair leaves while the other may still signal it.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        if warp_idx == _MMA_WARP:
            tmem = self._tmem_allocator(storage, False)
            tmem.relinquish_alloc_permit()
            tmem.free(tmem.retrieve_ptr(Float32), self.tmem.columns)

    def _tmem_allocator(self, storage, first: bool) -> TmemAllocator:
        """The CTA's TMEM allocator (with the pair, both CTAs' allocations as one); made
        again for the free after the roles join, its barrier initialized only the first
        time."""
        return TmemAllocator(
            storage.tmem_addr.ptr, barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=_TMEM_ALLOC_BARRIER, num_threads=self.num_threads),
            allocator_warp_id=_MMA_WARP, is_two_cta=self.pair,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc.ptr if self.pair else None,
            initialize_mbarrier=first)

    def _rings(self, storage, tx_bytes) -> dict:
        """The TMA rings (load warp → MMA warp, `pair.TmaRing`): K/V (with Kᵀ) once per tile,
        Q and dO per query tile, Qᵀ and dOᵀ in rings of their own or, where they share Q's
        and dO's tiles, as the next stage of those rings."""
        def ring(bars, stages, tx):
            return pair.TmaRing(bars.data_ptr(), stages, tx, self.cta_group, self.tails)
        out = {"kv": ring(storage.kv_bars, 1, tx_bytes["kv"]),
               "q": ring(storage.q_bars, self.q_stages, tx_bytes["q"]),
               "do": ring(storage.do_bars, self.do_stages, tx_bytes["do"])}
        if cutlass.const_expr(self.separate_t):
            out["qt"] = ring(storage.qt_bars, self.q_stages, tx_bytes["qt"])
            out["dot"] = ring(storage.dot_bars, self.do_stages, tx_bytes["dot"])
        return out

    def _ring_states(self, user):
        """The K/V, Q, dO (and Qᵀ, dOᵀ rings' own, else None) pipeline states of a role that
        is `user` (producer or consumer) of the rings."""
        def state(stages):
            return pipeline.make_pipeline_state(user, stages)
        separate = self.separate_t
        return (state(1), state(self.q_stages), state(self.do_stages),
                state(self.q_stages) if separate else None,
                state(self.do_stages) if separate else None)

    # ---------------------------------------------------------------- load warp

    @cute.jit
    def load_role(self, work, rings, atoms, smem, mmas):
        """K, V (and Kᵀ) once; per query tile Q then dO, and with the pair Qᵀ and dOᵀ (in
        their own rings, or after Q and dO in theirs)."""
        kv, q, do, qt, dot = self._ring_states(pipeline.PipelineUserType.Producer)
        if work.has_steps:
            thr = {name: mma.get_slice(work.rank) for name, mma in mmas.items()}
            g = work.views(atoms, thr, smem)
            rings["kv"].producer_acquire(kv)
            bar = rings["kv"].barrier(kv)
            for name in ("k", "v", "kt"):
                if cutlass.const_expr(name in g):
                    src, dst = g[name]
                    cute.copy(atoms[name][0], _tile(src, name, work.n_tile), dst[None, 0],
                              tma_bar_ptr=bar)
            kv.advance()
            for m in cutlass.range(work.m_min, work.m_max, unroll=1):
                q = self._load_one(rings["q"], q, atoms["q"][0], g["q"], "q", m)
                if cutlass.const_expr(self.separate_t):
                    qt = self._load_one(rings["qt"], qt, atoms["qt"][0], g["qt"], "qt", m)
                elif cutlass.const_expr(self.pair):
                    q = self._load_one(rings["q"], q, atoms["qt"][0], g["qt"], "qt", m)
                do = self._load_one(rings["do"], do, atoms["do"][0], g["do"], "do", m)
                if cutlass.const_expr(self.separate_t):
                    dot = self._load_one(rings["dot"], dot, atoms["dot"][0], g["dot"], "dot", m)
                elif cutlass.const_expr(self.pair):
                    do = self._load_one(rings["do"], do, atoms["dot"][0], g["dot"], "dot", m)
        rings["kv"].producer_tail(kv)
        rings["q"].producer_tail(q)
        rings["do"].producer_tail(do)
        if cutlass.const_expr(self.separate_t):
            rings["qt"].producer_tail(qt)
            rings["dot"].producer_tail(dot)

    @cute.jit
    def _load_one(self, ring, state, atom, views, name: cutlass.Constexpr[str], m: Int32):
        src, dst = views
        ring.producer_acquire(state)
        cute.copy(atom, _tile(src, name, m), dst[None, state.index],
                  tma_bar_ptr=ring.barrier(state))
        state.advance()
        return state

    # ---------------------------------------------------------------- MMA warp

    @cute.jit
    def mma_role(self, work, sync, rings, tmem_ptr, smem, mmas, layouts):
        """Per query tile: Sᵀ, dPᵀ, dV, dK, dQ (`BlackwellBwd` docstring). With one CTA, dV
        and dK read the dO and Q stages Sᵀ and dPᵀ read (MN-major views), which are released
        after them; the pair's Q and dO halves free after Sᵀ and dPᵀ, and Qᵀ, dOᵀ come from
        their own rings or as the next stage of Q's and dO's."""
        kv, q, do, qt, do_t = self._ring_states(pipeline.PipelineUserType.Consumer)
        acc = TmemAcc(self, tmem_ptr, mmas, layouts)
        frags = smem.fragments(mmas)
        if work.has_steps:
            rings["kv"].consumer_wait(kv)
            phase = Int32(0)
            for i in cutlass.range(work.m_max - work.m_min, unroll=1):
                rings["q"].consumer_wait(q)
                if cutlass.const_expr("dq_read" in self.waits):
                    if i > 0:
                        sync.wait(pair.DQ_READ, phase ^ 1)
                self._gemm(mmas["s"], acc.s, frags["k"][None, None, None, 0],
                           frags["q"][None, None, None, q.index], False)
                sync.commit(pair.S_FULL)
                if cutlass.const_expr(self.pair):
                    rings["q"].consumer_release(q)
                    q.advance()
                rings["do"].consumer_wait(do)
                if cutlass.const_expr("s_read" in self.waits):
                    sync.wait(pair.S_READ, phase)
                self._gemm(mmas["dp"], acc.dp, frags["v"][None, None, None, 0],
                           frags["do"][None, None, None, do.index], False)
                sync.commit(pair.DP_FULL)
                if cutlass.const_expr(self.pair):
                    rings["do"].consumer_release(do)
                    do.advance()
                # dV += Pᵀ dOᵀ and dK += dSᵀ Qᵀ: the transposed tiles from their own rings, or
                # the next stage of Q's and dO's (the pair), or the same stage (one CTA).
                p_op, ds_op = (frags["pt"], frags["dst"]) if cutlass.const_expr(self.folded) \
                    else (acc.p_operand, acc.ds_operand)
                dv = (mmas["dv"], acc.dv, p_op, frags["dot"], i > 0)
                dk = (mmas["dk"], acc.dk, ds_op, frags["qt"], i > 0)
                if cutlass.const_expr(self.separate_t):
                    do_t = self._gemm_transposed(rings["dot"], do_t, True, sync, pair.P_FULL,
                                                 phase, *dv)
                    qt = self._gemm_transposed(rings["qt"], qt, True, sync, pair.DS_FULL,
                                               phase, *dk)
                else:
                    do = self._gemm_transposed(rings["do"], do, self.pair, sync, pair.P_FULL,
                                               phase, *dv)
                    q = self._gemm_transposed(rings["q"], q, self.pair, sync, pair.DS_FULL,
                                              phase, *dk)
                # dQ = dS K: this CTA's dS, and the peer's (its relay).
                sync.wait(pair.SDS_FULL, phase)
                if cutlass.const_expr(self.pair):
                    sync.wait(pair.PEER_SDS, phase)
                if cutlass.const_expr("dq_read" not in self.waits):
                    if i > 0:
                        sync.wait(pair.DQ_READ, phase ^ 1)
                self._gemm(mmas["dq"], acc.dq, frags["ds"][None, None, None, 0],
                           frags["kt"][None, None, None, 0], False)
                sync.commit(pair.DQ_FULL)
                sync.commit(pair.SDS_EMPTY)
                phase = phase ^ 1
            sync.commit(pair.DKV_FULL)
            rings["kv"].consumer_release(kv)

    @cute.jit
    def _gemm_transposed(self, ring, state, wait: cutlass.Constexpr[bool], sync, bar: int,
                         phase: Int32, mma, acc, a_frag, b_frags, accumulate):
        """dV or dK from the stage `state` of `ring` (waited for first when `wait`), once the
        compute warps' Pᵀ or dSᵀ is in TMEM (`bar`); the stage is released after. Returns
        the advanced state."""
        if cutlass.const_expr(wait):
            ring.consumer_wait(state)
        sync.wait(bar, phase)
        self._gemm(mma, acc, a_frag, b_frags[None, None, None, state.index], accumulate)
        ring.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def _gemm(self, mma, acc, a_frag, b_frag, accumulate):
        # A fresh atom per call: its accumulate field is set where the MMAs are issued.
        atom = cute.make_mma_atom(mma.op)
        for k in cutlass.range_constexpr(cute.size(a_frag, mode=[2])):
            atom.set(tcgen05.Field.ACCUMULATE, cutlass.Boolean(accumulate) | (k != 0))
            cute.gemm(atom, acc, a_frag[None, None, k], b_frag[None, None, k], acc)

    # ---------------------------------------------------------------- compute warpgroups

    @cute.jit
    def compute_role(self, work, sync, tmem_ptr, smem, storage, mLSElog2, mDelta, mdK, mdV,
                     softmax_scale: Float32, scale_log2: Float32, mod_scale: Float32, aux,
                     wg: cutlass.Constexpr[int]):
        lane = cute.arch.thread_idx()[0] % 128
        rows = TmemRows(tmem_ptr)
        stats = storage.stats.get_tensor(cute.make_layout((self.tile_m // 2, 2, 2, 2)))
        # The thread's key in the CTA's tile, and (folded) which half of the query columns
        # its lane holds: warp-uniform.
        key, part = compute_thread(lane, self.schedule)
        if work.has_steps:
            seq = work.seq
            mask = AttentionMask(self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                 self.causal, work.win_left, work.win_right)
            scores = tile_scores(self, mod_scale, mask, aux, seq.batch, work.head,
                                 work.block_states, seq)
            n_cta = work.n_tile * self.cta_group + work.rank
            rP = cute.make_rmem_tensor(self.wg_cols, Float32)
            phase = Int32(0)
            for i in cutlass.range(work.m_max - work.m_min, unroll=1):
                m = work.m_min + i
                buf = i % 2
                self._stage_stats(stats, buf, wg, lane, m, seq, work.head, mLSElog2, mDelta)
                # The tile's block-mask state and mask range, read before Sᵀ is waited for.
                state = scores.tile_state(m, n_cta)
                rng = mask.block_range(m)
                sync.wait(pair.S_FULL, phase)
                # The thread's columns of its key's row first (64; folded 32), all of them:
                # compute 1's P words land in Sᵀ's columns 32..63, compute 0's to read
                # (`_in_order`; folded, P goes to shared memory). Chunk c of the row is its
                # query columns `chunk_of(c, wg)`, in `rP` and in what follows.
                chunks = self.wg_cols // _DS_CHUNK
                for c in cutlass.range_constexpr(chunks):
                    self._load_chunk(rP, rows, self.tmem.s + wg * self.wg_cols, c,
                                     chunk_of(c, wg, chunks), lane)
                cute.arch.fence_view_async_tmem_load()
                sync.arrive_leader(pair.S_READ)
                if cutlass.const_expr(not self.folded):
                    self._in_order(_S_ORDER_BARRIER, wg)
                for c in cutlass.range_constexpr(chunks):
                    self._probs(rP, c, chunk_of(c, wg, chunks), rows, smem, wg, lane,
                                (key, part), stats, buf, scores, m, n_cta, rng, state,
                                scale_log2)
                self._operands_written()
                sync.arrive_leader(pair.P_FULL)
                # dS from dPᵀ in chunks, each at once to TMEM (dSᵀ, the dK MMA's operand;
                # folded, to shared memory) and to shared memory (dS, the dQ MMA's): the dQ
                # MMA of the previous query tile must be done with the latter first. Each
                # warpgroup's dS words lie over its own dPᵀ columns, of chunks it has loaded
                # (`chunk_of`'s order, `ds_words_first`).
                if i > 0:
                    sync.wait(pair.SDS_EMPTY, phase ^ 1)
                sync.wait(pair.DP_FULL, phase)
                for c in cutlass.range_constexpr(chunks):
                    k = chunk_of(c, wg, chunks)
                    rdP = rows.load(self.tmem.dp + wg * self.wg_cols + k * _DS_CHUNK,
                                    _DS_CHUNK, lane)
                    self._ds(rdP, rP, stats, buf, wg, part, c, k)
                    if cutlass.const_expr(self.folded):
                        self._store_row(smem.sdSt, rdP, key, self._query(wg, part, k))
                    else:
                        rows.store_halves(ds_words_first(self.tmem, wg, k * _DS_CHUNK), rdP,
                                          lane, self.dtype)
                    self._write_ds(rdP, smem, wg, key, part, work.rank, k)
                self._operands_written()
                sync.arrive_leader(pair.DS_FULL)
                self._ds_done(smem, sync, wg, lane, part, work.rank)
                phase = phase ^ 1
            # The last dQ MMA's commit of SDS_EMPTY reaches this CTA too: met here, none is
            # left in flight when the CTA exits.
            sync.wait(pair.SDS_EMPTY, phase ^ 1)
            sync.wait(pair.DKV_FULL, 0)
        self._epilogue(work, rows, mdV, self.tmem.dv, self.hdim_v, Float32(1.0), wg, lane,
                       (key, part))
        self._epilogue(work, rows, mdK, self.tmem.dk, self.hdim, softmax_scale, wg, lane,
                       (key, part))

    def _query(self, wg: int, part, chunk) -> Int32:
        """The query column (in the tile) where a compute thread's chunk `chunk` starts
        (`config.compute_query`)."""
        return compute_query(wg, part, chunk, self.schedule, _DS_CHUNK)

    @cute.jit
    def _operands_written(self):
        """Pᵀ or dSᵀ complete for the MMAs: in TMEM (its stores waited for), or folded in
        shared memory (made visible to the async proxy)."""
        if cutlass.const_expr(self.folded):
            cute.arch.fence_proxy("async.shared", space="cta")
        else:
            cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def _store_row(self, s: cute.Tensor, values: cute.Tensor, key: Int32, query: Int32):
        """`values` (a chunk of `_DS_CHUNK` query columns of this thread's key, fp32) in
        16-bit into a K-major (key rows, query columns) A operand in shared memory (Pᵀ,
        dSᵀ): (keys, 16) per MMA step, the query column's step in the third mode."""
        half = cute.make_rmem_tensor(_DS_CHUNK, self.dtype)
        half.store(values.load().to(self.dtype))
        step = s[((key, None), 0, query // 16, 0)]
        cute.autovec_copy(half, cute.local_tile(step, (_DS_CHUNK,), ((query % 16) // _DS_CHUNK,)))

    @cute.jit
    def _stage_stats(self, stats, buf: Int32, wg: cutlass.Constexpr[int], lane: Int32,
                     m: Int32, seq, head, mLSElog2, mDelta):
        """The LSE₂ (threads 0..63) and Δ (64..127) of the warpgroup's 64 query rows into
        shared memory (`config.stats_entry`), +inf and 0 past the sequence so that P = 0 and
        dS = 0 there; the buffers alternate by query tile, so one barrier per tile orders the
        writes after the last reads of two tiles ago."""
        col, kind, query = stats_entry(lane, wg, self.schedule)
        row = m * self.tile_m + query
        inside = row < seq.seqlen_q
        safe = cutlass.min(row, cutlass.max(seq.seqlen_q - 1, 0))
        if kind == 0:
            value = seq.lse_view(mLSElog2, head)[safe]
            stats[col, 0, wg, buf] = value if inside else Float32.inf
        else:
            value = seq.lse_view(mDelta, head)[safe]
            stats[col, 1, wg, buf] = value if inside else Float32(0.0)
        pipeline.NamedBarrier(barrier_id=_STATS_BARRIER + wg, num_threads=128).arrive_and_wait()

    @cute.jit
    def _probs(self, rP, slot: int, chunk, rows, smem, wg: cutlass.Constexpr[int], lane: Int32,
               where, stats, buf: Int32, scores, m: Int32, n_cta: Int32, rng, state,
               scale_log2: Float32):
        """In place on `rP`'s `slot`, this thread's Sᵀ at query-column chunk `chunk` (of
        `_DS_CHUNK` columns): the score seam (`Scores.prepare`: mods, mask), P =
        exp2(S·scale_log2 − LSE₂) to TMEM in 16-bit (folded, to Pᵀ in shared memory), then P
        times the score mod's derivative (softcap's 1 − tanh², a traced mod's from the
        seam), all dS needs of it; the derivative lives beside one chunk, not beside the
        row. `where`: the thread's (key, lane half)."""
        key, part = where
        column = self._query(wg, part, chunk)
        stat = stats_slot(part, chunk * _DS_CHUNK, self.schedule)
        rS = cute.make_tensor(rP.iterator + slot * _DS_CHUNK, cute.make_layout(_DS_CHUNK))
        grad = cute.make_rmem_tensor(_DS_CHUNK, Float32)
        traced = scores.needs_grad
        view = cute.make_tensor(rS.iterator, cute.make_layout((_DS_CHUNK, 1)))
        coord = cute.domain_offset((column, key), cute.make_identity_tensor((_DS_CHUNK, 1)))
        scores.prepare(view, coord, m, n_cta, rng,
                       grad_mn=(cute.make_tensor(grad.iterator, view.layout) if traced
                                else None), state=state)
        # Softcap's derivative is a function of the value the seam stored; a traced mod's
        # comes from the seam, and is 1 (none) for a bias.
        by_value = self.score_mod is not None and self.score_mod.value_grad
        for j in cutlass.range_constexpr(_DS_CHUNK):
            if cutlass.const_expr(by_value):
                grad[j] = self.score_mod.grad(rS[j])
            rS[j] = cute.math.exp2(rS[j] * scale_log2 - stats[stat + j, 0, wg, buf],
                                   fastmath=True)
        if cutlass.const_expr(self.folded):
            self._store_row(smem.sPt, rS, key, column)
        else:
            rows.store_halves(self.tmem.s + column // 2, rS, lane, self.dtype)
        if cutlass.const_expr(traced or by_value):
            rS.store(rS.load() * grad.load())

    @cute.jit
    def _load_chunk(self, dst, rows, column, slot: int, chunk, lane: Int32):
        """Query-column chunk `chunk` of this thread's row from TMEM (columns from `column`)
        into `dst`'s `slot`."""
        got = rows.load(column + chunk * _DS_CHUNK, _DS_CHUNK, lane)
        for j in cutlass.range_constexpr(_DS_CHUNK):
            dst[slot * _DS_CHUNK + j] = got[j]

    @cute.jit
    def _in_order(self, barrier_id: int, wg: cutlass.Constexpr[int]):
        """Compute 1 goes on once compute 0 has arrived (both warpgroups, 256 threads): the
        16-bit P words of compute 1's query columns lie over compute 0's fp32 Sᵀ columns.
        Reused every query tile: compute 0 cannot arrive for the next before compute 1 has
        passed, since the next tile's Sᵀ waits for this tile's dS of both."""
        barrier = pipeline.NamedBarrier(barrier_id=barrier_id, num_threads=256)
        if cutlass.const_expr(wg == 0):
            barrier.arrive()
        else:
            barrier.arrive_and_wait()

    @cute.jit
    def _ds(self, rdP, rP, stats, buf: Int32, wg: cutlass.Constexpr[int], part: Int32,
            slot: int, chunk):
        """In place: dP at query-column chunk `chunk` → dS = P ∘ (dP − Δ), P from `rP`'s
        `slot`, there times the softcap's derivative where there is one (`_probs`)."""
        stat = stats_slot(part, chunk * _DS_CHUNK, self.schedule)
        for j in cutlass.range_constexpr(cute.size(rdP)):
            rdP[j] = rP[slot * _DS_CHUNK + j] * (rdP[j] - stats[stat + j, 1, wg, buf])

    @cute.jit
    def _write_ds(self, rdS, smem, wg: cutlass.Constexpr[int], key: Int32, part: Int32,
                  rank: Int32, chunk: int):
        """A chunk of dS of this thread's key for its query rows into the dQ MMA's operand:
        with one CTA, or where the rows are this CTA's half (the pair: warpgroup, folded
        lane half, = rank), into its own dS; else into the stage the peer's copy leaves
        from."""
        half = cute.make_rmem_tensor(cute.size(rdS), self.dtype)
        half.store(rdS.load().to(self.dtype))
        if cutlass.const_expr(not self.pair):
            cute.autovec_copy(half, smem.ds_row(smem.sdS, wg, key, chunk))
        else:
            # Folded, the warpgroup's rows are a part of each CTA's half; else all of one.
            rows = wg if cutlass.const_expr(self.folded) else 0
            if query_owner(wg, part, self.schedule) == rank:
                ours = pair_exchange_first(rank, self.schedule) + key
                cute.autovec_copy(half, smem.ds_row(smem.sdS, rows, ours, chunk))
            else:
                cute.autovec_copy(half, smem.ds_row(smem.sXchg, rows, key, chunk))

    @cute.jit
    def _ds_done(self, smem, sync, wg: cutlass.Constexpr[int], lane: Int32, part: Int32,
                 rank: Int32):
        """The thread's dS rows are written: visible to the MMAs (async proxy), then one
        arrival per warp on this CTA's SDS_FULL, or for the peer's rows (the 128 threads of
        the other warpgroup, or folded of both warpgroups' other lane halves) one lane arms
        the peer's SDS_FULL with their bytes and bulk-copies them over."""
        cute.arch.fence_proxy("async.shared", space="cta")
        owner = query_owner(wg, part, self.schedule)
        # Folded, the copying lane is warpgroup 0's first of its peer's half.
        copier = (wg == 0) & (lane % 64 == 0) if cutlass.const_expr(self.folded) else lane == 0
        bar_id = _XCHG_BARRIER if cutlass.const_expr(self.folded) else _XCHG_BARRIER + wg
        if cutlass.const_expr(not self.pair):
            sync.arrive_local(pair.SDS_FULL)
        else:
            if owner == rank:
                sync.arrive_local(pair.SDS_FULL)
            else:
                barrier = pipeline.NamedBarrier(barrier_id=bar_id, num_threads=128)
                barrier.arrive_and_wait()
                if copier:
                    peer = rank ^ 1
                    nbytes = smem.xchg_bytes
                    sync.arm_peer(pair.SDS_FULL, peer, nbytes)
                    # This CTA's keys start at this offset of the peer's dS (its key groups
                    # of 16 are the layout's outer mode).
                    dst = smem.sdS.iterator + pair_exchange_first(rank, self.schedule) \
                        * self.half_m
                    pair.copy_to_peer(smem.sXchg.iterator, dst, sync.bars + pair.SDS_FULL,
                                      nbytes, peer)
                    cute.arch.cp_async_bulk_commit_group()
                    # The stage is rewritten next tile: its copy must have read it.
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                barrier.arrive_and_wait()

    @cute.jit
    def _epilogue(self, work, rows, m_out, column: int, width: int, scale: Float32,
                  wg: cutlass.Constexpr[int], lane: Int32, where):
        """dV (or dK · scale) of this thread's key, the warpgroup's half of the lane's
        columns (folded, the lane holds half of the head dim), from TMEM (zero where the tile
        had no query tile) to global memory, keys past seqlen_k skipped; fp32 for GQA
        (summed over a group by the launch)."""
        key, part = where
        seq = work.seq
        key = pair_kv_first(work.n_tile, work.rank, self.schedule) + key
        g = seq.k_view(m_out, work.head)
        lane_cols = width // 2 if cutlass.const_expr(self.folded) else width
        cols = lane_cols // 2
        for c in cutlass.range_constexpr(cols // _EPI_CHUNK):
            first = wg * cols + c * _EPI_CHUNK
            chunk = cute.make_rmem_tensor(_EPI_CHUNK, Float32)
            chunk.fill(0.0)
            if work.has_steps:
                loaded = rows.load(column + first, _EPI_CHUNK, lane)
                chunk.store(loaded.load() * scale)
            out = cute.make_rmem_tensor(_EPI_CHUNK, m_out.element_type)
            out.store(chunk.load().to(m_out.element_type))
            if key < seq.seqlen_k:
                dim = part * lane_cols + first
                dst = cute.local_tile(g, (1, _EPI_CHUNK), (key, dim // _EPI_CHUNK))
                cute.autovec_copy(out, dst[0, None])

    # ---------------------------------------------------------------- reduce warps

    @cute.jit
    def reduce_role(self, work, sync, addr_word, mdQaccum, mdQsem):
        """Per query tile: dQ's rows of this CTA from TMEM (`acc_columns` folds the pair's 64
        rows into 128 lanes), `dq_chunk` columns at a time, each chunk's fp32 atomics into
        dQaccum issued while the next loads (rows past seqlen_q skipped); the arrival on
        DQ_READ follows the last load. Deterministic: every thread first waits for the
        cluster's turn (`dq_turn_pending`), and once all of the warpgroup's adds are done one
        thread adds 1 to the semaphore."""
        lane = cute.arch.thread_idx()[0]
        rows = TmemRows(addr_word)
        width = acc_columns(self.tile_m, self.hdim, self.cta_group)
        chunk = self.schedule.dq_chunk
        q_local = lane % self.half_m
        col0 = (lane // self.half_m) * width
        if work.has_steps:
            seq = work.seq
            g = seq.q_view(mdQaccum, work.head)
            phase = Int32(0)
            for i in cutlass.range(work.m_max - work.m_min, unroll=1):
                m = work.m_min + i
                q = pair_q_first(m, work.rank, self.schedule) + q_local
                sync.wait(pair.DQ_FULL, phase)
                sem = None
                if cutlass.const_expr(self.deterministic):
                    sem = work.semaphore(mdQsem, m)
                    self._wait_turn(work, sem, m)
                for c in cutlass.range_constexpr(width // chunk):
                    regs = rows.load(self.tmem.dq + c * chunk, chunk, lane)
                    if cutlass.const_expr(c == width // chunk - 1):
                        cute.arch.fence_view_async_tmem_load()
                        sync.arrive_leader(pair.DQ_READ)
                    if q < seq.seqlen_q:
                        row = g[q, None]
                        for j in cutlass.range_constexpr(chunk):
                            cute.arch.atomic_add((row.iterator + col0 + c * chunk + j)
                                                 .llvm_ptr, regs[j])
                if cutlass.const_expr(self.deterministic):
                    cute.arch.fence_acq_rel_gpu()
                    pipeline.NamedBarrier(barrier_id=_REDUCE_BARRIER,
                                          num_threads=128).arrive_and_wait()
                    if lane == 0:
                        pass_turn(sem)
                phase = phase ^ 1

    @cute.jit
    def _wait_turn(self, work, sem, m: Int32):
        """Spin until this cluster's turn at query tile `m` has come (acquire)."""
        seq = work.seq
        turn = dq_turn_of_pair(work.n_tile, m, self.schedule, seq.seqlen_q, seq.seqlen_k,
                               self.causal, work.win_left, work.win_right, imin=cutlass.min,
                               imax=cutlass.max)
        seen = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
        while dq_turn_pending(seen, turn, self.schedule):
            seen = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")

    # ---------------------------------------------------------------- relay warp

    @cute.jit
    def relay_role(self, work, sync):
        """The pair's CTA 1: once per query tile, its dS complete (its own rows and the
        leader's copy) → one arrival on the leader's PEER_SDS, which its MMA waits for."""
        if work.has_steps:
            phase = Int32(0)
            for _ in cutlass.range(work.m_max - work.m_min, unroll=1):
                sync.wait(pair.SDS_FULL, phase)
                with cute.arch.elect_one():
                    sync.relay(pair.PEER_SDS)
                phase = phase ^ 1

    # ---------------------------------------------------------------- tail warp

    @cute.jit
    def tail_role(self, work, rings, atoms, smem):
        """Varlen or seqused: every stage the load warp fills, in its order, is acknowledged
        by both CTAs on the leader's ready barrier, which the MMA waits for instead of the
        bytes; a stage whose tile runs past the sequence has those rows zeroed first, in
        each CTA by its own tail warp. The peer learns that its bytes landed from the
        leader, whose full barrier counts both CTAs' (an arrival on the peer's full barrier,
        unused otherwise). Which stages run past the sequence every role knows: the pair
        spans one query tile and one K/V tile."""
        kv, q, do, qt, dot = self._ring_states(pipeline.PipelineUserType.Consumer)
        if work.has_steps:
            # Tiled MMAs of its own: partitions the load warp made of the kernel's would be
            # reused here, outside the load warp's branch.
            thr = {name: mma.get_slice(work.rank) for name, mma in self._tiled_mmas().items()}
            coords = work.tile_coords(atoms, thr)
            seq = work.seq
            kv_tail = (work.n_tile + 1) * (self.cta_group * self.tile_n) > seq.seqlen_k
            parts = tuple(name for name in ("k", "v", "kt") if name in coords)
            kv = self._ack(work, rings["kv"], kv, kv_tail, smem, coords, parts, work.n_tile)
            for m in cutlass.range(work.m_min, work.m_max, unroll=1):
                tail = (m + 1) * self.tile_m > seq.seqlen_q
                q = self._ack(work, rings["q"], q, tail, smem, coords, ("q",), m)
                if cutlass.const_expr(self.separate_t):
                    qt = self._ack(work, rings["qt"], qt, tail, smem, coords, ("qt",), m)
                elif cutlass.const_expr(self.pair):
                    q = self._ack(work, rings["q"], q, tail, smem, coords, ("qt",), m)
                do = self._ack(work, rings["do"], do, tail, smem, coords, ("do",), m)
                if cutlass.const_expr(self.separate_t):
                    dot = self._ack(work, rings["dot"], dot, tail, smem, coords, ("dot",), m)
                elif cutlass.const_expr(self.pair):
                    do = self._ack(work, rings["do"], do, tail, smem, coords, ("dot",), m)

    @cute.jit
    def _ack(self, work, ring, state, tail, smem, coords, names, tile: Int32):
        """One stage of `ring`: landed (the leader: both CTAs' bytes, which it passes on to
        the peer), its rows past the sequence zeroed where `tail`, then this CTA's arrival
        on the leader's ready barrier. Returns the advanced state."""
        # The tiles' views, made here: a view first made inside the branch below would be
        # reused by the next stage's outside it.
        parts = tuple(self._tail_view(work, smem, coords, name, state.index, tile)
                      for name in names)
        ring.landed_wait(state)
        if cutlass.const_expr(self.pair):
            if work.is_leader:
                with cute.arch.elect_one():
                    ring.landed_signal_peer(state)
        if tail:
            self._clear(parts)
        with cute.arch.elect_one():
            if cutlass.const_expr(self.pair):
                ring.ready_arrive(state)
            else:
                ring.ready_arrive_local(state)
        state.advance()
        return state

    def _tail_view(self, work, smem, coords, name: str, stage: Int32, tile: Int32) -> tuple:
        """(this CTA's stage of `name`, the coordinates in the tile of its elements, the
        token's mode in them, the tokens of the tile inside the sequence)."""
        local, token, tokens = coords[name]
        seqlen = work.seq.seqlen_k if name in ("k", "v", "kt") else work.seq.seqlen_q
        return (smem.stages(name)[None, None, None, stage], local, token,
                seqlen - tile * tokens)

    @cute.jit
    def _clear(self, parts):
        """Zero the elements of each (stage, coordinates, token mode, end) of `parts` whose
        token (a query or a key) lies past the sequence, then hand them to the tensor cores
        (a fence to the async proxy; the warp's lanes in step before one arrives)."""
        for p in cutlass.range_constexpr(len(parts)):
            dst, src, token, limit = parts[p]
            zero = dst.element_type(0)
            for i in cutlass.range(cute.arch.lane_idx(), cute.size(dst), 32, unroll=1):
                if src[i][token] >= limit:
                    dst[i] = zero
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()


class Work(DslState):
    """This CTA's K/V tile: its cluster's tile and its rank in it, the query head and batch
    entry, the sequence (`SeqInfo`), the query tiles its cluster visits, the windows."""

    def __init__(self, cfg: BlackwellBwd, cu_seqlens, seqused, window_left: Int32,
                 window_right: Int32, max_seqlen_q, tQ, tK, qheads_per_kvhead: Int32,
                 block_mask=None):
        self.cfg = cfg
        _, head, batch = cute.arch.block_idx()
        bx = pair.block_x()
        self.rank = bx % cfg.cta_group
        self.n_tile = bx // cfg.cta_group
        self.head = head
        self.head_kv = head // qheads_per_kvhead
        cu_q, cu_k = cu_seqlens
        used_q, used_k = seqused
        extent_q = tQ.shape[0]
        extent_k = tK.shape[0]
        self.seq = SeqInfo(batch, extent_q, extent_k, cu_q, cu_k, used_q, used_k,
                           max_seqlen_q=max_seqlen_q)
        self.win_left = window_left if cutlass.const_expr(cfg.has_window_left) else None
        self.win_right = window_right if cutlass.const_expr(cfg.has_window_right) else None
        self.m_min, self.m_max = m_block_range(
            self.n_tile, cfg.tile_m, cfg.cta_group * cfg.tile_n, self.seq.seqlen_q,
            self.seq.seqlen_k, cfg.causal, self.win_left, self.win_right, imin=cutlass.min,
            imax=cutlass.max)
        # A block mask's tile states, and its ranges of non-empty query tiles per key tile:
        # the cluster visits those of either of its key tiles (each CTA masks the tiles
        # empty for it by their state).
        self.block_states, ranges = block_mask_parts(block_mask)
        if cutlass.const_expr(cfg.block_sparse):
            start, end = Int32(2 ** 30), Int32(0)
            for r in range(cfg.cta_group):
                lo, hi = block_ranges(cfg, ranges, batch, head, self.n_tile * cfg.cta_group + r)
                start = cutlass.select_(hi > lo, cutlass.min(start, lo), start)
                end = cutlass.select_(hi > lo, cutlass.max(end, hi), end)
            self.m_min, self.m_max = narrow_pair(self.m_min, self.m_max, start, end,
                                                 imin=cutlass.min, imax=cutlass.max)
        # Uniform over the cluster: a tile inside the keys with a query tile to visit.
        self.has_steps = (pair_kv_first(self.n_tile, 0, cfg.schedule) < self.seq.seqlen_k) & (
            self.m_max > self.m_min)

    @property
    def is_leader(self):
        return self.rank == pair.LEADER

    def semaphore(self, mdQsem: cute.Tensor, m_block: Int32) -> cute.Pointer:
        """Query tile `m_block`'s dQ semaphore (int32 [b, h, query tiles])."""
        return mdQsem.iterator + cute.crd2idx((self.seq.batch, self.head, m_block),
                                              mdQsem.layout)

    def views(self, atoms, thr, smem) -> dict:
        """name -> (global tiles, shared stages) of each TMA load, partitioned for this
        CTA's half of its MMA (`tma_partition`)."""
        out = {}
        for name, g in self.coords(atoms, thr).items():
            s_part, g_part = tma_partition(atoms[name][0], smem.stages(name), g, 3)
            out[name] = (g_part, s_part)
        return out

    def tile_coords(self, atoms, thr) -> dict:
        """name -> (the coordinates inside one tile of each TMA load, partitioned as this
        CTA's half of its MMA's operand, element for element as its shared stages; the
        token's mode in them; the tile's tokens)."""
        t = self.cfg._tilers()
        out = {}
        for name, mma, part in (("k", "s", "A"), ("v", "dp", "A"), ("q", "s", "B"),
                                ("do", "dp", "B"), ("qt", "dk", "B"), ("dot", "dv", "B"),
                                ("kt", "dq", "B")):
            if cutlass.const_expr(name not in atoms):
                continue
            if cutlass.const_expr(name in ("qt", "dot", "kt")):
                tile, token = (t[mma][1], t[mma][2]), 1   # (head dim, tokens)
            else:
                tile, token = (t[mma][0] if part == "A" else t[mma][1], t[mma][2]), 0
            ident = cute.make_identity_tensor(tile)
            g = thr[mma].partition_A(ident) if cutlass.const_expr(part == "A") else \
                thr[mma].partition_B(ident)
            out[name] = (g, token, tile[token])
        return out

    def coords(self, atoms, thr) -> dict:
        """name -> the global coordinates of each TMA load's tiles, partitioned as this
        CTA's half of its MMA's operand (element for element as its shared stages)."""
        cfg, seq = self.cfg, self.seq
        out = {}
        t = cfg._tilers()
        for name, mma, part, side in (("k", "s", "A", "k"), ("v", "dp", "A", "k"),
                                      ("q", "s", "B", "q"), ("do", "dp", "B", "q"),
                                      ("qt", "dk", "B", "qt"), ("dot", "dv", "B", "qt"),
                                      ("kt", "dq", "B", "kt")):
            if cutlass.const_expr(name not in atoms):
                continue
            coords = atoms[name][1]
            head = self.head_kv if cutlass.const_expr(side in ("k", "kt")) else self.head
            if cutlass.const_expr(side in ("k", "q")):
                offset = seq.offset_k if cutlass.const_expr(side == "k") else seq.offset_q
                view = _rows_view(cfg, coords, head, seq.batch, offset)
                tile = (t[mma][0] if part == "A" else t[mma][1], t[mma][2])
            else:
                offset = seq.offset_k if cutlass.const_expr(side == "kt") else seq.offset_q
                view = _cols_view(cfg, coords, head, seq.batch, offset)
                tile = (t[mma][1], t[mma][2])
            g = cute.flat_divide(view, tile)
            out[name] = thr[mma].partition_A(g) if cutlass.const_expr(part == "A") else \
                thr[mma].partition_B(g)
        return out


def _tile(src: cute.Tensor, name: str, index: Int32) -> cute.Tensor:
    """Tile `index` of a TMA-partitioned global tensor: rows-first views divide as (TMA,
    tiles, 1), head-dim-first ones (Qᵀ, dOᵀ, Kᵀ) as (TMA, 1, tiles)."""
    if name in ("qt", "dot", "kt"):
        return src[None, 0, index]
    return src[None, index, 0]


def _rows_view(cfg, coords, head, batch, offset):
    """(rows, d) of a rows-first TMA coordinate tensor for one head."""
    if cutlass.const_expr(cfg.varlen):
        return cute.domain_offset((offset, 0), coords[None, None, head])
    return coords[None, None, head, batch]


def _cols_view(cfg, coords, head, batch, offset):
    """(d, rows) of a head-dim-first TMA coordinate tensor for one head."""
    if cutlass.const_expr(cfg.varlen):
        return cute.domain_offset((0, offset), coords[None, None, head])
    return coords[None, None, head, batch]


class Smem(DslState):
    """The shared-memory tiles, as the TMA and the MMAs see them."""

    def __init__(self, cfg: BlackwellBwd, storage, layouts):
        self.cfg = cfg

        def tile(field, layout):
            return field.get_tensor(layout.outer, swizzle=layout.inner)

        def view(like, layout):
            return cute.make_tensor(cute.recast_ptr(like.iterator, layout.inner,
                                                    dtype=cfg.dtype), layout.outer)
        self.sK = tile(storage.sK, layouts["k"])
        self.sV = tile(storage.sV, layouts["v"])
        self.sQ = tile(storage.sQ, layouts["q"])
        self.sdO = tile(storage.sdO, layouts["do"])
        self.sdS = tile(storage.sdS, layouts["ds"])
        if cutlass.const_expr(cfg.separate_t):
            self.sQt = tile(storage.sQt, layouts["qt"])
            self.sdOt = tile(storage.sdOt, layouts["dot"])
        else:
            # One CTA: MN-major views of the same tiles; the pair at (192, 128): the tiles
            # loaded into Q's and dO's slots after them.
            self.sQt = view(self.sQ, layouts["qt"])
            self.sdOt = view(self.sdO, layouts["dot"])
        if cutlass.const_expr(cfg.pair):
            self.sKt = tile(storage.sKt, layouts["kt"])
            self.sXchg = tile(storage.sXchg, layouts["xchg"])
            self.xchg_bytes = cute.size_in_bytes(cfg.dtype, layouts["xchg"])
        else:
            self.sKt = view(self.sK, layouts["kt"])
        if cutlass.const_expr(cfg.folded):
            self.sPt = tile(storage.sPt, layouts["p"])
            self.sdSt = tile(storage.sdSt, layouts["dst"])

    def stages(self, name: str):
        return {"k": self.sK, "v": self.sV, "q": self.sQ, "do": self.sdO, "qt": self.sQt,
                "dot": self.sdOt, "kt": self.sKt}[name]

    def fragments(self, mmas) -> dict:
        out = {}
        if cutlass.const_expr(self.cfg.folded):
            out = {"pt": mmas["dv"].make_fragment_A(self.sPt)[None, None, None, 0],
                   "dst": mmas["dk"].make_fragment_A(self.sdSt)[None, None, None, 0]}
        return out | {"k": mmas["s"].make_fragment_A(self.sK),
                "q": mmas["s"].make_fragment_B(self.sQ),
                "v": mmas["dp"].make_fragment_A(self.sV),
                "do": mmas["dp"].make_fragment_B(self.sdO),
                "dot": mmas["dv"].make_fragment_B(self.sdOt),
                "qt": mmas["dk"].make_fragment_B(self.sQt),
                "ds": mmas["dq"].make_fragment_A(self.sdS),
                "kt": mmas["dq"].make_fragment_B(self.sKt)}

    def ds_row(self, s: cute.Tensor, part: Int32, key: Int32, chunk: int) -> cute.Tensor:
        """Chunk `chunk` (`_DS_CHUNK` rows) of part `part` (64 query rows) of key column
        `key` of a dS tile in the dQ MMA's A layout ((rows, 16 keys), 1, key groups, 1),
        rows contiguous."""
        col = s[((None, key % 16), 0, key // 16, 0)]
        per_part = self.cfg.wg_cols // _DS_CHUNK
        return cute.local_tile(col, (_DS_CHUNK,), (part * per_part + chunk,))


class TmemRows(DslState):
    """A thread's TMEM lane (its row) over a run of columns, through registers: 32x32b
    loads and stores, a thread per lane, the warp's quarter of the lanes."""

    def __init__(self, addr_word: cute.Pointer):
        self.ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, addr_word)

    def _view(self, column, width: int):
        return cute.make_tensor(self.ptr + column,
                                cute.make_layout((128, width), stride=(_LANE, 1)))

    def load(self, column, width: int, lane: Int32) -> cute.Tensor:
        view = self._view(column, width)
        atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(width)),
                                   Float32)
        copy = tcgen05.make_tmem_copy(atom, view)
        thr = copy.get_slice(lane)
        src = thr.partition_S(view)
        dst = cute.make_rmem_tensor(thr.partition_D(cute.make_identity_tensor((128, width)))
                                    .shape, Float32)
        cute.copy(copy, src, dst)
        return cute.make_tensor(dst.iterator, cute.make_layout(width))

    def store_halves(self, column, values: cute.Tensor, lane: Int32, dtype):
        """`values` in 16-bit, two to a 32-bit column, from `column` on."""
        words = cute.size(values) // 2
        view = self._view(column, words)
        atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(words)),
                                   Float32)
        copy = tcgen05.make_tmem_copy(atom, view)
        thr = copy.get_slice(lane)
        dst = thr.partition_D(view)
        src = cute.make_rmem_tensor(thr.partition_S(cute.make_identity_tensor((128, words)))
                                    .shape, Float32)
        packed = cute.make_tensor(cute.recast_ptr(src.iterator, dtype=dtype),
                                  cute.make_layout(2 * words))
        packed.store(values.load().to(dtype))
        cute.copy(copy, src, dst)


class TmemAcc(DslState):
    """The MMAs' accumulators in TMEM at the plan's columns (`config.bwd_tmem_plan`), and Pᵀ
    and dSᵀ as the dV and dK MMAs' TMEM operands."""

    def __init__(self, cfg: BlackwellBwd, addr_word: cute.Pointer, mmas, layouts):
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, addr_word)
        t = cfg._tilers()
        plan = cfg.tmem

        def acc(name, column):
            thr = mmas[name].get_slice(0)
            layout = thr.make_fragment_C(thr.partition_shape_C(t[name][:2])).layout
            return cute.make_tensor(tmem_ptr + column, layout)

        def operand(name, layout_name, column):
            frag = mmas[name].make_fragment_A(cute.make_tensor(tmem_ptr,
                                                               layouts[layout_name].outer))
            frag = frag[None, None, None, 0]
            return cute.make_tensor(cute.recast_ptr(tmem_ptr + column, dtype=frag.dtype),
                                    frag.layout)
        self.s, self.dp = acc("s", plan.s), acc("dp", plan.dp)
        self.dv, self.dk, self.dq = acc("dv", plan.dv), acc("dk", plan.dk), acc("dq", plan.dq)
        if cutlass.const_expr(not cfg.folded):
            self.p_operand = operand("dv", "p", plan.s)
            self.ds_operand = operand("dk", "dst", plan.region("ds").start)
