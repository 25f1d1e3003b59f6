"""FlashAttention-3 forward on sm90a: TMA + mbarrier pipelines + WGMMA, warp-specialized, with
FA3's intra-warpgroup overlap and inter-warpgroup ping-pong, each switchable, a
persistent tile scheduler and a TMA-store epilogue.

Each CTA works through (query tile of 128 or 192 rows, head, batch) tiles (packed GQA: the
query heads of one K/V head share a tile) in the order of `flash_cute.contract.tile_order` (one
tile per CTA, or persistent). Warpgroup 0 produces (one warp issues every TMA load); the
others (two, or three for 192 rows) consume: each owns 64 query rows of a tile and runs
S = Q Kᵀ, the online softmax and O += P V for them. K and V flow through two mbarrier rings that
share one producer/consumer state (stage i of the K ring and stage i of the V ring hold the same
block); the states carry from tile to tile.
"""

import enum
import functools
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from flash_cute.arch.sm90plus.barriers import named_barriers
from flash_cute.arch.sm90plus.convert import convert_pairs
from flash_cute.arch.sm90plus.tma import (
    COLS_FIRST,
    ROWS_FIRST,
    clear_tails,
    make_tma_pipelines,
    packed_tma_atom,
    permute,
    smem_tile,
    tma_load_atom,
    tma_partition,
)
from flash_cute.blocks.dropout import Dropout
from flash_cute.blocks.dsl_state import DslState
from flash_cute.blocks.kv_append import append_rows, count_dropped
from flash_cute.blocks.layouts import (
    acc_to_mn,
    acc_to_operand_a,
    assume_aligned_strides,
    pack_heads,
)
from flash_cute.blocks.lse_merge import SplitArrivals, merge_rows
from flash_cute.blocks.mask import AttentionMask
from flash_cute.blocks.score import (
    Scores,
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
from flash_cute.blocks.timeline import Timeline
from flash_cute.blocks.work_loop import for_each_tile, num_sms
from flash_cute.contract.block_range import block_range, block_runs, narrow, split_range
from flash_cute.contract.kernel_args import FwdArgs
from flash_cute.contract.tile_order import TileOrder, launch_grid, pairs_per_section
from flash_cute.contract.variant import Variant, kernel_head_dims

from .config import (
    CTA_PAIR_SMEM,
    CTAS_PER_SM,
    FWD_SCHEDULES,
    PAGED_ROLE_REGISTERS,
    ROLE_REGISTERS,
    SMEM_CAPACITY,
    FwdSchedule,
    check_role_registers,
    o_smem_tile,
    smem_bytes,
)
from .paged import PagedBlocks, page_chunk, paged_tma_atoms
from .wgmma import WARPGROUP_THREADS, wgmma_slice


@named_barriers
class FwdBarrier(enum.IntEnum):
    """The forward's named barriers (the pipelines use mbarriers)."""
    PINGPONG = 1  # 1 + w: consumer warpgroup w's ping-pong turn (`GemmTurns`)
    PINGPONG_WG1 = 2
    PINGPONG_WG2 = 3
    O_TILE = 4  # the consumer threads around O's shared-memory tile (`OutputStore`)
    V_TAIL = 5  # the consumer threads, after zeroing V rows past a varlen sequence
    SPLIT_MERGE = 6  # the consumer threads, around a split's count (`lse_merge.SplitArrivals`)

# The consumer warp that issues O's TMA store (the first of consumer warpgroup 1).
_O_STORE_WARP = 4


class HopperFwd:
    """Forward kernel: O = softmax(Q Kᵀ · scale) V and LSE, over (query tile, head, batch) tiles.

    | warpgroup | warps | registers | role                                                    |
    |-----------|-------|-----------|---------------------------------------------------------|
    | 0         | 0     | 24 (32)   | producer: per tile, TMA of Q, then K[n], V[n] per block  |
    | 0         | 1..3  | 24 (32)   | idle (setmaxnreg is warpgroup-wide, so they stay)        |
    | 1         | 4..7  | 240 (160) | consumer: rows 0..63 — QKᵀ, mask, softmax, PV, epilogue; |
    |           |       |           | warp 4 also issues O's TMA store                         |
    | 2         | 8..11 | 240 (160) | consumer: rows 64..127 — same                            |
    | (3)       | 12..15| (160)     | consumer: rows 128..191 of a 192-row tile — same         |

    Registers in parentheses: a 192-row tile (`config.ROLE_REGISTERS`: all 65536 registers
    go to the roles either way); paged K/V moves 8 per consumer thread to the producer
    (40 / 232, `config.PAGED_ROLE_REGISTERS`). A 64-row tile has warpgroup 1 alone as its
    consumer (24 / 232) and runs two CTAs per SM (`config.CTAS_PER_SM`: 128 registers a
    thread at launch, at most `config.CTA_PAIR_SMEM` of shared memory each).

    | pipeline (PipelineTmaAsync) | stages | full barrier           | empty barrier          |
    |-----------------------------|--------|------------------------|------------------------|
    | Q                           | 1      | TMA bytes of the Q tile | 4 per consumer warpgroup |
    | K                           | 2      | TMA bytes of a K tile  | 4 per consumer warpgroup |
    | V                           | 2      | TMA bytes of a V tile  | 4 per consumer warpgroup |

    | named barrier | threads | use                                                     |
    |---------------|---------|---------------------------------------------------------|
    | 1, 2 (, 3)    | 256     | ping-pong turns of consumer warpgroup 1, 2 (, 3) (`GemmTurns`) |
    | 4 | 128 x consumer warpgroups | O's shared tile: free to write, then written (`OutputStore`) |
    | 5 | 128 x consumer warpgroups | varlen: V rows past seqlen_k zeroed (`clear_v_tail`) |

    Tiles (`flash_cute.contract.tile_order`): m_block fastest, or for causal and right windows
    heaviest first (m_block descending within L2-sized sections of heads). With ``persistent``
    off the grid has one CTA per tile; on, min(tiles, SMs) CTAs each take every grid-th tile
    number, and causal tiles are folded into (heavy, light) pairs so that this static round
    robin stays balanced. Every role walks the same numbers and skips, as one, a tile with no
    rows (varlen past its sequence, or an empty number of the folded order). The K/V ring
    states run on from tile to tile; Q is loaded per tile and released when the consumers no
    longer read it, so the producer loads the next tile's Q and first K/V blocks while the
    consumers run this tile's epilogue.

    K/V blocks are visited right to left over `block_range` (masked blocks first). S = Q K[n]ᵀ
    runs with both operands in shared memory, O += P V[n] with P (16-bit) as the register A
    operand; softcap, mask and the online softmax run in registers. The schedule (`FwdSchedule`):

    * ``intra_wg_overlap``: S[n-1] and P[n] V[n] are issued together; the softmax of S[n-1]
      runs while that PV is in flight, O is rescaled after it lands, or without ping-pong
      after the next S is issued (`mainloop_overlapped`, `OverlappedStep.prev_scale`).
      Off: S, wait, softmax, PV, wait (`mainloop_serial`).
    * ``pingpong``: the two consumer warpgroups take turns issuing their WGMMAs, so one's
      softmax overlaps the other's GEMMs (`GemmTurns`; the turns run on across tiles).
    * ``persistent``: the static persistent grid above (the SM count is read from the driver
      when the kernel is compiled, `work_loop.num_sms`).

    Epilogue (`OutputStore`): padded inputs stage O (in dtype) in a swizzled shared tile by
    stmatrix and leave it with one TMA store per tile, which clips the rows past seqlen_q.
    Where that tile does not fit beside Q and the K/V rings (hdim 192 and 256) it is Q's tile,
    and Q is released only once the store has read it. Varlen: a tile's rows past its
    sequence are the next sequence's, and with seqused_q padding rows that stay 0, so O goes
    from registers with row predicates. LSE is stored by the first thread of each row's quad.
    Varlen and seqused_k: V rows past seqlen_k are zeroed in shared memory (`clear_v_tail`).

    Packed GQA (``pack_gqa`` = g > 1, g dividing tile_m): a tile holds the g query heads of
    one K/V head, rows interleaved (tile row r is query (m_block * tile_m + r) // g of head
    r % g), so the tiles run over (packed query tile, K/V head, batch) and each K/V block is
    loaded once for the group. Q and O move by TMA over a (heads, rows) box
    (`tma.packed_tma_atom`), LSE and row-stored O through `layouts.pack_heads` views, and the
    block range and mask see queries, not rows (their ``pack``).

    Split-KV (``split_kv``): the tile order counts heads x splits; a tile visits its split's
    blocks (`block_range.split_range`) and stores O (fp32) and LSE from registers into its
    split's partials; the last split of a tile to store merges the tile's partials into O
    and LSE in the kernel (`lse_merge.SplitArrivals`, `merge_rows`: one warp per row, one
    int32 count per tile that the merger sets back to 0). Paged K/V (``page_size``):
    the producer gathers each K/V block from the page table, box by box (`paged`); the
    consumers see the same stages as with a dense cache.
    """

    # Split-KV partials are merged by the kernel itself (`merge_if_last`), not after it.
    merges_splits = True
    # exp2 units subtracted from the row max before the exponentials: P is 2^offset times
    # larger, and so is the row sum it is divided by (the FP8 forward's P x 256).
    p_max_offset = 0.0

    def pipeline(self):
        """This kernel's pipeline as data (`flash_cute.contract.pipeline`)."""
        from .pipelines import forward
        return forward(self)

    def __init__(self, dtype, hdim: int, hdim_v: Optional[int] = None,
                 variant: Variant = Variant(), schedule: Optional[tuple] = None):
        # P's dtype, the PV GEMM's A operand (the FP8 forward's is e4m3 for any FP8 input).
        self.dtype = self.out_dtype = self.p_dtype = dtype
        self.hdim, self.hdim_v = kernel_head_dims("hopper", hdim, hdim_v, FWD_SCHEDULES,
                                                  schedule)
        set_kernel_switches(self, variant)
        schedule = FwdSchedule(*(schedule or FWD_SCHEDULES[hdim]))
        self.tile_m, self.tile_n, self.kv_stages = schedule[:3]
        self.intra_wg_overlap, self.pingpong = schedule.intra_wg_overlap, schedule.pingpong
        self.persistent = schedule.persistent
        self.num_wg = self.tile_m // 64
        if self.tile_m % 64 or self.num_wg not in ROLE_REGISTERS:
            raise ValueError(f"tile_m must be 64 x {sorted(ROLE_REGISTERS)} (64 rows per "
                             f"consumer warpgroup), got {self.tile_m}")
        self.producer_registers, self.consumer_registers = ROLE_REGISTERS[self.num_wg]
        if self.page_size and self.num_wg in PAGED_ROLE_REGISTERS:
            self.producer_registers, self.consumer_registers = PAGED_ROLE_REGISTERS[self.num_wg]
        self.ctas_per_sm = CTAS_PER_SM.get(self.num_wg, 1)
        check_role_registers(self.producer_registers, self.consumer_registers, self.num_wg,
                             self.ctas_per_sm)
        if self.num_wg == 3 and not self.persistent:
            raise ValueError("192-row tiles run persistent only (one CTA per tile spills "
                             "at 160 registers)")
        if self.tile_n % 16:
            raise ValueError("tile_n must be a multiple of 16 (the K of the P V WGMMA)")
        if self.tile_m % self.pack_gqa:
            raise ValueError(f"pack_gqa {self.pack_gqa} must divide tile_m {self.tile_m}")
        self.num_threads = 128 * (1 + self.num_wg)
        # Longest-processing-time-first where a query tile's work grows with m_block, as it
        # does for the masks block masks mostly carry (causal-like: document, prefix-LM,
        # sliding window); for any other the order is a permutation of the plain one.
        self.block_sparse = getattr(self.mods, "sparse", False)
        self.lpt = self.causal or self.has_window_right or self.block_sparse
        self.o_tile = o_smem_tile(self.hdim, self.hdim_v, self._smem_schedule,
                                  self._rows_past_sequence)
        self.page_chunk = page_chunk(self.tile_n, self.page_size) if self.page_size else 0

    @property
    def _rows_past_sequence(self) -> bool:
        """Whether O leaves by row stores, not a TMA store of the whole tile: a query tile's
        rows past its sequence are rows of the output tensor that must stay as they are
        (varlen: the next sequence's; seqused_q: padding left at 0), or (split-KV) O is an
        fp32 partial, written once and read once by the merge."""
        return self.varlen or self.has_seqused_q or self.split_kv

    @property
    def _smem_schedule(self) -> tuple:
        return (self.tile_m, self.tile_n, self.kv_stages)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory (the kernel's SharedStorage; checked against it at compile)."""
        return smem_bytes(self.hdim, self.hdim_v, self._smem_schedule, self._rows_past_sequence)

    # ---------------------------------------------------------------- host side

    @cute.jit
    def __call__(self, args: FwdArgs, stream: cuda.CUstream):
        """`args`: a `kernel_args.FwdArgs` (its docstring gives the layouts)."""
        vec = 128 // self.dtype.width
        # TMA needs 16-byte global strides; validation guarantees them, this tells the compiler.
        mQ, mK, mV = (assume_aligned_strides(t, vec) for t in (args.q, args.k, args.v))
        # A split-KV partial is fp32, allocated by the launch with 16-byte rows.
        mO = assume_aligned_strides(args.out, 128 // args.out.element_type.width)
        mLSE, mCuSeqlensQ = args.lse, args.cu_seqlens_q
        mma_qk, mma_pv = self._tiled_mmas()
        layouts = self._smem_layouts()
        sQ_layout, sK_layout, sV_layout, sO_layout = layouts

        if cutlass.const_expr(self.page_size > 0):
            tma_k, tK, tma_v, tV = paged_tma_atoms(self, mK, mV, sK_layout, sV_layout)
        else:
            rows_first, back_rows = ROWS_FIRST[self.varlen]
            cols_first, back_cols = COLS_FIRST[self.varlen]
            tma_k, tK = tma_load_atom(mK, rows_first, sK_layout, (self.tile_n, self.hdim))
            tma_v, tV = tma_load_atom(mV, cols_first, sV_layout, (self.hdim_v, self.tile_n))
            tK, tV = permute(tK, back_rows), permute(tV, back_cols)
        tma_q, tQ, tma_o, mO, mLSE = self._q_o_lse(mQ, mO, mLSE, sQ_layout, sO_layout)
        merged = None
        if cutlass.const_expr(self.split_kv):
            out_vec = 128 // self.out_dtype.width
            merged = (*self._packed_rows(assume_aligned_strides(args.merged_out, out_vec),
                                         args.merged_lse, 0), args.split_counts)

        SharedStorage = self._shared_storage(layouts)
        capacity = SMEM_CAPACITY if self.ctas_per_sm == 1 else CTA_PAIR_SMEM
        if cutlass.const_expr(SharedStorage.size_in_bytes() != self.smem_bytes
                              or self.smem_bytes > capacity):
            raise ValueError(f"shared memory: {SharedStorage.size_in_bytes()} B (estimated "
                             f"{self.smem_bytes}), capacity {capacity} "
                             f"({self.ctas_per_sm} CTA(s) per SM)")
        tx_bytes = tuple(cute.size_in_bytes(self.dtype, cute.slice_(layout, (None, None, 0)))
                         for layout in (sQ_layout, sK_layout, sV_layout))
        order = self._tile_order(tQ, mK, args.max_seqlen_q, mCuSeqlensQ, args.num_splits,
                                 args.page_table)
        grid = launch_grid(order.num_tiles, self.persistent, num_sms(), imin=cutlass.min)
        scale_log2, mod_scale = fold_scores(self.score_mod, args.softmax_scale, args.softcap)
        self.kernel(
            tma_q, tQ, tma_k, tK, tma_v, tV, tma_o, mO, mLSE, scale_log2, mod_scale,
            args.window_left, args.window_right,
            # Varlen only (`SeqInfo`'s clamp): padded, no parameter moves the others.
            args.max_seqlen_q if cutlass.const_expr(self.varlen) else None, mCuSeqlensQ,
            args.cu_seqlens_k, args.seqused_q,
            args.seqused_k, order.num_m_blocks, order.section, sQ_layout, sK_layout, sV_layout,
            sO_layout, args.rng_seed, args.keep_threshold, args.dropout_scale, mQ.shape[-2],
            args.num_splits, args.blocks_per_split, args.page_table,
            self._append_tensors(mK, mV, args), aux_tensors(self, args),
            block_mask_tensors(self, args), merged, args.timeline, self._extra_args(args), mma_qk,
            mma_pv, SharedStorage, tx_bytes,
        ).launch(grid=(grid, 1, 1), block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=self.ctas_per_sm,
                 preferred_smem_carveout=100 if self.ctas_per_sm > 1 else None)

    def _extra_args(self, args: FwdArgs):
        """What a derived kernel's consumers read per tile (`_tile_scales`): nothing here."""
        return None

    def _append_tensors(self, mK, mV, args: FwdArgs):
        """(cache K, cache V, k_new, v_new, the dropped-rows counter) as global tensors for
        `kv_append` (None without the append)."""
        if cutlass.const_expr(not self.append):
            return None
        vec = 128 // self.dtype.width
        return (mK, mV) + tuple(assume_aligned_strides(t, vec) for t in (args.k_new, args.v_new)) \
            + (args.append_dropped,)

    def _q_o_lse(self, mQ, mO, mLSE, sQ_layout, sO_layout):
        """Q's TMA atom and coordinates; O's TMA store atom and coordinates (None and the
        plain tensor where O leaves by row stores, `o_tile` "none"); LSE. With packed GQA all
        three as their packed views (`tma.packed_tma_atom`, `layouts.pack_heads`). Split-KV:
        O and LSE keep their leading split mode (`OutputStore` slices it per tile)."""
        rows_first, back_rows = ROWS_FIRST[self.varlen]
        tma_o = None
        if cutlass.const_expr(self.pack_gqa > 1):
            tma_q, tQ = packed_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mQ, self.varlen,
                                        sQ_layout, (self.tile_m, self.hdim), self.pack_gqa)
            if cutlass.const_expr(self.o_tile != "none"):
                _, mLSE = self._packed_rows(None, mLSE, 0)
                tma_o, mO = packed_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO, self.varlen,
                                            sO_layout, (self.tile_m, self.hdim_v), self.pack_gqa)
            else:
                mO, mLSE = self._packed_rows(mO, mLSE, int(self.split_kv))
            return tma_q, tQ, tma_o, mO, mLSE
        tma_q, tQ = tma_load_atom(mQ, rows_first, sQ_layout, (self.tile_m, self.hdim))
        if cutlass.const_expr(self.o_tile != "none"):
            tma_o, tO = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), permute(mO, rows_first),
                cute.slice_(sO_layout, (None, None, 0)), (self.tile_m, self.hdim_v))
            mO = permute(tO, back_rows)
        return tma_q, permute(tQ, back_rows), tma_o, mO, mLSE

    def _packed_rows(self, mO, mLSE, lead: int):
        """O (None: left out) and LSE as O leaves by row stores: packed GQA's views
        (`layouts.pack_heads`), else as they are; `lead` leading modes (a split's) kept."""
        if cutlass.const_expr(self.pack_gqa == 1):
            return mO, mLSE
        row_mode = 2 - self.varlen + lead
        mLSE = pack_heads(mLSE, row_mode, row_mode - 1, self.pack_gqa)
        if cutlass.const_expr(mO is not None):
            mO = pack_heads(mO, row_mode - 1, row_mode, self.pack_gqa)
        return mO, mLSE

    def _tile_order(self, tQ, mK, max_seqlen_q, mCuSeqlensQ, num_splits,
                    page_table) -> TileOrder:
        """The launch's `TileOrder` over (query tile, head, batch), from Q's TMA coordinates
        (packed GQA: their heads are the K/V heads; split-KV: heads x splits, `WorkTiles.at`).
        Varlen sizes the L2 sections by the mean K/V length (only the section size depends on
        it)."""
        batch = SeqInfo.num_batches(tQ, mCuSeqlensQ)
        section = Int32(1)
        if cutlass.const_expr(self.lpt):
            seqlen_k = mK.shape[0] // batch if cutlass.const_expr(self.varlen) else mK.shape[1]
            if cutlass.const_expr(self.page_size > 0):
                seqlen_k = page_table.shape[1] * self.page_size
            kv_bytes_per_key = (self.hdim + self.hdim_v) * self.dtype.width // 8
            section = pairs_per_section(seqlen_k, kv_bytes_per_key, imax=cutlass.max)
        heads = tQ.shape[-2] * num_splits if cutlass.const_expr(self.split_kv) else tQ.shape[-2]
        return TileOrder(cute.ceil_div(max_seqlen_q * self.pack_gqa, self.tile_m), heads,
                         batch, section, self.lpt, self.persistent)

    def _smem_layouts(self):
        """Q, K, V and O shared-memory layouts, each (rows, cols, stages), swizzled."""
        shape = (self.tile_m, self.tile_n, self.hdim)
        sQ = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, shape, self.dtype, 1)
        sK = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, shape, self.dtype,
                                           self.kv_stages)
        # V as the (hdim_v, tile_n) B operand, head dim contiguous: no transpose in shared memory.
        sV = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR,
                                           (self.tile_m, self.hdim_v, self.tile_n), self.dtype,
                                           self.kv_stages)
        # O laid out as Q is (rows of hdim_v, K-major swizzle); hdim_v <= hdim, so it fits in
        # Q's tile where it takes that one.
        sO = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR,
                                           (self.tile_m, self.tile_n, self.hdim_v),
                                           self.out_dtype, 1)
        return sQ, sK, sV, sO

    def _o_smem(self, storage, sO_layout):
        """The tile the epilogue stages O in for its TMA store (`o_tile`), or None."""
        sO = None
        if cutlass.const_expr(self.o_tile == "own"):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        elif cutlass.const_expr(self.o_tile == "q"):
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        return sO

    def _vt_layout(self):
        """A second V tile, transposed for the PV GEMM (the FP8 forward's); None here."""
        return None

    def _shared_storage(self, layouts):
        """The CTA's shared memory, as `config.smem_bytes` sizes it (with a transposed V ring
        and its barriers where `_vt_layout` gives one)."""
        sQ_layout, sK_layout, sV_layout, sO_layout = layouts
        sVt_layout = self._vt_layout()
        stages, dtype = self.kv_stages, self.dtype

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            if sVt_layout is not None:
                mbar_vt: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            if self.split_kv:
                merge_flag: cute.struct.MemRange[cutlass.Int32, 1]
            sQ: smem_tile(dtype, sQ_layout)
            sK: smem_tile(dtype, sK_layout)
            sV: smem_tile(dtype, sV_layout)
            if sVt_layout is not None:
                sVt: smem_tile(dtype, sVt_layout)
            if self.o_tile == "own":
                sO: smem_tile(self.out_dtype, sO_layout)

        return SharedStorage

    def _tiled_mmas(self):
        """S = Q Kᵀ (both from shared memory, K-major) and O = P V (P, of `p_dtype`, from
        registers; V MN-major as loaded, or K-major where V is transposed, `_vt_layout`); one
        64-row WGMMA atom per consumer warpgroup."""
        atoms = (self.num_wg, 1, 1)
        v_major = OperandMajorMode.MN if self._vt_layout() is None else OperandMajorMode.K
        mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, atoms,
            (64, self.tile_n))
        mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.p_dtype, self.dtype, OperandMajorMode.K, v_major, Float32, atoms,
            (64, self.hdim_v), a_source=warpgroup.OperandSource.RMEM)
        return mma_qk, mma_pv

    # ---------------------------------------------------------------- device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_o: Optional[cute.CopyAtom],
               mO: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32, mod_scale: Float32,
               window_left: Int32, window_right: Int32, max_seqlen_q: Optional[Int32],
               mCuSeqlensQ: Optional[cute.Tensor],
               mCuSeqlensK: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
               mSeqUsedK: Optional[cute.Tensor], num_m_blocks: Int32, section: Int32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               mSeed: Optional[cute.Tensor], keep_threshold: Int32, dropout_scale: Float32,
               nheads: Int32, num_splits: Int32, blocks_per_split: Int32,
               mPageTable: Optional[cute.Tensor], append_tensors, aux, block_mask, merged,
               mTimeline: Optional[cute.Tensor], extra, mma_qk: cute.TiledMma,
               mma_pv: cute.TiledMma,
               SharedStorage: cutlass.Constexpr, tx_bytes: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
        if cutlass.const_expr(tma_o is not None):
            if warp_idx == _O_STORE_WARP:
                cpasync.prefetch_descriptor(tma_o)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        pipes = self._pipelines(storage, tx_bytes)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sV_mma = self._v_operand(storage, sV)
        sO = self._o_smem(storage, sO_layout)
        tiles = WorkTiles(self, num_m_blocks, section, mQ, mK, (mCuSeqlensQ, mCuSeqlensK),
                          (mSeqUsedQ, mSeqUsedK), window_left, window_right, max_seqlen_q,
                          (num_splits, blocks_per_split), mPageTable, block_mask)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self.produce(tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipes[:3], tiles,
                             append_tensors, mTimeline)
            else:
                self.assist(storage, pipes, tiles)
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            tidx = cute.arch.thread_idx()[0] - 128
            out = OutputStore(self, mma_pv, tidx, tma_o, sO, mO, mLSE,
                              warp_idx == _O_STORE_WARP, self._arrivals(merged, storage, tidx))
            self.consume(mma_qk, mma_pv, tidx, sQ, sK, sV_mma, self._consumer_pipes(pipes),
                         tiles, out, scale_log2, mod_scale,
                         (mSeed, keep_threshold, dropout_scale, nheads), aux, mTimeline, extra)

    def _pipelines(self, storage, tx_bytes):
        """The mbarrier pipelines: Q, K and V, each filled by TMA and emptied by the consumer
        warps."""
        return make_tma_pipelines(((storage.mbar_q, 1, tx_bytes[0]),
                                   (storage.mbar_k, self.kv_stages, tx_bytes[1]),
                                   (storage.mbar_v, self.kv_stages, tx_bytes[2])),
                                  4 * self.num_wg)

    def _consumer_pipes(self, pipes):
        """(Q, K, V) as the consumers wait on them."""
        return pipes

    def _v_operand(self, storage, sV):
        """The tile the P V WGMMA reads V from: the TMA's own here."""
        return sV

    def assist(self, storage, pipes, tiles):
        """Producer warps 1..3: idle here (setmaxnreg is warpgroup-wide, so they stay)."""
        pass

    def _arrivals(self, merged, storage, tidx: Int32):
        """Split-KV: (merged O, merged LSE, the tile counts' `SplitArrivals`); else None."""
        if cutlass.const_expr(not self.split_kv):
            return None
        barrier = pipeline.NamedBarrier(barrier_id=FwdBarrier.SPLIT_MERGE.value,
                                        num_threads=128 * self.num_wg)
        flag = storage.merge_flag.get_tensor(cute.make_layout(1))
        return merged[0], merged[1], SplitArrivals(merged[2], flag, barrier, tidx)

    @cute.jit
    def produce(self, tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipes, tiles,
                append_tensors, mTimeline=None):
        """Warp 0 of the producer warpgroup, all 32 lanes, over this CTA's tiles."""
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        step = functools.partial(self.produce_tile, tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV,
                                 pipes, tiles, append_tensors, mTimeline)
        for_each_tile(tiles, self.persistent, step, (q_state, kv))

    @cute.jit
    def produce_tile(self, tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipes, tiles,
                     append_tensors, mTimeline, tile: Int32, q_state, kv):
        """TMA of one tile's Q and K/V blocks: `producer_acquire` elects the lane that arms the
        barrier, and the TMA copy elects its own issuing lane. The Q acquire waits until the
        consumers released the last tile's Q (see `OutputStore` for when that is). With the
        append, the new K/V rows among the tile's blocks are written first (`kv_append`)."""
        pipe_q = pipes[0]
        m_block, head, head_kv, seq, split = tiles.at(tile)
        if tiles.in_bounds(m_block, seq):
            rng = tiles.block_range(m_block, seq, split, head)
            gQ = cute.local_tile(seq.q_view(mQ, head), (self.tile_m, self.hdim), (m_block, 0))
            tQsQ, tQgQ = tma_partition(tma_q, sQ, gQ)
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            if cutlass.const_expr(self.append):
                # The raw seqused_k (the append's end, which may pass the cache: those
                # rows are dropped); seq.seqlen_k is it clamped, the rows read.
                cache_k, cache_v, k_new, v_new, dropped = append_tensors
                end = tiles.used_k[seq.batch]
                append_rows(cache_k, cache_v, k_new, v_new, tiles.page_table, self.page_size,
                            seq.batch, head_kv, end, tiles.seqlen_k,
                            rng.n_block_min * self.tile_n, rng.n_block_max * self.tile_n,
                            cute.arch.lane_idx(), 32)
                if m_block == 0 and head == 0 and split == 0:
                    # The sequence's first tile (every sequence has one) counts its drops.
                    count_dropped(dropped, k_new.shape[1], tiles.page_table, self.page_size,
                                  cache_k.shape[0], seq.batch, end, tiles.seqlen_k,
                                  cute.arch.lane_idx(), 32)
                cute.arch.sync_warp()
            if cutlass.const_expr(self.page_size > 0):
                kv = self.produce_paged(tma_k, tma_v, mK, mV, sK, sV, pipes, tiles, seq,
                                        head_kv, rng, kv)
            else:
                kv = self.produce_dense(tma_k, tma_v, mK, mV, sK, sV, pipes, seq, head_kv,
                                        rng, kv, self._trace(mTimeline, tile, rng))
        # Returned so the caller's tile loop rebinds them (the DSL carries plain locals only).
        return q_state, kv

    @cute.jit
    def produce_dense(self, tma_k, tma_v, tK, tV, sK, sV, pipes, seq: SeqInfo, head_kv: Int32,
                      rng, kv, trace=None):
        """The tile's K/V blocks, right to left, one TMA each."""
        _, pipe_k, pipe_v = pipes
        gK = cute.local_tile(seq.k_view(tK, head_kv), (self.tile_n, self.hdim), (None, 0))
        gVt = cute.local_tile(permute(seq.k_view(tV, head_kv), (1, 0)),
                              (self.hdim_v, self.tile_n), (0, None))
        tKsK, tKgK = tma_partition(tma_k, sK, gK)
        tVsV, tVgV = tma_partition(tma_v, sV, gVt)
        for i in cutlass.range(rng.n_block_max - rng.n_block_min, unroll=1):
            n_block = rng.n_block_max - 1 - i
            pipe_k.producer_acquire(kv)
            cute.copy(tma_k, tKgK[None, n_block], tKsK[None, kv.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(kv))
            self._mark(trace, "load_issued", n_block)
            pipe_v.producer_acquire(kv)
            cute.copy(tma_v, tVgV[None, n_block], tVsV[None, kv.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(kv))
            kv.advance()
        return kv

    @cute.jit
    def produce_paged(self, tma_k, tma_v, tK, tV, sK, sV, pipes, tiles, seq: SeqInfo,
                      head_kv: Int32, rng, kv):
        """The tile's K/V blocks, right to left, each gathered box by box from its pages
        (`paged.PagedBlocks`)."""
        blocks = PagedBlocks(self, tma_k, tK, tma_v, tV, sK, sV, tiles.page_table, seq.batch,
                             head_kv)
        return blocks.load_all(pipes[1], pipes[2], kv, rng)

    @cute.jit
    def consume(self, mma_qk, mma_pv, tidx, sQ, sK, sV, pipes, tiles, out, scale_log2,
                mod_scale, dropout_args, aux, mTimeline=None, extra=None):
        """One consumer warpgroup's 64 rows of each of this CTA's tiles (thread index relative
        to the first consumer, so the tiled MMAs place warpgroup 1 on rows 0..63, warpgroup 2
        on rows 64..127 and so on). Ping-pong turns start once and run on across tiles: every
        warpgroup takes the same number of turns per tile."""
        thr_qk, thr_pv = mma_qk.get_slice(tidx), mma_pv.get_slice(tidx)
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        gemms = self._operands(mma_qk, mma_pv, thr_qk, thr_pv, wg, sQ, sK, sV)
        coord_mn = acc_to_mn(thr_qk.partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n))))
        turns = GemmTurns(self.pingpong, wg, self.num_wg)
        turns.start()
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        step = functools.partial(self.consume_tile, gemms, coord_mn, turns, pipes, tiles, out,
                                 scale_log2, mod_scale, dropout_args, aux, mTimeline, extra)
        for_each_tile(tiles, self.persistent, step, (q_state, kv))
        turns.finish()
        out.drain()

    def _operands(self, mma_qk, mma_pv, thr_qk, thr_pv, wg, sQ, sK, sV):
        return WgmmaOperands(self, mma_qk, mma_pv, thr_qk, thr_pv, wg, sQ, sK, sV)

    def _softmax_step(self, softmax, seam, coord_mn, m_block, rng, drop, seq, head, head_kv,
                      extra):
        """The tile's `SoftmaxStep` (`head`: the tile's, a K/V head when packed)."""
        return SoftmaxStep(self, softmax, seam, coord_mn, m_block, rng, drop)

    def _tile_scales(self, scale_log2, mod_scale, seq: SeqInfo, head_kv: Int32, extra):
        """(exp2 scale, score-mod scale, O's final factor) of one tile: the launch's here."""
        return scale_log2, mod_scale, Float32(1.0)

    @cute.jit
    def consume_tile(self, gemms, coord_mn, turns, pipes, tiles, out, scale_log2, mod_scale,
                     dropout_args, aux, mTimeline, extra, tile: Int32, q_state, kv):
        """One tile: main loop, softmax finalize, epilogue. Returns the Q and K/V states for
        the next tile."""
        pipe_q = pipes[0]
        m_block, head, head_kv, seq, split = tiles.at(tile)
        if tiles.in_bounds(m_block, seq):
            rng = tiles.block_range(m_block, seq, split, head)
            acc_o = gemms.new_acc_o()
            acc_o.fill(0.0)
            scale_log2, mod_scale, final_scale = self._tile_scales(scale_log2, mod_scale, seq,
                                                                   head_kv, extra)
            softmax = OnlineSoftmax(scale_log2, cute.size(acc_to_mn(acc_o), mode=[0]), 4,
                                    self.ex2_per16, max_offset=self.p_max_offset)
            softmax.reset()
            seam = tile_scores(self, mod_scale, tiles.mask(seq), aux, seq.batch, head,
                               tiles.block_states, seq)
            drop = self.tile_dropout(dropout_args, seq, head)
            scores = self._softmax_step(softmax, seam, coord_mn, m_block, rng, drop, seq, head,
                                        head_kv, extra)
            # Q is waited for even when no block is visited: its TMA must land before the
            # consumers release it (and before the CTA exits).
            pipe_q.consumer_wait(q_state)
            trace = self._trace(mTimeline, tile, rng)
            if cutlass.const_expr(self.intra_wg_overlap):
                kv = self.mainloop_overlapped(gemms, scores, turns, pipes, acc_o, rng, kv, trace)
            else:
                kv = self.mainloop_serial(gemms, scores, turns, pipes, acc_o, rng, kv, trace)
            if cutlass.const_expr(self.o_tile != "q"):
                # The last QKᵀ has landed: the producer may load the next tile's Q now.
                pipe_q.consumer_release(q_state)
            self._mark(trace, "epilogue_start", Int32(-1))
            o_scale, lse = softmax.finalize(scores.o_factor(final_scale) if drop is None
                                            else drop.scale)
            rescale_o(acc_to_mn(acc_o), o_scale)
            out.store(acc_o, lse, seq, head, m_block, pipe_q, q_state, split)
            self._mark(trace, "epilogue_end", Int32(-1))
            if cutlass.const_expr(self.split_kv):
                out.merge_if_last(tiles, seq, head, m_block)
            q_state.advance()
        return q_state, kv

    def _trace(self, mTimeline, tile: Int32, rng) -> Optional[Timeline]:
        """This warp's timeline recorder for the tile (None without `timeline`)."""
        if cutlass.const_expr(not self.timeline):
            return None
        return Timeline.for_tile(mTimeline, tile, rng.n_block_max - 1)

    @staticmethod
    def _mark(trace, event: str, block: Int32):
        """A phase boundary on the timeline (nothing without `timeline`)."""
        if cutlass.const_expr(trace is not None):
            trace.record(event, block)

    def tile_dropout(self, dropout_args, seq: SeqInfo, head: Int32) -> Optional[Dropout]:
        """The tile's `Dropout` (None without): its (batch entry, query head) draws."""
        if cutlass.const_expr(not self.dropout):
            return None
        seed, threshold, scale, nheads = dropout_args
        return Dropout(seed, threshold, scale, (seq.batch, head, nheads), self.tile_m,
                       self.tile_n, framed=self.dropout_frame)

    @cute.jit
    def clear_v_tail(self, sV, pipe_v, v_state, n_block: Int32, seqlen_k: Int32):
        """Varlen or seqused_k: zero the rows of V[n_block] past seqlen_k before a PV reads
        them. Their P is 0, but they hold the next sequence, the unused tail of the packed
        tensor or a KV cache's unused slots, and 0 x NaN or inf there would reach O (a plain
        padded tensor ends at seqlen_k, where TMA zero-fills).
        Only the first block visited (the last, n_block_max - 1) can reach past seqlen_k; the
        test is uniform over the CTA, so every consumer warpgroup meets at the barrier."""
        if cutlass.const_expr(self.varlen or self.has_seqused_k or self.page_size > 0):
            valid = seqlen_k - n_block * self.tile_n
            if valid < self.tile_n:
                pipe_v.consumer_wait(v_state)
                clear_tails((sV[None, None, v_state.index],), valid, 1,
                            cute.arch.thread_idx()[0] - 128, 128 * self.num_wg,
                            FwdBarrier.V_TAIL.value)

    @cute.jit
    def mainloop_serial(self, gemms, scores, turns, pipes, acc_o, rng, kv, trace=None):
        """Per block: S = Q Kᵀ, wait, softmax, O += P V, wait (the tensor cores idle during
        this warpgroup's softmax unless the other warpgroup fills them: `pingpong`).
        Returns the K/V state of the next tile's first block."""
        _, pipe_k, pipe_v = pipes
        acc_s = gemms.new_acc_s()
        r_p = cute.make_rmem_tensor_like(acc_s, self.p_dtype)
        if rng.n_block_max > rng.n_block_min:
            self.clear_v_tail(gemms.sV, pipe_v, kv, rng.n_block_max - 1, scores.mask.seqlen_k)
        for i in cutlass.range(rng.n_block_max - rng.n_block_min, unroll=1):
            # The marks' block numbers are computed where they are used, so that the code
            # without the timeline is the same as before it existed.
            self._mark(trace, "wait_start", rng.n_block_max - 1 - i)
            pipe_k.consumer_wait(kv)
            self._mark(trace, "wait_end", rng.n_block_max - 1 - i)
            turns.begin()
            gemms.qk(acc_s, kv.index)
            turns.end()
            self._mark(trace, "qk_issued", rng.n_block_max - 1 - i)
            warpgroup.wait_group(0)
            self._mark(trace, "qk_done", rng.n_block_max - 1 - i)
            pipe_k.consumer_release(kv)
            self._mark(trace, "softmax_start", rng.n_block_max - 1 - i)
            rescale_o(acc_to_mn(acc_o), scores.to_p(acc_s, rng.n_block_max - 1 - i, False, None))
            gemms.convert(acc_s, r_p)
            self._mark(trace, "softmax_end", rng.n_block_max - 1 - i)
            pipe_v.consumer_wait(kv)
            turns.begin()
            gemms.pv(r_p, acc_o, kv.index)
            turns.end()
            self._mark(trace, "pv_issued", rng.n_block_max - 1 - i)
            warpgroup.wait_group(0)
            self._mark(trace, "pv_done", rng.n_block_max - 1 - i)
            pipe_v.consumer_release(kv)
            kv.advance()
        return kv

    @cute.jit
    def mainloop_overlapped(self, gemms, scores, turns, pipes, acc_o, rng, k_state, trace=None):
        """FA3's intra-warpgroup overlap: S[n-1] = Q K[n-1]ᵀ and O += P[n] V[n] are issued
        together, so the softmax of block n-1 runs while the PV WGMMA of block n is in flight;
        O is rescaled once that PV has landed (without ping-pong: once the next S is issued,
        `OverlappedStep.prev_scale`). Blocks run right to left; the first is always
        masked (harmless where it needs none), the others as `overlapped_blocks` arranges.
        Returns the K/V state of the next tile's first block."""
        _, pipe_k, pipe_v = pipes
        acc_s = gemms.new_acc_s()
        r_p = cute.make_rmem_tensor_like(acc_s, self.p_dtype)
        n_max = rng.n_block_max
        if n_max > rng.n_block_min:
            # Before the first S, while few registers are live (after it, ptxas spills).
            self.clear_v_tail(gemms.sV, pipe_v, k_state, n_max - 1, scores.mask.seqlen_k)
            self._mark(trace, "wait_start", n_max - 1)
            pipe_k.consumer_wait(k_state)
            self._mark(trace, "wait_end", n_max - 1)
            turns.begin()
            gemms.qk(acc_s, k_state.index)
            turns.end()
            self._mark(trace, "qk_issued", n_max - 1)
            warpgroup.wait_group(0)
            self._mark(trace, "qk_done", n_max - 1)
            pipe_k.consumer_release(k_state)
            self._mark(trace, "softmax_start", n_max - 1)
            scores.to_p(acc_s, n_max - 1, True, True)
            gemms.convert(acc_s, r_p)
            self._mark(trace, "softmax_end", n_max - 1)
            v_state = k_state.clone()
            k_state.advance()
            prev_scale = None
            if cutlass.const_expr(not self.pingpong):
                # O's rescale waits for the next block's S to be issued (`OverlappedStep`).
                prev_scale = cute.make_rmem_tensor(cute.size(acc_to_mn(acc_s), mode=[0]),
                                                   Float32)
                prev_scale.fill(1.0)
            step = OverlappedStep(gemms, scores, turns, pipe_k, pipe_v, acc_s, r_p, acc_o,
                                  prev_scale, trace)
            k_state, v_state = self.overlapped_blocks(step, rng, k_state, v_state)
            if cutlass.const_expr(prev_scale is not None):
                rescale_o(acc_to_mn(acc_o), prev_scale)
            pipe_v.consumer_wait(v_state)
            turns.begin()
            gemms.pv(r_p, acc_o, v_state.index)
            turns.end()
            self._mark(trace, "pv_issued", rng.n_block_min)
            warpgroup.wait_group(0)
            self._mark(trace, "pv_done", rng.n_block_min)
            pipe_v.consumer_release(v_state)
        # K runs one block ahead of V: after the last PV, k_state is the next free stage.
        return k_state

    @cute.jit
    def overlapped_blocks(self, step, rng, k_state, v_state):
        """The blocks after the first, right to left, in the runs of `block_runs`. Without a
        window only the first block can need the mask, so one loop runs them all unmasked.
        With one, the masked runs get loops of their own where registers allow: a run-time
        mask test inside the loop would split its body and make ptxas wait for the PV WGMMA at
        the top of the softmax. The masked loops drain the PV before their softmax: with both
        loop bodies keeping a WGMMA in flight ptxas serializes every WGMMA (D-HF-SPLIT)."""
        runs = block_runs(rng, imin=cutlass.min)
        # A block mask's tiles outside its run of full ones are masked like a window's edges.
        sparse = self.block_sparse
        windowed = self.causal or self.has_window_left or self.has_window_right or sparse
        if cutlass.const_expr(not windowed):
            for i in cutlass.range(runs.end - rng.n_block_min, unroll=1):
                k_state, v_state = step.run(k_state, v_state, runs.end - 1 - i, False)
        else:
            if cutlass.const_expr(self.causal or self.has_window_right or sparse):
                for i in cutlass.range(runs.end - runs.unmasked_end, unroll=1):
                    k_state, v_state = step.run(k_state, v_state, runs.end - 1 - i, masked=True,
                                                drain=True)
            for i in cutlass.range(runs.unmasked_end - runs.unmasked_begin, unroll=1):
                k_state, v_state = step.run(k_state, v_state, runs.unmasked_end - 1 - i, False)
            if cutlass.const_expr(self.has_window_left or sparse):
                for i in cutlass.range(runs.unmasked_begin - rng.n_block_min, unroll=1):
                    k_state, v_state = step.run(k_state, v_state, runs.unmasked_begin - 1 - i,
                                                masked=True, drain=True)
        return k_state, v_state


