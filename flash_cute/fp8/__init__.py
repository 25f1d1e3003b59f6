"""FP8 attention: the forward over e4m3 inputs with FA3's descales (`flash_attn_fp8`: the
Hopper FP8 kernel on the GPU, its emulation on the CPU), block quantization (`quantize_fp8`),
incoherent processing (`incoherent`, the fast Walsh–Hadamard transform `fwht`), and the torch
emulation of the kernel's computation (`emulate`), the model it is held to."""

from flash_cute.fp8 import ops  # noqa: F401 - registers torch.ops.flash_cute.fwd_fp8
from flash_cute.fp8.attention import flash_attn_fp8
from flash_cute.fp8.emulation import emulate
from flash_cute.fp8.incoherent import fwht, incoherent, random_signs
from flash_cute.fp8.quant import E4M3_MAX, dequantize_fp8, quantize_fp8, to_e4m3, to_fp8

__all__ = ["E4M3_MAX", "dequantize_fp8", "emulate", "flash_attn_fp8", "fwht", "incoherent",
           "quantize_fp8", "random_signs", "to_e4m3", "to_fp8"]
