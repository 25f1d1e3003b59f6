"""Block: exp2 by FMA arithmetic, to take part of a softmax's exponentials off the MUFU unit.

A row's exponentials normally all go to MUFU.EX2 (16 per clock per SM); on Blackwell that
unit, not the tensor core, bounds the softmax, and FlashAttention-4 computes a share of them
with FMA-pipe arithmetic instead. The arithmetic, per value (model: `block_models.exp2_poly`):

1. clamp x >= -127 (a masked -inf gives 0, and the exponent arithmetic cannot wrap);
2. j = floor(x): x + 1.5 * 2^23 rounded down leaves j in the sum's low mantissa bits, and
   the sum minus 1.5 * 2^23 is j exactly, so f = x - j lies in [0, 1);
3. 2^f ~ p(f) = 1 + f (c1 + f (c2 + f c3)): a Horner chain of FMAs over
   `constants.EXP2_POLY_COEFFS` (minimax relative error 1.04e-4 at degree 3);
4. 2^x = p(f) with j << 23 added to its bits (p(f) lies in [1, 2], exponent field 127).

Every step runs on the FMA and integer pipes: 2 FADD-class, degree FFMA, 1 SHF/LEA-class
and one IADD per value, against one MUFU.EX2.

The policy (`emulated`): which values take the emulation is a compile-time choice by static
position in a thread's score fragment, `per16` of every 16 consecutive positions, spread
evenly; the share is exact when the fragment holds a multiple of 16 values (hopper's 64 at
hdim 128, ampere's 16).
"""

import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flash_cute.contract.constants import EXP2_POLY_COEFFS

# 1.5 * 2^23: x + this (|x| < 2^22) has the integer part of x in its low mantissa bits.
_SPLIT = 12582912.0
_MIN_INPUT = -127.0


@dsl_user_op
def _add_round_down(x: Float32, y: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip),
                                             Float32(y).ir_value(loc=loc, ip=ip)],
                                   "add.rm.ftz.f32 $0, $1, $2;", "=f,f,f",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _scale_by_exponent(split: Float32, frac_pow: Float32, *, loc=None, ip=None) -> Float32:
    """frac_pow * 2^j, j in the low bits of `split`: (split's bits << 23) + frac_pow's bits
    (the magic's own bits shift out past bit 31)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(split).ir_value(loc=loc, ip=ip),
                  Float32(frac_pow).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 s, p;\n\tmov.b32 s, $1;\n\tmov.b32 p, $2;\n\tshl.b32 s, s, 23;\n\t"
        "add.s32 p, p, s;\n\tmov.b32 $0, p;\n\t}", "=f,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def exp2_emulated(x: Float32, degree: int = 3) -> Float32:
    """2^x (x <= 127) by the steps of the module docstring. Traced, not compiled on its own."""
    clamped = cute.arch.fmax(x, Float32(_MIN_INPUT))
    split = _add_round_down(clamped, Float32(_SPLIT))
    frac = clamped - (split - Float32(_SPLIT))
    coeffs = EXP2_POLY_COEFFS[degree]
    poly = Float32(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        poly = cute.math.fma(poly, frac, Float32(c))
    poly = cute.math.fma(poly, frac, Float32(1.0))
    return _scale_by_exponent(split, poly)


def exp2_emulated_pair(x0: Float32, x1: Float32, degree: int = 3) -> tuple:
    """`exp2_emulated` of two values with sm100's packed f32x2 FADD and FFMA (half the
    instructions), in the same roundings: bit-equal to two `exp2_emulated`. sm100+ only."""
    clamped = (cute.arch.fmax(x0, Float32(_MIN_INPUT)), cute.arch.fmax(x1, Float32(_MIN_INPUT)))
    magic = (Float32(_SPLIT), Float32(_SPLIT))
    split = cute.arch.add_packed_f32x2(clamped, magic, rnd="rm", ftz=True)
    frac = cute.arch.sub_packed_f32x2(clamped, cute.arch.sub_packed_f32x2(split, magic))
    coeffs = EXP2_POLY_COEFFS[degree]
    poly = (Float32(coeffs[-1]), Float32(coeffs[-1]))
    for c in reversed(coeffs[:-1]):
        poly = cute.arch.fma_packed_f32x2(poly, frac, (Float32(c), Float32(c)))
    poly = cute.arch.fma_packed_f32x2(poly, frac, (Float32(1.0), Float32(1.0)))
    return _scale_by_exponent(split[0], poly[0]), _scale_by_exponent(split[1], poly[1])


def emulated(position: int, per16: int) -> bool:
    """Whether the value at static `position` of a thread's score fragment (rows one after
    another) takes the emulation: `per16` of every 16 consecutive positions, spread evenly
    (the last of each run of 16 / per16)."""
    return (position + 1) * per16 // 16 > position * per16 // 16


def exp2_row(values: cute.Tensor, per16: int, first: int = 0, degree: int = 3,
             packed: bool = False):
    """values[i] = 2^values[i] over one row of a thread's fragment (rmem, static size), the
    row starting at fragment position `first`: MUFU.EX2, except at the positions `emulated`
    picks. `packed` (sm100): the emulation goes by pairs of neighbours (`exp2_emulated_pair`),
    `per16` of every 16 pairs, so the share stays per16 / 16 over rows of 32k values. Traced,
    not compiled on its own (the positions are chosen while tracing)."""
    if packed:
        for j in range(cute.size(values) // 2):
            a, b = 2 * j, 2 * j + 1
            if emulated(first // 2 + j, per16):
                values[a], values[b] = exp2_emulated_pair(values[a], values[b], degree)
            else:
                values[a] = cute.math.exp2(values[a], fastmath=True)
                values[b] = cute.math.exp2(values[b], fastmath=True)
        return
    for i in range(cute.size(values)):
        if emulated(first + i, per16):
            values[i] = exp2_emulated(values[i], degree)
        else:
            values[i] = cute.math.exp2(values[i], fastmath=True)