class WorkTiles(DslState):
    """This launch's tiles (`flash_cute.contract.tile_order.TileOrder`) and, per tile, what every
    role derives from it the same way: coordinates, sequence bounds, K/V block range, mask."""

    def __init__(self, cfg: HopperFwd, num_m_blocks: Int32, section: Int32, mQ, mK, cu_seqlens,
                 seqused, window_left: Int32, window_right: Int32, max_seqlen_q: Int32,
                 splits, page_table: Optional[cute.Tensor] = None, block_mask=None):
        """`mQ`: Q's TMA coordinate tensor, whose head mode counts the heads of a split
        (packed GQA: K/V heads, rows (pack, seqlen)); `splits`: (num_splits,
        blocks_per_split), read with split-KV only; `block_mask`: a block mask's (tile states,
        ranges) (`FwdArgs.block_states`), read with one only."""
        self.cfg = cfg
        self.num_m_blocks, self.section = num_m_blocks, section
        self.heads_per_split = mQ.shape[-2]
        self.num_splits, self.blocks_per_split = splits
        self.num_heads = self.heads_per_split
        if cutlass.const_expr(cfg.split_kv):
            self.num_heads = self.heads_per_split * self.num_splits
        self.num_batches = SeqInfo.num_batches(mQ, cu_seqlens[0])
        # Packed, a tile's head is its K/V head.
        self.qheads_per_kvhead = 1 if cfg.pack_gqa > 1 else mQ.shape[-2] // mK.shape[-2]
        # Row extents for `SeqInfo`: padded lengths, or varlen packed rows (in queries).
        row = 0 if cutlass.const_expr(cfg.varlen) else 1
        self.seqlen_q, self.seqlen_k = mQ.shape[row], mK.shape[row]
        if cutlass.const_expr(cfg.pack_gqa > 1):
            self.seqlen_q = mQ.shape[row][1]
        self.page_table = page_table
        self.block_states, self.block_ranges = block_mask_parts(block_mask)
        if cutlass.const_expr(cfg.page_size > 0):
            # Paged: K's rows are the page table's (K itself is [pages, page_size, ...]).
            self.seqlen_k = page_table.shape[1] * cfg.page_size
        self.cu_q, self.cu_k = cu_seqlens
        self.used_q, self.used_k = seqused
        self.max_seqlen_q = max_seqlen_q  # None unless varlen
        self.win_left = window_left if cfg.has_window_left else None
        self.win_right = window_right if cfg.has_window_right else None

    @property
    def order(self) -> TileOrder:
        return TileOrder(self.num_m_blocks, self.num_heads, self.num_batches, self.section,
                         self.cfg.lpt, self.cfg.persistent)

    @property
    def num_numbers(self):
        """Tile numbers the grid walks (a persistent CTA: its block index, then every
        grid-th)."""
        return self.order.num_numbers(cute.arch.grid_dim()[0], imin=cutlass.min,
                                      imax=cutlass.max)

    def at(self, tile: Int32):
        """(m_block, head, head_kv, SeqInfo, split) of tile number `tile` (an empty number,
        of the folded persistent order, gets an m_block past every sequence: `in_bounds` is
        False). Split-KV: the order counts heads x splits, split-major (split = head // heads), so
        the query heads sharing a K/V head stay neighbours, as without splits."""
        m_block, head, batch = self.order.coords(tile, cute.arch.grid_dim()[0],
                                                 imin=cutlass.min, imax=cutlass.max)
        split = Int32(0)
        if cutlass.const_expr(self.cfg.split_kv):
            split = head // self.heads_per_split
            head = head - split * self.heads_per_split
        seq = SeqInfo(batch, self.seqlen_q, self.seqlen_k, self.cu_q, self.cu_k, self.used_q,
                      self.used_k, self.cfg.pack_gqa, max_seqlen_q=self.max_seqlen_q)
        return m_block, head, head // self.qheads_per_kvhead, seq, split

    def merge_slot(self, m_block: Int32, head: Int32, seq: SeqInfo):
        """Split-KV: the index of the tile's count, over (query tile, head, batch)."""
        return (seq.batch * self.heads_per_split + head) * self.num_m_blocks + m_block

    def in_bounds(self, m_block: Int32, seq: SeqInfo):
        """Whether the tile has rows (varlen tiles past the sequence have none): uniform over
        the CTA, so every role skips the same tiles and none is left waiting."""
        return m_block * self.cfg.tile_m < seq.rows_q

    def block_range(self, m_block: Int32, seq: SeqInfo, split: Int32, head: Int32):
        """The K/V blocks the tile visits (a block mask's non-empty ones; split-KV: those of
        its split)."""
        cfg = self.cfg
        rng = block_range(m_block, cfg.tile_m, cfg.tile_n, seq.seqlen_q, seq.seqlen_k,
                          cfg.causal, self.win_left, self.win_right, cfg.pack_gqa,
                          imin=cutlass.min, imax=cutlass.max)
        sparse = block_ranges(cfg, self.block_ranges, seq.batch, head, m_block, full=True)
        if cutlass.const_expr(sparse is not None):
            rng = narrow(rng, *sparse, imin=cutlass.min, imax=cutlass.max)
        if cutlass.const_expr(cfg.split_kv):
            rng = split_range(rng, split, self.num_splits, self.blocks_per_split,
                              imin=cutlass.min, imax=cutlass.max)
        return rng

    def mask(self, seq: SeqInfo) -> AttentionMask:
        cfg = self.cfg
        return AttentionMask(cfg.tile_m, cfg.tile_n, seq.seqlen_q, seq.seqlen_k, cfg.causal,
                             self.win_left, self.win_right, cfg.pack_gqa)


