"""`flash_attn_combine`: flash_attn.cute's merge of split-KV partial results, by its signature.

On CUDA it runs the LSE-merge kernel (`flash_cute.kernels.lse_merge`, the one the ampere
forward's splits use; the hopper forward merges its own)
for fp32 partials of a head dim that is a multiple of 32 (other dtypes are converted to fp32
first); elsewhere, and for other head dims, the float model it is tested against
(`flash_cute.reference.block_models.lse_merge`).
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

    Args:
        out_partial: [splits, batch, seqlen, heads, d] or [splits, total_q, heads, d].
        lse_partial: out_partial's shape without its last dim, float32 (natural log).
        out: a tensor of the result's shape to write into (optional).
        out_dtype: the result's dtype (default: out_partial's).
        cu_seqlens: int32, FA4's (not read: every row is merged).
        seqused: int32, FA4's (not read).
        virtual_batch_idx: int32, FA4's (not read).
        return_lse: also return the merged LSE.

    Returns:
        (out, lse): out [batch, seqlen, heads, d] in `out_dtype`; lse [batch, seqlen, heads]
        float32 (float64 for float64 inputs), or None without `return_lse`.

    Raises:
        ValueError: out_partial neither 4-D nor 5-D, lse_partial or out of the wrong shape.
        TypeError: an index tensor that is not int32.
    """
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
    dtype = out_dtype or out_partial.dtype
    if out is not None and tuple(out.shape) != tuple(out_partial.shape[1:]):
        raise ValueError(f"out must have shape {tuple(out_partial.shape[1:])}, got "
                         f"{tuple(out.shape)}")
    if out_partial.is_cuda and out_partial.shape[-1] % 32 == 0 and dtype in _KERNEL_DTYPES:
        merged, lse = _merge_kernel(out_partial, lse_partial, dtype, out)
    else:
        merged, lse = _merge_model(out_partial, lse_partial, dtype)
    if out is None:
        out = merged
    elif merged is not out:
        out.copy_(merged)
    return out, (lse if return_lse else None)


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _merge_model(out_partial, lse_partial, dtype):
    from flash_cute.reference.block_models import lse_merge

    # fp32 at least (fp64 stays fp64).
    work = torch.promote_types(out_partial.dtype, torch.float32)
    merged, lse = lse_merge(out_partial.to(work), lse_partial.to(work))
    return merged.to(dtype), lse


def _merge_kernel(out_partial, lse_partial, dtype, out):
    """The kernel's layouts: LSEs with the query index contiguous ([.., heads, seqlen]);
    the result's LSE a transposed view of one, as FA4 returns it."""
    from flash_cute.runtime.jit import TensorArg
    from flash_cute.runtime.lse_merge import merge_call

    varlen = out_partial.dim() == 4
    o_parts = out_partial.float()
    if o_parts.stride(-1) != 1 or any(s % 4 for s in o_parts.stride()[:-1]) \
            or o_parts.data_ptr() % 16:
        o_parts = o_parts.contiguous()
    lse_parts = lse_partial.float().transpose(-1, -2)
    if lse_parts.stride(-1) != 1:
        lse_parts = lse_parts.contiguous()
    target = out
    if target is None or target.dtype != dtype or target.stride(-1) != 1 \
            or target.data_ptr() % 16:
        target = torch.empty(out_partial.shape[1:], dtype=dtype, device=out_partial.device)
    lse = torch.empty(lse_parts.shape[1:], dtype=torch.float32, device=out_partial.device)
    key = (dtype, out_partial.shape[-1], varlen)
    call = _CALLS.get(key)
    if call is None:
        args = (TensorArg(o_parts), TensorArg(lse_parts, 4), TensorArg(target),
                TensorArg(lse, 4))
        call = _CALLS[key] = merge_call(dtype, key[1], "varlen" if varlen else "padded", args)
    with torch.cuda.device(out_partial.device):
        call(o_parts, lse_parts, target, lse)
    return target, lse.transpose(-1, -2)


# (dtype, head dim, varlen) -> the merge's `jit.KernelCall` (its specs are those of every
# call with that key).
_CALLS: dict = {}
