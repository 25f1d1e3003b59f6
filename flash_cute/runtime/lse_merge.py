"""The LSE merge's launches: the kernel `kernels.lse_merge.LseMergeKernel`, named and not
imported (`KernelRef`), as the ampere split-KV forward and `flash_attn_combine` call it, and a
one-off GPU merge of a [splits, rows, d] stack (`lse_merge`)."""

from flash_cute.contract.variant import dtype_name
from flash_cute.runtime.kernel_ref import KernelRef

_KERNEL = KernelRef("flash_cute.kernels.lse_merge", "LseMergeKernel")
# Rows per CTA of the kernel (one warp each): part of its compile key.
ROWS_PER_CTA = 4


def merge_key(out_dtype, hdim: int, layout: str):
    """The `jit.CompileKey` of the merge kernel of a dtype, head dim and layout."""
    from flash_cute.runtime.jit import CompileKey, current_target

    flags = () if layout == "rows" else (("layout", layout),)
    return CompileKey("blocks.lse_merge", current_target(), dtype_name(out_dtype), hdim, hdim,
                      (ROWS_PER_CTA, hdim), flags)


def _kernel(out_dtype, hdim: int, layout: str):
    from flash_cute.runtime.jit import DTYPES

    return _KERNEL(DTYPES[dtype_name(out_dtype)], hdim, layout)


def merge_call(out_dtype, hdim: int, layout: str, args: tuple):
    """A `jit.KernelCall` of the merge kernel for `args` (four `jit.TensorArg`s)."""
    from flash_cute.runtime.jit import KernelCall

    return KernelCall(merge_key(out_dtype, hdim, layout),
                      lambda: _kernel(out_dtype, hdim, layout), args)


def lse_merge(o_parts, lse_parts, out_dtype=None, out=None, lse=None):
    """Merge on the GPU: o_parts [splits, rows, d] fp32, lse_parts [splits, rows] fp32.

    Returns (out [rows, d] in `out_dtype` (default bf16), lse [rows] fp32), written into
    `out`/`lse` when given.
    """
    import torch

    from flash_cute.runtime.jit import TensorArg, launch_kernel

    out_dtype = out_dtype or torch.bfloat16
    _, rows, hdim = o_parts.shape
    if out is None:
        out = torch.empty(rows, hdim, dtype=out_dtype, device=o_parts.device)
    if lse is None:
        lse = torch.empty(rows, dtype=torch.float32, device=o_parts.device)
    args = (TensorArg(o_parts), TensorArg(lse_parts, 4), TensorArg(out), TensorArg(lse, 4))
    launch_kernel(merge_key(out_dtype, hdim, "rows"), lambda: _kernel(out_dtype, hdim, "rows"),
                  args)
    return out, lse
