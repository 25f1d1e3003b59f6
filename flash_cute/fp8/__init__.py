"""FP8 attention helpers: block quantization (`quantize_fp8`), incoherent processing
(`incoherent`, the fast Walsh–Hadamard transform `fwht`), and the torch emulation of the FP8
forward's computation (`emulate`), the model the FP8 kernel is held to. The kernel itself is
not in this release."""

from flash_cute.fp8.emulation import emulate
from flash_cute.fp8.incoherent import fwht, incoherent, random_signs
from flash_cute.fp8.quant import E4M3_MAX, dequantize_fp8, quantize_fp8, to_e4m3

__all__ = ["E4M3_MAX", "dequantize_fp8", "emulate", "fwht", "incoherent", "quantize_fp8",
           "random_signs", "to_e4m3"]
