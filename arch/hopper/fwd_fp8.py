"""FA3's FP8 forward on sm90a: e4m3 Q, K and V, a bf16 or fp16 O, on `HopperFwd`'s tiles,
schedule, masks and epilogue. What differs is what FP8 WGMMA (QGMMA) demands:

* both operands of an FP8 WGMMA in shared memory must be K-major. For S = Q Kᵀ they are as
  loaded; for O = P V the K dimension is the keys, and V arrives with the head dim
  contiguous, so producer warps 1..3 transpose each V tile in shared memory (no HBM pass);
* P feeds the PV WGMMA from registers. An FP8 A fragment (K = 32) holds, per thread, four
  consecutive keys of a row per register, where S's accumulator holds two, so the converted
  P is read through a register permutation of the accumulator (`p_operand`) that makes A's
  column a carry the score of key π(a) (within each 16 keys, a = 4q + j + 2c for j, c in
  {0, 1} carries key 2q + j + 8c). The transpose writes V's keys in the same order π, so
  the product sums matching keys, and no shuffle or O un-permutation is needed;
* P is scaled by 256 before its e4m3 cast (e4m3 flushes below 2⁻⁹), as 8 taken off the row
  max (`HopperFwd.p_max_offset`): l scales with it, and O / l is unchanged;
* FA3's descales: q_descale · k_descale multiplies the scores and v_descale O, per (batch
  entry, K/V head), folded into the tile's softmax scale and O's final factor;
* or block scales (``block_scales``): one per 128 tokens of a head (`quantize_fp8`'s). Q's
  and K's multiply each block's scores (a row's Q scale times the block's K scale, one FMUL
  a score); V's keeps O in units of the current block's scale: the online rescale of O
  before a block's PV also takes v_scale(previous) / v_scale(this), and O's final factor the
  last block's (`BlockScaledStep`).
"""

import functools

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Uint32, pipeline
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from flash_cute.arch.sm90plus.convert import pack_quad_e4m3
from flash_cute.blocks.dsl_state import DslState
from flash_cute.blocks.layouts import acc_to_mn
from flash_cute.blocks.seqlen import SeqInfo
from flash_cute.blocks.work_loop import for_each_tile
from flash_cute.contract.kernel_args import FwdArgs
from flash_cute.contract.variant import Variant

from .config import (
    FP8_ROLE_REGISTERS,
    FP8_SCHEDULES,
    SMEM_CAPACITY,
    check_role_registers,
    fp8_o_tile,
    fp8_smem_bytes,
)
from .fwd import HopperFwd, SoftmaxStep, WgmmaOperands

# The producer warpgroup's warps that transpose V (warp 0 issues the TMA loads).
TRANSPOSE_WARPS = 3
# Tokens per block scale (`flash_cute.fp8.quant.BLOCK`): tile_n divides it.
SCALE_BLOCK = 128
# Keys of V's permuted order π within each group of 16 (see the module docstring): the
# keys a thread's word of four consecutive columns 4q .. 4q + 3 carries are 2q + KEY_OFFSETS.
KEY_OFFSETS = (0, 1, 8, 9)


# The 4 x 4 byte transpose of four words w0..w3 (PRMT selectors: a result byte i takes byte
# sel[i] of the pair (a, b), b's bytes numbered 4..7): pairs interleave w0/w1 and w2/w3, then
# out[j] = (w0.j, w1.j, w2.j, w3.j).
PAIR_LO, PAIR_HI = 0x5140, 0x7362
MERGE_LO, MERGE_HI = 0x5410, 0x7632


