"""mma.sync GEMMs over shared-memory operands, with their ldmatrix register pipelines."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import warp

from flash_cute.blocks.dsl_state import DslState


def tiled_mma(dtype, warps_mn: tuple):
    """m16n8k16 MMA tiled over (warps_m, warps_n) warps; each warp covers 16 columns per step so
    that one ldmatrix.x4 feeds two n8 MMAs."""
    wm, wn = warps_mn
    return cute.make_tiled_mma(warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), (wm, wn, 1),
                               permutation_mnk=(wm * 16, wn * 16, 16))


class SmemGemm(DslState):
    """acc (M x N) += A (M x K) · B (N x K)ᵀ with both operands in shared memory.

    `a_transposed` / `b_transposed` say the operand's K mode is not the contiguous one in shared
    memory (a view made with `transpose_view`), so ldmatrix must transpose while loading. An
    operand may carry a trailing stage mode (a multi-buffered tile); `run` then takes the stage.
    """

    def __init__(self, tiled, tidx, dtype, sA, sB, a_transposed: bool = False,
                 b_transposed: bool = False):
        self.tiled = tiled
        thr = tiled.get_slice(tidx)
        self.thr = thr
        self.a_staged = cute.rank(sA) == 3
        self.b_staged = cute.rank(sB) == 3
        self.rA = thr.make_fragment_A(thr.partition_A(sA[None, None, 0] if self.a_staged else sA))
        self.rB = thr.make_fragment_B(thr.partition_B(sB[None, None, 0] if self.b_staged else sB))
        ld = lambda t: cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=t, num_matrices=4),  # noqa: E731
                                           dtype)
        copy_a = cute.make_tiled_copy_A(ld(a_transposed), tiled)
        copy_b = cute.make_tiled_copy_B(ld(b_transposed), tiled)
        self.copy_a, self.copy_b = copy_a, copy_b
        thr_a, thr_b = copy_a.get_slice(tidx), copy_b.get_slice(tidx)
        self.sA, self.rA_v = thr_a.partition_S(sA), thr_a.retile(self.rA)
        self.sB, self.rB_v = thr_b.partition_S(sB), thr_b.retile(self.rB)

    def new_acc(self, shape_mn: tuple) -> cute.Tensor:
        acc = cute.make_rmem_tensor(self.thr.partition_shape_C(shape_mn), Float32)
        acc.fill(0.0)
        return acc

    @cute.jit
    def run(self, acc: cute.Tensor, stage=0):
        """One k-block of A and B in registers ahead of the MMA that uses the previous one."""
        sA = self.sA[None, None, None, stage] if cutlass.const_expr(self.a_staged) else self.sA
        sB = self.sB[None, None, None, stage] if cutlass.const_expr(self.b_staged) else self.sB
        num_k = cute.size(sA, mode=[2])
        cute.copy(self.copy_a, sA[None, None, 0], self.rA_v[None, None, 0])
        cute.copy(self.copy_b, sB[None, None, 0], self.rB_v[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if cutlass.const_expr(k + 1 < num_k):
                cute.copy(self.copy_a, sA[None, None, k + 1], self.rA_v[None, None, k + 1])
                cute.copy(self.copy_b, sB[None, None, k + 1], self.rB_v[None, None, k + 1])
            cute.gemm(self.tiled, acc, self.rA[None, None, k], self.rB[None, None, k], acc)