class OutputStore(DslState):
    """A consumer thread's share of the epilogue: O and LSE of one tile to global memory.

    Padded (`o_tile` "own" or "q"): O, in dtype, goes into the swizzled shared tile sO by
    stmatrix; after a fence (the TMA reads through the async proxy) and barrier 4 over the
    consumer threads, warp 4 issues one TMA store of the tile, which clips rows past seqlen_q.
    Before the next tile writes sO, warp 4 waits until that store has read it and barrier 4
    passes again (needed when persistent; also when sO is Q's tile, where it is what makes
    every warpgroup's last QKᵀ done with Q before O overwrites it).

    sO = Q's tile (hdim 192, 256): the next tile's Q may be loaded only once the store has
    read O out of it. So Q is released after the epilogue instead of after the main loop,
    and warp 4, whose arrive completes the Q empty barrier with the other consumer warps',
    arrives only after `cp.async.bulk.wait_group.read 0` (and a warp sync, so lane 0, which
    arrives, follows the lane that issued the store). The producer's Q acquire for the next tile
    waits on that barrier; its K/V loads do not, so they still overlap the epilogue.

    Varlen or seqused_q (`o_tile` "none"): rows past the sequence belong to the next sequence
    or are padding that stays 0, which a TMA store would overwrite, so O goes from registers
    with row predicates. LSE is always stored by the first thread of each row's quad.
    """

    def __init__(self, cfg: HopperFwd, mma_pv, tidx, tma_o, sO, mO, mLSE, is_store_warp,
                 merge=None):
        self.cfg = cfg
        self.tma_o, self.sO, self.mO, self.mLSE = tma_o, sO, mO, mLSE
        self.tidx, self.merge = tidx, merge
        self.is_store_warp = is_store_warp
        self.coord = acc_to_mn(mma_pv.get_slice(tidx).partition_C(
            cute.make_identity_tensor((cfg.tile_m, cfg.hdim_v))))
        if cutlass.const_expr(cfg.o_tile != "none"):
            # O leaves the accumulator layout by stmatrix: four 8x8 blocks per instruction.
            self.r2s_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                cfg.out_dtype)
            self.thr_r2s = cute.make_tiled_copy_C(self.r2s_atom, mma_pv).get_slice(tidx)
            self.tOsO = self.thr_r2s.partition_D(sO[None, None, 0])
            self.barrier = pipeline.NamedBarrier(barrier_id=FwdBarrier.O_TILE.value,
                                                 num_threads=128 * cfg.num_wg)

    @cute.jit
    def store(self, acc_o: cute.Tensor, lse, seq: SeqInfo, head: Int32, m_block: Int32,
              pipe_q, q_state, split: Int32):
        """O and LSE of tile (m_block, head, seq.batch) (split-KV: into split `split`'s
        partials). Releases Q when sO is Q's tile."""
        cfg = self.cfg
        mO, mLSE = self.mO, self.mLSE
        if cutlass.const_expr(cfg.split_kv):
            mO = mO[(split,) + (None,) * (cute.rank(mO) - 1)]
            mLSE = mLSE[(split,) + (None,) * (cute.rank(mLSE) - 1)]
        self.store_lse(mLSE, lse, seq, head, m_block)
        if cutlass.const_expr(cfg.o_tile == "none"):
            self.store_o_rows(mO, acc_o, seq, head, m_block)
        else:
            self.store_o_tma(acc_o, seq, head, m_block)
            if cutlass.const_expr(cfg.o_tile == "q"):
                if self.is_store_warp:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.sync_warp()
                pipe_q.consumer_release(q_state)

    @cute.jit
    def merge_if_last(self, tiles, seq: SeqInfo, head: Int32, m_block: Int32):
        """Split-KV, after `store`: the tile's last split to store merges every split's
        partial into O and LSE (`lse_merge.merge_rows`, one warp per row)."""
        cfg = self.cfg
        merged_o, merged_lse, arrivals = self.merge
        if arrivals.last(tiles.merge_slot(m_block, head, seq), tiles.num_splits):
            first = m_block * cfg.tile_m
            o_lead = (None,) * (cute.rank(self.mO) - 1)
            lse_lead = (None,) * (cute.rank(self.mLSE) - 1)
            merge_rows(
                cutlass.min(seq.rows_q - first, cfg.tile_m),
                lambda s, r: seq.lse_view(self.mLSE[(s,) + lse_lead], head)[first + r],
                lambda s, r: cute.local_tile(seq.q_view(self.mO[(s,) + o_lead], head),
                                             (cfg.tile_m, cfg.hdim_v), (m_block, 0))[r, None],
                cute.local_tile(seq.q_view(merged_o, head), (cfg.tile_m, cfg.hdim_v),
                                (m_block, 0)),
                cute.domain_offset((first,), seq.lse_view(merged_lse, head)),
                tiles.num_splits, self.tidx, 128 * cfg.num_wg, cfg.hdim_v // 32)

    @cute.jit
    def store_lse(self, mLSE, lse, seq: SeqInfo, head: Int32, m_block: Int32):
        g_lse = seq.lse_view(mLSE, head)
        valid_rows = seq.rows_q - m_block * self.cfg.tile_m
        for r in cutlass.range_constexpr(cute.size(self.coord, mode=[0])):
            row = self.coord[r, 0][0]
            if row < valid_rows:
                if self.coord[0, 0][1] == 0:
                    g_lse[m_block * self.cfg.tile_m + row] = lse[r]

    @cute.jit
    def store_o_rows(self, mO, acc_o: cute.Tensor, seq: SeqInfo, head: Int32, m_block: Int32):
        """O straight from registers (in mO's dtype), rows past seqlen_q skipped."""
        cfg = self.cfg
        gO = cute.local_tile(seq.q_view(mO, head), (cfg.tile_m, cfg.hdim_v), (m_block, 0))
        acc_mn = acc_to_mn(acc_o)
        valid_rows = seq.rows_q - m_block * cfg.tile_m
        # Column offsets from the thread's first column, so that one row address serves
        # every store of the row (a packed row's address is a div/mod of its index).
        col0 = self.coord[0, 0][1]
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            row = self.coord[r, 0][0]
            if row < valid_rows:
                g_row = cute.domain_offset((col0,), gO[row, None])
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    g_row[self.coord[0, c][1] - col0] = acc_mn[r, c].to(mO.element_type)

    @cute.jit
    def store_o_tma(self, acc_o: cute.Tensor, seq: SeqInfo, head: Int32, m_block: Int32):
        cfg = self.cfg
        r_o = cute.make_rmem_tensor_like(acc_o, cfg.out_dtype)
        r_o.store(acc_o.load().to(cfg.out_dtype))
        if cutlass.const_expr(cfg.persistent or cfg.o_tile != "own"):
            # A tile that O borrows may still be read by the other warpgroup's last WGMMA.
            if self.is_store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            self.barrier.arrive_and_wait()
        cute.copy(self.r2s_atom, self.thr_r2s.retile(r_o), self.tOsO)
        cute.arch.fence_view_async_shared()
        self.barrier.arrive_and_wait()
        if self.is_store_warp:
            gO = cute.local_tile(seq.q_view(self.mO, head), (cfg.tile_m, cfg.hdim_v),
                                 (m_block, 0))
            t_s, t_g = tma_partition(self.tma_o, self.sO, gO)
            # Unlike the loads and the reduce-add, a plain TMA store is not elected by the DSL
            # (4.8.1's PTX has every lane issue it, whatever its docstring says).
            with cute.arch.elect_one():
                cute.copy(self.tma_o, t_s[None, 0], t_g)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def drain(self):
        """Shared memory must outlive the last TMA store's read of it."""
        if cutlass.const_expr(self.cfg.o_tile != "none"):
            if self.is_store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)


