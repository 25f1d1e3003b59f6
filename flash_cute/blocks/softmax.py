"""Online softmax: the running row max m, row sum l and the rescale of the output accumulator.

Every arch keeps a thread's share of an S tile in registers, viewed as (rows, cols)
(`acc_mn`), with `threads_per_row` threads holding the columns of each row between them (4 for
the mma.sync and WGMMA accumulators, 1 for tcgen05 where a thread owns a row). The block never
sees an arch's MMA layout: `layouts.acc_to_mn` makes that view first.

Scores stay unscaled in the accumulator; the softmax scale is folded into exp2 by
``scale_log2 = softmax_scale * log2(e)``, so each element costs one FFMA and one MUFU.EX2:
``p = exp2(s * scale_log2 - M)`` with ``M = m * scale_log2`` rounded once and kept. Every
exponent, rescale and LSE of a row subtracts that same M, so a max that stays put rescales
by exactly 1 (a rescale of ``exp2(m * scale_log2 - M)``, the FFMA's exact product less M,
would multiply O and l by the same rounding error at every block). The model of this block is
`flash_cute.reference.block_models.OnlineSoftmaxModel`.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from flash_cute.blocks.dsl_state import DslState
from flash_cute.blocks.exp2_emu import exp2_row

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


# Independent partial chains per row reduction (see `_row_reduce`); a power of two.
_REDUCE_CHAINS = 4


def _row_reduce(row, combine, init=None):
    """`combine`-reduce one row of a thread's fragment, `init` (if any) folded in.

    `TensorSSA.reduce` emits one dependent chain (32 FMNMX/FADD in a row for a 128-wide WGMMA
    tile), which sits on the softmax's critical path; `_REDUCE_CHAINS` interleaved partial
    chains give the scheduler independent instructions to issue back to back.
    """
    n = cute.size(row.shape)
    if n % _REDUCE_CHAINS or n < 2 * _REDUCE_CHAINS:
        vals = cute.make_rmem_tensor(row.shape, Float32)
        vals.store(row)
        acc = vals[0] if init is None else combine(init, vals[0])
        for i in range(1, n):
            acc = combine(acc, vals[i])
        return acc
    vals = cute.make_rmem_tensor(row.shape, Float32)
    vals.store(row)
    part = [vals[j] for j in range(_REDUCE_CHAINS)]
    for i in range(_REDUCE_CHAINS, n, _REDUCE_CHAINS):
        for j in range(_REDUCE_CHAINS):
            part[j] = combine(part[j], vals[i + j])
    while len(part) > 1:
        part = [combine(part[j], part[j + 1]) for j in range(0, len(part), 2)]
    return part[0] if init is None else combine(part[0], init)


def _max(a, b):
    return cute.arch.fmax(a, b)


def _add(a, b):
    return a + b


class OnlineSoftmax(DslState):
    """Per-thread online-softmax state for `num_rows` rows.

    ``row_max`` holds M = m * scale_log2 (m the max of the raw scores, the product rounded
    once), ``row_sum`` holds l relative to it. Rows that have seen no visible key keep
    M = -inf; exp2 then uses 0 as its offset so that masked (-inf) scores give exactly 0 and
    nothing turns into NaN.
    """

    def __init__(self, scale_log2: Float32, num_rows: int, threads_per_row: int,
                 ex2_per16: int = 0, max_offset: float = 0.0):
        self.scale_log2 = scale_log2
        # P = 2^(s·scale − (M − max_offset)): 2^max_offset times larger, and so is l, which
        # cancels in O / l (the FP8 forward's P x 256 before its e4m3 cast, which would flush
        # P below 2⁻⁹ to 0). Only `online_softmax` and `finalize` take it.
        self.max_offset = max_offset
        # Of every 16 scores of a thread's row, how many take the FMA exp2 (`exp2_emu`).
        self.ex2_per16 = ex2_per16
        self.num_rows = num_rows
        self.threads_per_row = threads_per_row
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    def _allreduce_max(self, x: Float32) -> Float32:
        if cutlass.const_expr(self.threads_per_row > 1):
            x = cute.arch.warp_reduction_max(x, threads_in_group=self.threads_per_row)
        return x

    def _new_max(self, s_row, m_prev: Float32) -> Float32:
        """M of the row after this block: the thread's raw max scaled (rounded once; scaling
        is monotonic, so this is the largest of the scores' own scaled roundings), the max of
        that over the row's threads, or the running M if larger."""
        m_block = self._allreduce_max(_row_reduce(s_row, _max) * self.scale_log2)
        return cute.arch.fmax(m_block, m_prev)

    @cute.jit
    def online_softmax(
        self,
        acc_mn: cute.Tensor,
        is_first: cutlass.Constexpr[bool] = False,
        check_inf: cutlass.Constexpr[bool] = True,
    ) -> cute.Tensor:
        """Turn the scores in `acc_mn` into unnormalized probabilities in place.

        Returns the per-row factor exp2(M_old - M_new) by which the caller must
        rescale its output accumulator (`rescale_o`). `is_first` skips the rescale for the first
        tile; `check_inf=False` is allowed only where no row can be fully masked.
        The row sum is kept per thread (partial over its columns) and reduced in `finalize`,
        which saves a shuffle round per tile.
        """
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            s_row = acc_mn[r, None].load()
            m_prev = self.row_max[r]
            m_cur = self._new_max(s_row, m_prev)
            self.row_max[r] = m_cur
            m_safe = m_cur
            if cutlass.const_expr(check_inf):
                m_safe = Float32(0.0) if m_cur == -Float32.inf else m_cur
            m_exp = m_safe
            if cutlass.const_expr(self.max_offset != 0.0):
                m_exp = m_safe - Float32(self.max_offset)
            p_row = self._exp2(s_row * self.scale_log2 - m_exp, r)
            if cutlass.const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = _row_reduce(p_row, _add, Float32(0.0))
            else:
                # m_prev = -inf (nothing seen yet) gives a factor of 0: the old sum was 0 anyway.
                row_scale[r] = cute.math.exp2(m_prev - m_safe, fastmath=True)
                self.row_sum[r] = _row_reduce(p_row, _add, self.row_sum[r] * row_scale[r])
            acc_mn[r, None].store(p_row)
        return row_scale

    @cute.jit
    def update_max(self, acc_mn: cute.Tensor, threshold: cutlass.Constexpr[float] = 0.0):
        """The first half of `online_softmax`, for a pipeline that hands the rescale of O to
        another role before the exponentials (blackwell's correction warpgroup): the new row
        maxima and the factors O and the sums take. With `threshold` > 0 (exp2 units) the max
        stays where it was unless the tile's exceeds it by more than that (FA4's conditional
        rescale): the factor is then exactly 1 and the rescale can be skipped, and P stays
        below 2^threshold, which O, l and the final O / l tolerate in fp32."""
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            m_prev = self.row_max[r]
            m_cur = self._new_max(acc_mn[r, None].load(), m_prev)
            if cutlass.const_expr(threshold > 0.0):
                m_cur = m_cur if m_cur - m_prev > Float32(threshold) else m_prev
            self.row_max[r] = m_cur
            m_safe = Float32(0.0) if m_cur == -Float32.inf else m_cur
            # m_prev = -inf (nothing seen yet) gives 0: the old sum and O were 0 anyway.
            row_scale[r] = cute.math.exp2(m_prev - m_safe, fastmath=True)
        return row_scale

    @cute.jit
    def exp_and_sum(self, acc_mn: cute.Tensor, row_scale: cute.Tensor, first: int = 0,
                    packed: cutlass.Constexpr[bool] = False,
                    packed_ex2: cutlass.Constexpr[bool] = False,
                    with_sum: cutlass.Constexpr[bool] = True):
        """The second half: acc_mn's scores (columns from `first` of the row, for the
        exp2 emulation's positions) turned into unnormalized probabilities in place against
        the row max `update_max` set, their sum added to the rescaled running sum (not
        `with_sum`: left to `add_row_sums`, later). `packed` (sm100): the scale-and-shift on
        f32x2 pairs; `packed_ex2`: the emulation too."""
        for r in cutlass.range_constexpr(self.num_rows):
            m = self.row_max[r]
            m_scaled = Float32(0.0) if m == -Float32.inf else m
            if cutlass.const_expr(packed):
                # In place: a second row of registers would not fit beside the scores.
                values = acc_mn[r, None]
                for j in cutlass.range_constexpr(cute.size(values) // 2):
                    values[2 * j], values[2 * j + 1] = cute.arch.fma_packed_f32x2(
                        (values[2 * j], values[2 * j + 1]), (self.scale_log2, self.scale_log2),
                        (-m_scaled, -m_scaled))
            else:
                values = cute.make_rmem_tensor(acc_mn[r, None].shape, Float32)
                values.store(acc_mn[r, None].load() * self.scale_log2 - m_scaled)
            if cutlass.const_expr(self.ex2_per16 == 0):
                values.store(cute.math.exp2(values.load(), fastmath=True))
            else:
                exp2_row(values, self.ex2_per16, first, packed=packed_ex2)
            if cutlass.const_expr(with_sum):
                self.row_sum[r] = _row_reduce(values.load(), _add, Float32(0.0)) \
                    + self.row_sum[r] * row_scale[r]
            acc_mn[r, None].store(values.load())

    @cute.jit
    def add_row_sums(self, p_mn: cute.Tensor, row_scale: cute.Tensor):
        """row_sum = Σ p + row_sum · row_scale per row (`exp_and_sum` without its sum, for a
        pipeline that takes it off the path to the PV)."""
        for r in cutlass.range_constexpr(self.num_rows):
            total = _row_reduce(p_mn[r, None].load(), _add, Float32(0.0))
            self.row_sum[r] = total + self.row_sum[r] * row_scale[r]

    def _exp2(self, x_row, row: int):
        """2^x over row `row` (TensorSSA): all on MUFU.EX2, or with `ex2_per16` of every 16
        values of the thread's fragment by FMA arithmetic (`exp2_emu.exp2_row`)."""
        if self.ex2_per16 == 0:
            return cute.math.exp2(x_row, fastmath=True)
        values = cute.make_rmem_tensor(x_row.shape, Float32)
        values.store(x_row)
        exp2_row(values, self.ex2_per16, row * cute.size(x_row.shape))
        return values.load()

    @cute.jit
    def finalize(self, final_scale: Float32 = Float32(1.0)):
        """Reduce l across the row's threads; return (scale for O, LSE) per row.

        O = Õ * scale where scale = final_scale / l, or 0 for a row that saw no visible key.
        LSE = (M + log2 l) · ln 2 = m * softmax_scale + ln(l), -inf for such a row.
        """
        o_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            l_row = self.row_sum[r]
            if cutlass.const_expr(self.threads_per_row > 1):
                l_row = cute.arch.warp_reduction_sum(l_row, threads_in_group=self.threads_per_row)
            self.row_sum[r] = l_row
            empty = l_row == Float32(0.0)
            o_scale[r] = Float32(0.0) if empty else final_scale * cute.arch.rcp_approx(l_row)
            lse_log2 = self.row_max[r] + cute.math.log2(l_row, fastmath=True)
            if cutlass.const_expr(self.max_offset != 0.0):
                lse_log2 = lse_log2 - Float32(self.max_offset)
            lse[r] = -Float32.inf if empty else lse_log2 * Float32(LN_2)
        return o_scale, lse


@cute.jit
def rescale_o(acc_o_mn: cute.Tensor, row_scale: cute.Tensor):
    """Multiply each row of the output accumulator by its factor (online rescale or 1/l)."""
    for r in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[0])):
        acc_o_mn[r, None].store(acc_o_mn[r, None].load() * row_scale[r])
