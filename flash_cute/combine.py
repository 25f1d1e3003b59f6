"""`flash_attn_combine`: flash_attn.cute's merge of split-KV partial results, by its signature.

This first version merges with torch operations (`flash_cute.models.lse_merge`, the float
model the LSE-merge kernel is tested against): exact on any device, not fast. The decode issue
replaces it with the shared LSE-merge kernel on the GPU.
"""

from typing import Optional, Tuple

import torch


def flash_attn_combine(
    out_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    seqused: Optional[torch.Tensor] = None,
    virtual_batch_idx: Optional[torch.Tensor] = None,
    return_lse: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Merge partial attention outputs over disjoint key ranges (splits).

    out_partial [splits, batch, seqlen, heads, d] (varlen: [splits, total_q, heads, d]) and
    lse_partial [splits, batch, seqlen, heads] ([splits, total_q, heads]), each split
    normalized over its own keys. Returns (out [batch, seqlen, heads, d] in `out_dtype`
    (default: out_partial's), written into `out` when given; lse [batch, seqlen, heads] fp32
    (fp64 for fp64 inputs),
    or None without `return_lse`), with LSE = log Σ exp(LSE_s) and O = Σ exp(LSE_s − LSE) O_s;
    a split with LSE = −inf adds nothing, and a row where every split is −inf gets O = 0 and
    LSE = −inf. `cu_seqlens`, `seqused` and `virtual_batch_idx` only tell FA4's kernel which
    rows to visit: every row is merged here, so rows past seqused hold whatever their
    partials give, as FA4 leaves them unwritten.
    """
    from flash_cute.models import lse_merge

    if out_partial.dim() not in (4, 5):
        raise ValueError(f"out_partial must be [splits, batch, seqlen, heads, d] or [splits, "
                         f"total_q, heads, d], got shape {tuple(out_partial.shape)}")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(f"lse_partial {tuple(lse_partial.shape)} must be out_partial's shape "
                         f"without its last dim, {tuple(out_partial.shape[:-1])}")
    for name, t in (("cu_seqlens", cu_seqlens), ("seqused", seqused),
                    ("virtual_batch_idx", virtual_batch_idx)):
        if t is not None and t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    # fp32 at least (fp64 stays fp64).
    work = torch.promote_types(out_partial.dtype, torch.float32)
    merged, lse = lse_merge(out_partial.to(work), lse_partial.to(work))
    dtype = out_dtype or out_partial.dtype
    if out is None:
        out = merged.to(dtype)
    else:
        if tuple(out.shape) != tuple(merged.shape):
            raise ValueError(f"out must have shape {tuple(merged.shape)}, got {tuple(out.shape)}")
        out.copy_(merged)
    return out, (lse if return_lse else None)
