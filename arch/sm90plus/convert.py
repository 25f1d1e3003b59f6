"""fp32 register fragments to 16-bit ones, two values per instruction.

`tensor.load().to(bf16)` lowers to one `cvt.rn.bf16.f32` per value plus packing; ptxas then
places the packing (PRMT) between the WGMMAs that read the result from registers and splits
them into separate groups (C7519 "warpgroup.arrive injected"): at the Hopper forward's
128 x 80 tile (hdim 256) the P·V GEMM went out as 5 groups. `cvt.rn.{bf16x2,f16x2}.f32`
converts and packs a pair at once (FA4 does the same). To e4m3 (the FP8 forward's P),
`cvt.rn.satfinite.e4m3x2.f32` packs a pair into 16 bits, saturating at ±448 rather than
turning large values into NaN; two of them make a 32-bit register of four.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

_PAIR_CVT = {cutlass.BFloat16: "cvt.rn.bf16x2.f32 $0, $2, $1;",
             cutlass.Float16: "cvt.rn.f16x2.f32 $0, $2, $1;"}


@dsl_user_op
def _pack_pair(lo: Float32, hi: Float32, ptx: str, *, loc=None, ip=None) -> Int32:
    """(lo, hi) rounded to nearest, packed with lo in the low half (the PTX takes the high
    source first)."""
    return Int32(llvm.inline_asm(T.i32(), [Float32(lo).ir_value(loc=loc, ip=ip),
                                           Float32(hi).ir_value(loc=loc, ip=ip)],
                                 ptx, "=r,f,f", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


_QUAD_E4M3 = ("{ .reg .b16 lo, hi;\n"
              "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
              "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
              "mov.b32 $0, {lo, hi}; }")


@dsl_user_op
def pack_quad_e4m3(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None,
                    ip=None) -> Int32:
    """(a, b, c, d) to e4m3, rounded to nearest and saturated, a in the lowest byte."""
    args = [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
    return Int32(llvm.inline_asm(T.i32(), args, _QUAD_E4M3, "=r,f,f,f,f",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


def convert_pairs(src: cute.Tensor, dst: cute.Tensor):
    """dst = src converted to dst's 16-bit type (or e4m3), element for element in register
    order (both fragments of one accumulator layout). Traced, not compiled on its own: the
    choice of instruction is made while tracing."""
    if dst.element_type is cutlass.Float8E4M3FN and cute.size(src) % 4 == 0:
        packed = cute.recast_tensor(dst, Int32)
        for i in range(cute.size(packed)):
            packed[i] = pack_quad_e4m3(src[4 * i], src[4 * i + 1], src[4 * i + 2],
                                        src[4 * i + 3])
        return
    ptx = _PAIR_CVT.get(dst.element_type)
    if ptx is None or cute.size(src) % 2:
        dst.store(src.load().to(dst.element_type))
        return
    packed = cute.recast_tensor(dst, Int32)
    for i in range(cute.size(packed)):
        packed[i] = _pack_pair(src[2 * i], src[2 * i + 1], ptx)