def key_order(tile_n: int) -> list:
    """π: the key that column a of the permuted tile carries, for a in [0, tile_n)."""
    return [16 * (a // 16) + 2 * ((a % 16) // 4) + KEY_OFFSETS[a % 4] for a in range(tile_n)]


def lane_coords(lane):
    """(d0, v) of a lane's chunks before their warp-wide part (`chunk_coords`): lane bits
    (d0 / 4 mod 4, v mod 4, v / 4 mod 2). Python ints and DSL integers alike."""
    return 4 * (lane % 4), (lane >> 2) % 4 + 4 * (lane >> 4)


def warp_coords(w: int, v_groups: int):
    """(d0, v) that chunk row w (32 chunks, one a lane) adds to its lanes' own: the rest of
    the columns, then the head dims. Their bits are disjoint from `lane_coords`', so a
    chunk's offsets are the lane's XOR the row's (`_Words`), and the row's are constants."""
    return 16 * (w // v_groups), 8 * (w % v_groups)


def chunk_coords(c: int, v_groups: int):
    """(d0, v) of transpose chunk c = lane + 32 w: head dims d0..d0+3, columns 4v..4v+3."""
    (d_lane, v_lane), (d_row, v_row) = lane_coords(c % 32), warp_coords(c // 32, v_groups)
    return d_lane + d_row, v_lane + v_row


def first_key(v):
    """The key that column 4v of the permuted tile carries (π(4v))."""
    return 16 * (v // 4) + 2 * (v % 4)


def transposed_words(prmt, words):
    """The four output words of the 4 x 4 byte transpose of `words` (`prmt(a, b, sel)`)."""
    lo01, hi01 = prmt(words[0], words[1], PAIR_LO), prmt(words[0], words[1], PAIR_HI)
    lo23, hi23 = prmt(words[2], words[3], PAIR_LO), prmt(words[2], words[3], PAIR_HI)
    return (prmt(lo01, lo23, MERGE_LO), prmt(lo01, lo23, MERGE_HI),
            prmt(hi01, hi23, MERGE_LO), prmt(hi01, hi23, MERGE_HI))


def swizzled(offset, bits: int, base: int, shift: int):
    """A CuTe Swizzle<bits, base, shift> of an offset (ints or DSL integers)."""
    return offset ^ ((offset >> shift) & (((1 << bits) - 1) << base))


def p_sources(size: int) -> list:
    """For each 32-bit register of the FP8 A operand of O += P V (A's compact layout
    ((4, 2, 2), 1, N/32): byte j, row half h, k-half s, k-block kb; register
    i = h + 2 s + 4 kb), the four values of S's accumulator (C layout ((2, 2, N/8), 1, 1):
    pair, row half, group of 8 columns) its bytes take. Byte j = (j0, j1) of A's column
    4q + j + 16 s + 32 kb is C's value j0 + 2 h + 4 (4 kb + 2 s + j1): the score of key
    32 kb + 16 s + 2q + j0 + 8 j1, so A's columns run in the key order π."""
    out = []
    for i in range(size // 4):
        h, s, kb = i % 2, (i // 2) % 2, i // 4
        c0 = 2 * h + 8 * s + 16 * kb
        out.append((c0, c0 + 1, c0 + 4, c0 + 5))
    return out


def p_operand(r_p: cute.Tensor) -> cute.Tensor:
    """`r_p` (e4m3, filled by `Fp8Operands.convert`) as the A operand's fragment."""
    return cute.make_tensor(r_p.iterator,
                            cute.make_layout(((4, 2, 2), 1, cute.size(r_p) // 16)))


class HopperFwdFp8(HopperFwd):
    """FP8 forward kernel: O = softmax(Q Kᵀ · scale · q_descale · k_descale) V · v_descale and
    LSE, e4m3 in, `out_dtype` out, over `HopperFwd`'s (query tile, head, batch) tiles.

    | warpgroup | warps | registers | role                                                    |
    |-----------|-------|-----------|---------------------------------------------------------|
    | 0         | 0     | 40        | producer: per tile, TMA of Q, then K[n], V[n] per block  |
    | 0         | 1..3  | 40        | transpose: V[n] to Vᵀ[n], keys in the order π            |
    | 1         | 4..7  | 232       | consumer: rows 0..63 — QKᵀ, mask, softmax, P to e4m3,   |
    |           |       |           | PVᵀ, epilogue; warp 4 also issues O's TMA store          |
    | 2         | 8..11 | 232       | consumer: rows 64..127 — same                            |

    | pipeline                 | stages | full barrier              | empty barrier            |
    |--------------------------|--------|---------------------------|--------------------------|
    | Q (PipelineTmaAsync)     | 1      | TMA bytes of the Q tile   | 4 per consumer warpgroup |
    | K (PipelineTmaAsync)     | 2      | TMA bytes of a K tile     | 4 per consumer warpgroup |
    | V (PipelineTmaAsync)     | 2      | TMA bytes of a V tile     | 1 per transpose warp     |
    | Vᵀ (PipelineAsync)       | 2      | 96 transpose threads      | 256 consumer threads     |

    Named barriers: `HopperFwd`'s ping-pong turns and O tile. Stage i of the V and Vᵀ rings
    holds the block of stage i of the K ring; the consumers wait on Vᵀ where `HopperFwd`'s
    wait on V. Varlen and seqused_k: the transpose writes zeros for the keys past seqlen_k
    (they hold the next sequence or unused cache slots; their P is 0, but 0 x NaN is not).

    Takes causal, local windows, softcap, packed GQA, varlen, seqused, split-KV (merged in
    the kernel) and paged K/V; e4m3 or e5m2 inputs (P e4m3 either way). No dropout, mods,
    block masks, append or timeline (each refused here and, with a clear message, by the API
    before any launch).
    """

    p_max_offset = 8.0  # P x 256 before its e4m3 cast

    @property
    def takes_descales(self) -> int:
        """The rank of the scale tensors the kernel takes (`fake_args`)."""
        return 3 if self.block_scales else 2

    def pipeline(self):
        """This kernel's pipeline as data (`flash_cute.contract.pipeline`)."""
        from .pipelines import forward_fp8
        return forward_fp8(self)

    def __init__(self, dtype, hdim: int, hdim_v=None, variant: Variant = Variant(),
                 schedule=None, out_dtype=cutlass.BFloat16, block_scales: bool = False):
        """`out_dtype`: O's DSL type, or its name ("bf16", "fp16"), as the runtime gives it;
        `block_scales`: the scales are per 128 tokens ([b, blocks, heads]), not FA3's
        descales ([b, heads_kv])."""
        self.block_scales = block_scales
        out_dtype = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}.get(out_dtype, out_dtype)
        if dtype not in (cutlass.Float8E4M3FN, cutlass.Float8E5M2):
            raise ValueError(f"the FP8 forward takes float8_e4m3fn or float8_e5m2 Q, K and V, "
                             f"got {dtype}")
        if out_dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise ValueError(f"the FP8 forward writes bf16 or fp16, got {out_dtype}")
        refused = [name for name, on in (
            ("dropout", variant.dropout), ("score or mask mods", variant.mods is not None),
            ("append", variant.append), ("timeline", variant.timeline),
            ("software exp2", variant.ex2_per16 > 0)) if on]
        if refused:
            raise NotImplementedError(f"the FP8 forward has no {', '.join(refused)}")
        if hdim not in FP8_SCHEDULES and schedule is None:
            raise ValueError(f"no FP8 schedule for hdim {hdim}; have {sorted(FP8_SCHEDULES)}")
        super().__init__(dtype, hdim, hdim_v, variant, schedule or FP8_SCHEDULES[hdim])
        self.out_dtype = out_dtype
        # P is e4m3 whatever the inputs' FP8 type (e5m2's 2 mantissa bits would double its
        # rounding); QGMMA takes e4m3 x e5m2.
        self.p_dtype = cutlass.Float8E4M3FN
        if block_scales and 128 % self.tile_n:
            raise ValueError(f"block scales need tile_n dividing their 128-token block, got "
                             f"{self.tile_n}")
        if block_scales and self.score_mod is not None:
            raise NotImplementedError("block scales with softcap: the scale would have to "
                                      "enter before the tanh, per score")
        if self.num_wg != 2 or self.tile_n % 32:
            raise ValueError(f"FP8 tiles are 128 rows by a multiple of 32 keys, got "
                             f"{self.tile_m} x {self.tile_n}")
        self.producer_registers, self.consumer_registers = FP8_ROLE_REGISTERS
        check_role_registers(*FP8_ROLE_REGISTERS, self.num_wg, self.ctas_per_sm)
        self.o_tile = fp8_o_tile(self.hdim, self.hdim_v, self._smem_schedule,
                                 self._rows_past_sequence, self.persistent,
                                 self.out_dtype.width // 8)
        if self.smem_bytes > SMEM_CAPACITY:
            raise ValueError(f"FP8 schedule {self._smem_schedule} needs {self.smem_bytes} B "
                             f"of shared memory at hdim {self.hdim}/{self.hdim_v}")

    @property
    def smem_bytes(self) -> int:
        return fp8_smem_bytes(self.hdim, self.hdim_v, self._smem_schedule, self.o_tile == "own",
                              self.out_dtype.width // 8)

    # ---------------------------------------------------------------- host side

    def _extra_args(self, args: FwdArgs):
        return args.q_descale, args.k_descale, args.v_descale

    def _vt_layout(self):
        """Vᵀ: (hdim_v, tile_n, stages), the keys contiguous (K-major for the PV WGMMA)."""
        return sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR,
                                             (self.tile_m, self.hdim_v, self.tile_n), self.dtype,
                                             self.kv_stages)

    # ---------------------------------------------------------------- device side

    def _pipelines(self, storage, tx_bytes):
        """Q, K and V filled by TMA; Q and K emptied by the consumer warps, V by the transpose
        warps, which fill Vᵀ for the consumers (every thread arrives on its barriers)."""
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread)

        def tma(bars, stages, tx, consumer_warps):
            return pipeline.PipelineTmaAsync.create(
                num_stages=stages, producer_group=one, tx_count=tx,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
                barrier_storage=bars.data_ptr(), defer_sync=True)

        pipes = (tma(storage.mbar_q, 1, tx_bytes[0], 4 * self.num_wg),
                 tma(storage.mbar_k, self.kv_stages, tx_bytes[1], 4 * self.num_wg),
                 tma(storage.mbar_v, self.kv_stages, tx_bytes[2], TRANSPOSE_WARPS),
                 pipeline.PipelineAsync.create(
                     num_stages=self.kv_stages, barrier_storage=storage.mbar_vt.data_ptr(),
                     producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                              32 * TRANSPOSE_WARPS),
                     consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                              128 * self.num_wg),
                     defer_sync=True))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return pipes

    def _consumer_pipes(self, pipes):
        return pipes[0], pipes[1], pipes[3]

    def _o_smem(self, storage, sO_layout):
        """O's staging tile: its own, or the Vᵀ ring (`o_tile` "vt"), idle once the last PV
        WGMMAs have read it (the epilogue waits for both warpgroups'; no next tile, since
        "vt" is not persistent)."""
        if cutlass.const_expr(self.o_tile == "vt"):
            return storage.sVt.get_tensor(sO_layout.outer, swizzle=sO_layout.inner,
                                          dtype=self.out_dtype)
        return super()._o_smem(storage, sO_layout)

    def _v_operand(self, storage, sV):
        layout = self._vt_layout()
        return storage.sVt.get_tensor(layout.outer, swizzle=layout.inner)

    def _operands(self, mma_qk, mma_pv, thr_qk, thr_pv, wg, sQ, sK, sV):
        return Fp8Operands(self, mma_qk, mma_pv, thr_qk, thr_pv, wg, sQ, sK, sV)

    def _softmax_step(self, softmax, seam, coord_mn, m_block, rng, drop, seq, head, head_kv,
                      extra):
        if cutlass.const_expr(not self.block_scales):
            return SoftmaxStep(self, softmax, seam, coord_mn, m_block, rng, drop)
        return BlockScaledStep(self, softmax, seam, coord_mn, m_block, rng, extra, seq, head,
                               head_kv)

    @cute.jit
    def _tile_scales(self, scale_log2, mod_scale, seq: SeqInfo, head_kv: Int32, extra):
        """q_descale · k_descale into the scores' scale (the mod's, with softcap, whose tanh
        takes the true scores), v_descale into O's final factor. Block scales: nothing here
        (`BlockScaledStep`)."""
        if cutlass.const_expr(self.block_scales):
            return scale_log2, mod_scale, Float32(1.0)
        q_descale, k_descale, v_descale = extra
        qk = q_descale[seq.batch, head_kv] * k_descale[seq.batch, head_kv]
        if cutlass.const_expr(self.score_mod is not None):
            mod_scale = mod_scale * qk
        else:
            scale_log2 = scale_log2 * qk
        return scale_log2, mod_scale, Float32(v_descale[seq.batch, head_kv])

    def clear_v_tail(self, sV, pipe_v, v_state, n_block: Int32, seqlen_k: Int32):
        """The transpose zeroes V's keys past seqlen_k (`transpose_block`)."""
        pass

    @cute.jit
    def assist(self, storage, pipes, tiles):
        """Producer warps 1..3 over this CTA's tiles: each K/V block's V to Vᵀ."""
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.kv_stages)
        vt_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.kv_stages)
        sV_layout, sVt_layout = self._smem_layouts()[2], self._vt_layout()
        lane = cute.arch.lane_idx()
        d0, v = lane_coords(lane)
        ends = (_words(storage.sV, sV_layout).at_lane(d0, first_key(v)),
                _words(storage.sVt, sVt_layout).at_lane(d0, 4 * v))
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) - 1
        step = functools.partial(self.transpose_tile, pipes, tiles, ends, first_key(v), warp)
        for_each_tile(tiles, self.persistent, step, (v_state, vt_state))

    @cute.jit
    def transpose_tile(self, pipes, tiles, ends, lane_key: Int32, warp: Int32, tile: Int32,
                       v_state, vt_state):
        """The tile's blocks, in the producer's order (right to left)."""
        _, _, pipe_v, pipe_vt = pipes
        m_block, head, _, seq, split = tiles.at(tile)
        if tiles.in_bounds(m_block, seq):
            rng = tiles.block_range(m_block, seq, split, head)
            for i in cutlass.range(rng.n_block_max - rng.n_block_min, unroll=1):
                n_block = rng.n_block_max - 1 - i
                pipe_v.consumer_wait(v_state)
                pipe_vt.producer_acquire(vt_state)
                self.transpose_block(ends, v_state.index, warp,
                                     seq.seqlen_k - n_block * self.tile_n - lane_key)
                # Vᵀ was written through the generic proxy; the WGMMA reads the async one.
                cute.arch.fence_view_async_shared()
                cute.arch.sync_warp()
                pipe_v.consumer_release(v_state)
                pipe_vt.producer_commit(vt_state)
                v_state.advance()
                vt_state.advance()
        return v_state, vt_state

    @cute.jit
    def transpose_block(self, ends, stage: Int32, warp: Int32, valid_keys: Int32):
        """Vᵀ[stage](d, a) = V[stage](π(a), d), in 4 x 4-byte chunks: a thread reads four
        32-bit words (head dims d0..d0+3 of the keys π(a0..a0+3)), transposes their bytes
        with PRMT and writes four words (columns a0..a0+3 of rows d0..d0+3). Chunk rows (32
        chunks, one a lane) go round the warps, unrolled, so that every offset is the
        lane's, found once, XOR a constant. Lanes take chunks so that both the reads and the
        swizzled writes are at most 2-way bank conflicted (`lane_coords`). Keys at or past
        the lane's `valid_keys` are written as 0 (varlen and seqused_k only)."""
        src, dst = ends
        rows, v_groups = self.hdim_v * self.tile_n // 512, self.tile_n // 32
        zero_tail = self.varlen or self.has_seqused_k or self.page_size > 0
        for k in cutlass.range_constexpr(TRANSPOSE_WARPS):
            if warp == k:
                for w in cutlass.range_constexpr(k, rows, TRANSPOSE_WARPS):
                    d0, v = warp_coords(w, v_groups)
                    words = [Int32(0)] * 4
                    for i in cutlass.range_constexpr(4):
                        key = 4 * v + KEY_OFFSETS[i]
                        word = src.load(stage, (d0, key))
                        if cutlass.const_expr(zero_tail):
                            word = Int32(0) if key >= valid_keys else word
                        words[i] = word
                    out = transposed_words(lambda a, b, sel: Int32(cute.arch.prmt(a, b, sel)),
                                           words)
                    for j in cutlass.range_constexpr(4):
                        dst.store(stage, (d0 + j, 4 * v), out[j])


class BlockScaledStep(SoftmaxStep):
    """`SoftmaxStep` with block scales: S·q_scale(row)·k_scale(block) before the softmax, and
    O kept in units of the current block's V scale (see the module docstring). The K and V
    scales of a block are read before its S is waited for (`early`)."""

    def __init__(self, cfg, softmax, scores, coord_mn, m_block, rng, scales, seq, head,
                 head_kv):
        SoftmaxStep.__init__(self, cfg, softmax, scores, coord_mn, m_block, rng, None)
        q_scale, k_scale, v_scale = scales
        self.k_scale = k_scale[seq.batch, None, head_kv]
        self.v_scale = v_scale[seq.batch, None, head_kv]
        rows = cute.size(coord_mn, mode=[0])
        self.q_rows = cute.make_rmem_tensor(rows, Float32)
        last_q = q_scale.shape[1] - 1
        for r in range(rows):  # traced, not a run-time loop
            row = m_block * cfg.tile_m + coord_mn[r, 0][0]
            query, q_head = row, head
            if cutlass.const_expr(cfg.pack_gqa > 1):
                query, q_head = row // cfg.pack_gqa, head * cfg.pack_gqa + row % cfg.pack_gqa
            # Rows past the sequence read the last block's scale (their results are dropped).
            block = cutlass.min(query // SCALE_BLOCK, last_q)
            self.q_rows[r] = q_scale[seq.batch, block, q_head]
        # The V scale O is in units of (1.0 before the first block: O is 0 then).
        self.v_now = cute.make_rmem_tensor(1, Float32)
        self.v_now[0] = Float32(1.0)

    def _kv_scales(self, n_block: Int32):
        block = cutlass.min(n_block * self.cfg.tile_n // SCALE_BLOCK,
                            cute.size(self.k_scale) - 1)
        return Float32(self.k_scale[block]), Float32(self.v_scale[block])

    def early(self, n_block: Int32):
        return (SoftmaxStep.early(self, n_block),) + self._kv_scales(n_block)

    @cute.jit
    def to_p(self, acc_s: cute.Tensor, n_block: Int32, is_first: cutlass.Constexpr[bool],
             masked: cutlass.Constexpr, state=None):
        base_state, k_scale, v_scale = None, None, None
        if cutlass.const_expr(state is None):
            k_scale, v_scale = self._kv_scales(n_block)
        else:
            base_state, k_scale, v_scale = state
        acc_mn = acc_to_mn(acc_s)
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            acc_mn[r, None].store(acc_mn[r, None].load() * (k_scale * self.q_rows[r]))
        row_scale = SoftmaxStep.to_p(self, acc_s, n_block, is_first, masked, base_state)
        ratio = self.v_now[0] / v_scale
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            row_scale[r] = row_scale[r] * ratio
        self.v_now[0] = v_scale
        return row_scale

    def o_factor(self, final_scale: Float32) -> Float32:
        return final_scale * self.v_now[0]


class _Words(DslState):
    """32-bit words of a swizzled byte tile (d, x, stage) in shared memory, found from one
    lane's word (`at_lane`) by a constant: a CuTe Swizzle is linear over XOR, and so are
    these outer layouts over coordinates whose bits are disjoint (the transpose's lane and
    row parts), so word(lane + row) = word(lane) ^ word(row); the transpose's model test
    checks it for each schedule. The swizzle is applied by hand, since recasting a swizzled
    tensor to 32-bit drops it."""

    def __init__(self, words: cute.Tensor, layout: cute.ComposedLayout, lane=None):
        self.words, self.outer = words, layout.outer
        swizzle = layout.inner
        self.bits, self.base, self.shift = swizzle.num_bits, swizzle.num_base, swizzle.num_shift
        # The lane's word at (d, x) of stage 0, where `lane` = (d, x) gives one.
        self.lane_word = None if lane is None else Int32(self.word_of((*lane, 0)))
        self.layout = layout

    def word_of(self, coord):
        """The word (an index) at `coord` = (d, x, stage): DSL or Python integers."""
        offset = cute.crd2idx(coord, self.outer)
        return swizzled(offset, self.bits, self.base, self.shift) >> 2

    def at_lane(self, d, x) -> "_Words":
        """These words, addressed from the lane's own at (d, x)."""
        return _Words(self.words, self.layout, (d, x))

    def _index(self, stage: Int32, row):
        return (self.lane_word ^ self.word_of((*row, 0))) + stage * self.word_of((0, 0, 1))

    def load(self, stage: Int32, row) -> Int32:
        return Int32(self.words[self._index(stage, row)])

    def store(self, stage: Int32, row, value: Int32):
        self.words[self._index(stage, row)] = Uint32(value)


def _words(field, layout) -> _Words:
    ptr = cute.recast_ptr(field.data_ptr(), dtype=Uint32)
    words = cute.make_tensor(ptr, cute.make_layout(cute.cosize(layout.outer) // 4))
    return _Words(words, layout)


class Fp8Operands(WgmmaOperands):
    """`WgmmaOperands` with P as the FP8 A operand in the key order π (`p_sources`) and Vᵀ
    as the K-major B operand."""

    def convert(self, acc_s: cute.Tensor, r_p: cute.Tensor):
        """P to e4m3 straight into A's register order: each register's four bytes come from
        two pairs of S's accumulator, one cvt of each pair (no byte permutes)."""
        packed = cute.recast_tensor(r_p, Int32)
        for i, src in enumerate(p_sources(cute.size(acc_s))):
            packed[i] = pack_quad_e4m3(*(acc_s[c] for c in src))

    @cute.jit
    def pv(self, r_p: cute.Tensor, acc_o: cute.Tensor, stage: Int32):
        """Issue O += P Vᵀ[stage]; P (e4m3, S's accumulator layout) and O must not be touched
        until the group has completed."""
        tOrP = p_operand(r_p)
        atom = cute.make_mma_atom(self.mma_pv.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)
        v = self.tOrV[None, None, None, stage]
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(atom, acc_o, tOrP[None, None, k], v[None, None, k], acc_o)
        warpgroup.commit_group()


def registers_per_role(kernel: HopperFwdFp8) -> dict:
    """setmaxnreg budgets of each role, for `inspect`."""
    return {"producer": kernel.producer_registers, "transpose": kernel.producer_registers,
            "consumer": kernel.consumer_registers}