class WgmmaOperands(DslState):
    """The two WGMMAs of one K/V block: Q and K[stage] as shared-memory descriptors for S,
    P (registers) and V[stage] (descriptor) for O. Built once per consumer thread. Each call
    issues and commits one group; the caller waits (`warpgroup.wait_group`)."""

    def __init__(self, cfg: HopperFwd, mma_qk, mma_pv, thr_qk, thr_pv, wg, sQ, sK, sV):
        self.cfg = cfg
        self.mma_qk, self.mma_pv = mma_qk, mma_pv
        self.thr_qk, self.thr_pv = thr_qk, thr_pv
        wg_qk, wg_pv = wgmma_slice(mma_qk, wg), wgmma_slice(mma_pv, wg)
        self.tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        self.tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        self.tOrV = wg_pv.make_fragment_B(wg_pv.partition_B(sV))
        self.sV = sV

    def new_acc_s(self) -> cute.Tensor:
        """S's accumulator, zeroed: a tile's first QKᵀ does not accumulate, but the WGMMA
        still takes the accumulator registers as inputs, so an unset one would keep the last
        tile's S alive through the epilogue and around the tile loop of a persistent kernel,
        where ptxas, short of registers, then serializes every WGMMA (C7512)."""
        acc_s = cute.make_rmem_tensor(
            self.thr_qk.partition_shape_C((self.cfg.tile_m, self.cfg.tile_n)), Float32)
        acc_s.fill(0.0)
        return acc_s

    def convert(self, acc_s: cute.Tensor, r_p: cute.Tensor):
        """P (fp32, S's accumulator) to the PV's register operand."""
        convert_pairs(acc_s, r_p)

    def new_acc_o(self) -> cute.Tensor:
        return cute.make_rmem_tensor(
            self.thr_pv.partition_shape_C((self.cfg.tile_m, self.cfg.hdim_v)), Float32)

    @cute.jit
    def qk(self, acc_s: cute.Tensor, stage: Int32):
        """Issue S = Q K[stage]ᵀ (overwrites acc_s)."""
        # A fresh atom per GEMM: ACCUMULATE is atom state, and an atom reused across the
        # run-time loop would carry that state as a loop value.
        atom = cute.make_mma_atom(self.mma_qk.op)
        # The stage first, then the k-blocks: each k-block's descriptor is the stage's plus a
        # constant (FA4's form), not rebuilt from (k, stage).
        q, k_tile = self.tSrQ[None, None, None, 0], self.tSrK[None, None, None, stage]
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(self.tSrQ, mode=[2])):
            atom.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(atom, acc_s, q[None, None, k], k_tile[None, None, k], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def pv(self, r_p: cute.Tensor, acc_o: cute.Tensor, stage: Int32):
        """Issue O += P V[stage], P (16-bit, S's accumulator layout) as the register A operand.
        P and O must not be touched until the group has completed."""
        tOrP = acc_to_operand_a(r_p)
        atom = cute.make_mma_atom(self.mma_pv.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)
        v = self.tOrV[None, None, None, stage]
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(atom, acc_o, tOrP[None, None, k], v[None, None, k], acc_o)
        warpgroup.commit_group()


class SoftmaxStep(DslState):
    """S of one block to unnormalized P in place: the score seam (`flash_cute.blocks.score.Scores`:
    score mod, then the mask where the block needs it), then the online softmax. Returns the
    factor the O accumulator must be rescaled by."""

    def __init__(self, cfg: HopperFwd, softmax: OnlineSoftmax, scores: Scores, coord_mn,
                 m_block, rng, dropout: Optional[Dropout] = None):
        self.cfg, self.softmax, self.scores, self.coord_mn = cfg, softmax, scores, coord_mn
        self.m_block, self.rng, self.dropout = m_block, rng, dropout

    @property
    def mask(self) -> AttentionMask:
        return self.scores.mask

    def early(self, n_block: Int32):
        """What block n_block's `to_p` takes as `state`, read before its S is waited for: the
        block mask's tile state (None without one)."""
        return self.scores.tile_state(self.m_block, n_block)

    def o_factor(self, final_scale: Float32) -> Float32:
        """O's final factor, after the main loop."""
        return final_scale

    @cute.jit
    def to_p(self, acc_s: cute.Tensor, n_block: Int32, is_first: cutlass.Constexpr[bool],
             masked: cutlass.Constexpr, state: Optional[Int32] = None):
        """`masked`: True or False when the caller knows whether the block needs the mask,
        None to decide at run time (`needs_mask`); `state`: the block's `Scores.tile_state`,
        loaded early."""
        acc_s_mn = acc_to_mn(acc_s)
        self.scores.prepare(acc_s_mn, self.coord_mn, self.m_block, n_block, self.rng, masked,
                            state=state)
        row_scale = self.softmax.online_softmax(acc_s_mn, is_first=is_first)
        if cutlass.const_expr(self.dropout is not None):
            # After the row sums, which count every weight.
            self.dropout.drop(acc_s_mn, self.coord_mn, self.m_block, n_block)
        return row_scale


class OverlappedStep(DslState):
    """One block of `HopperFwd.mainloop_overlapped` after the first: issue S[n] and
    O += P[n+1] V[n+1], softmax of S[n] under the PV, then rescale O (or keep the factors for
    the next step, `prev_scale`) and convert P[n].

    `prev_scale` (an rmem vector; without ping-pong): O's rescale by block n's factors waits
    for the next step, between issuing S[n-1] and the PV that reads O, so it runs while that
    S is computed instead of between the PV landing and the next issue (FA4's order without
    ping-pong, D-HF-RESCALE). With ping-pong the turn would hold the other warpgroups' GEMMs
    back for it."""

    def __init__(self, gemms, scores, turns, pipe_k, pipe_v, acc_s, r_p, acc_o,
                 prev_scale=None, trace=None):
        self.gemms, self.scores, self.turns = gemms, scores, turns
        self.pipe_k, self.pipe_v = pipe_k, pipe_v
        self.acc_s, self.r_p, self.acc_o = acc_s, r_p, acc_o
        self.prev_scale = prev_scale
        self.trace = trace

    @cute.jit
    def run(self, k_state, v_state, n_block: Int32, masked: cutlass.Constexpr,
            drain: cutlass.Constexpr = False):
        state = self.scores.early(n_block)
        mark = functools.partial(HopperFwd._mark, self.trace)
        mark("wait_start", n_block)
        self.pipe_k.consumer_wait(k_state)
        mark("wait_end", n_block)
        self.turns.begin()
        self.gemms.qk(self.acc_s, k_state.index)
        mark("qk_issued", n_block)
        if cutlass.const_expr(self.prev_scale is not None):
            rescale_o(acc_to_mn(self.acc_o), self.prev_scale)
        self.pipe_v.consumer_wait(v_state)
        self.gemms.pv(self.r_p, self.acc_o, v_state.index)
        self.turns.end()
        mark("pv_issued", n_block + 1)
        # Groups complete in issue order: one left in flight means S has landed. `drain`
        # waits for the PV too (see `HopperFwd.overlapped_blocks`).
        warpgroup.wait_group(0 if drain else 1)
        mark("qk_done", n_block)
        if cutlass.const_expr(drain):
            mark("pv_done", n_block + 1)
        self.pipe_k.consumer_release(k_state)
        mark("softmax_start", n_block)
        row_scale = self.scores.to_p(self.acc_s, n_block, False, masked, state)
        mark("softmax_end", n_block)
        if cutlass.const_expr(not drain):
            warpgroup.wait_group(0)
            mark("pv_done", n_block + 1)
        self.pipe_v.consumer_release(v_state)
        if cutlass.const_expr(self.prev_scale is None):
            rescale_o(acc_to_mn(self.acc_o), row_scale)
        else:
            for r in cutlass.range_constexpr(cute.size(self.prev_scale)):
                self.prev_scale[r] = row_scale[r]
        self.gemms.convert(self.acc_s, self.r_p)
        k_state.advance()
        v_state.advance()
        # Returned so the caller's loop rebinds them (the DSL carries plain locals only).
        return k_state, v_state


class GemmTurns(DslState):
    """Inter-warpgroup ping-pong (FA3): the consumer warpgroups take turns issuing their
    WGMMAs, in a ring 0, 1, ..., n-1, 0, ..., so one's softmax runs while another's GEMMs hold
    the tensor cores.

    Named barrier 1 + w is warpgroup w's turn (256 threads: w's own `arrive_and_wait` plus the
    `arrive` of the warpgroup before it in the ring, once that one has issued). The last
    warpgroup hands the first turn to warpgroup 0; warpgroup 0 takes one extra turn at the
    end, so no arrive is left pending. `start` and `finish` run once per CTA, not per tile:
    every warpgroup takes the same number of turns in every tile (the tile's K/V blocks decide
    it), so the ring simply runs on into the next tile. With `enabled` False every call is a
    no-op.
    """

    def __init__(self, enabled: bool, wg: Int32, num_wg: int):
        self.enabled, self.wg, self.num_wg = enabled, wg, num_wg

    def _bar(self, wg):
        return pipeline.NamedBarrier(barrier_id=FwdBarrier.PINGPONG.value + wg, num_threads=256)

    @cute.jit
    def start(self):
        if cutlass.const_expr(self.enabled):
            if self.wg == self.num_wg - 1:
                self._bar(0).arrive()

    @cute.jit
    def begin(self):
        if cutlass.const_expr(self.enabled):
            self._bar(self.wg).arrive_and_wait()

    @cute.jit
    def end(self):
        if cutlass.const_expr(self.enabled):
            if cutlass.const_expr(self.num_wg == 2):
                self._bar(1 - self.wg).arrive()
            else:
                nxt = self.wg + 1
                self._bar(nxt if nxt < self.num_wg else 0).arrive()

    @cute.jit
    def finish(self):
        if cutlass.const_expr(self.enabled):
            if self.wg == 0:
                self._bar(0).arrive_and_wait()


def registers_per_role(kernel: HopperFwd) -> dict:
    """setmaxnreg budgets of each role, for `inspect` (the cubin reports only the launch-time
    register count, which ptxas caps at 65536 / threads)."""
    return {"producer": kernel.producer_registers, "consumer": kernel.consumer_registers}
