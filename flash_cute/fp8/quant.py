"""FP8 (e4m3, or e5m2) quantization of attention inputs, as the FP8 forward takes them: a scale per
block of 128 tokens of one head (block quantization), or one per (batch, head) (FA3's
descales), optionally with K smoothed first (its per-head mean subtracted: exact under
softmax, since every score of a query row moves by the same q · mean).

Casts saturate: values are clamped to the format's largest (±448 for e4m3) before the cast,
as the kernels' cvt.rn.satfinite does (torch's CPU cast turns e4m3 values ≥ 480 into NaN)."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
# The largest finite value of each FP8 format.
FP8_MAX = {torch.float8_e4m3fn: E4M3_MAX, torch.float8_e5m2: E5M2_MAX}
BLOCK = 128


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to float8_e4m3fn, saturating at ±448.

    Args:
        x: a floating-point tensor, any shape.

    Raises:
        Nothing of its own (torch's, for a tensor that cannot be cast)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def to_fp8(x: torch.Tensor, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """`x` rounded to the FP8 `dtype`, saturating at its largest value.

    Args:
        x: a floating-point tensor, any shape.
        dtype: torch.float8_e4m3fn (±448) or torch.float8_e5m2 (±57344).

    Raises:
        TypeError: `dtype` is not one of the two FP8 types."""
    if dtype not in FP8_MAX:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    top = FP8_MAX[dtype]
    return x.clamp(-top, top).to(dtype)


def quantize_fp8(x: torch.Tensor, block: int = BLOCK, smooth_k: bool = False,
                 dtype=torch.float8_e4m3fn):
    """x quantized to FP8 with its scales, so that x ≈ x8 · scale.

    Args:
        x: [batch, seqlen, heads, head_dim], any floating dtype.
        block: tokens per scale, 128 by default: one scale per `block` tokens of a head,
            float32 [batch, ceil(seqlen / block), heads]; None: one per (batch, head),
            float32 [batch, heads] (FA3's descales).
        smooth_k: subtract each head's mean over the sequence first (for K only: softmax
            does not see it).
        dtype: torch.float8_e4m3fn (default) or torch.float8_e5m2.

    Returns:
        (x8, scale): x8 of `dtype`, x's shape; scale float32 as `block` says.

    Raises:
        TypeError: `dtype` is not an FP8 type.
        ValueError: `x` is not 4-D."""
    if dtype not in FP8_MAX:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    top = FP8_MAX[dtype]
    if x.dim() != 4:
        raise ValueError(f"quantize_fp8 takes [batch, seqlen, heads, head_dim], got "
                         f"{tuple(x.shape)}")
    x = x.float()
    if smooth_k:
        x = x - x.mean(dim=1, keepdim=True)
    b, s, h, d = x.shape
    if block is None:
        amax = x.abs().amax(dim=(1, 3))                                   # [b, h]
        scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
        return to_fp8(x / scale[:, None, :, None], dtype), scale
    blocks = -(-s // block)
    padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, blocks * block - s))
    amax = padded.view(b, blocks, block, h, d).abs().amax(dim=(2, 4))    # [b, blocks, h]
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    per_token = scale.repeat_interleave(block, dim=1)[:, :s]              # [b, s, h]
    return to_fp8(x / per_token[..., None], dtype), scale


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """float64 x8 · scale, the values the FP8 kernel computes with.

    Args:
        x8: [batch, seqlen, heads, head_dim] FP8 values (`quantize_fp8`'s).
        scale: their scales, float32 [batch, ceil(seqlen / block), heads] or, with `block`
            None, [batch, heads].
        block: the tokens per scale that `quantize_fp8` used (None: per (batch, head)).

    Returns:
        float64, x8's shape.

    Raises:
        Nothing of its own (torch's, for scales whose shape does not broadcast)."""
    x = x8.double()
    if block is None:
        return x * scale.double()[:, None, :, None]
    per_token = scale.double().repeat_interleave(block, dim=1)[:, :x.shape[1]]
    return x * per_token[..., None]
