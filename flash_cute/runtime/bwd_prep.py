"""The backward pass's two arch-neutral helper kernels, run around every arch's main bwd kernel.

* Preprocess (before): ``Delta = rowsum(dO ∘ O) − dLSE`` enters ``dS = P ∘ (dP − Delta)``
  (the dLSE term is the gradient through a returned LSE), and
  ``LSElog2 = LSE · log2 e`` lets the main kernel recompute
  ``P = exp2(S · scale_log2 − LSElog2)`` with one FFMA per element. A row that saw no key
  (LSE = −inf) gets LSElog2 = +inf, so its P is exactly 0 rather than inf or NaN.
* Postprocess (after): ``dQ = dQaccum · scale`` in the input dtype; the main kernel accumulates
  dQ in fp32 across key blocks.

Both are memory-bound: 128-bit loads, a power-of-two group of consecutive lanes per row (so a
butterfly shuffle reduces it), fp32 arithmetic.
"""

import functools
import importlib

import torch

from flash_cute.contract.row_split import row_split
from flash_cute.contract.variant import dtype_name

# Elements per 128-bit vector: 16-bit O/dO, fp32 dQaccum.
_VEC16, _VEC32 = 8, 4


def _longest_sequence(cu_seqlens) -> int:
    """max(cu_seqlens[i + 1] - cu_seqlens[i]), read back to the host (a sync)."""
    return int(cu_seqlens.diff().max()) if cu_seqlens.numel() > 1 else 0


@functools.lru_cache(maxsize=None)
def _kernel(name: str, *config):
    """One kernel object per configuration; their module (CuTe DSL) is imported only to
    compile, not when the kernels come from the disk cache."""
    return getattr(importlib.import_module("flash_cute.kernels.bwd_prep"), name)(*config)


class Preprocess:
    """The preprocess launch of one configuration (dtype, head dim, varlen, which of dLSE,
    seqused_q and the zero-filled buffer are given), worked out once; called as
    ``(out, dout, lse, dlse, delta, lse_log2, cu_seqlens_q, seqused_q, max_seqlen_q, zero)``
    with tensors of that configuration (`bwd_preprocess` says what they are)."""

    def __init__(self, out, dout, lse, dlse, cu_seqlens_q, seqused_q, zero, target: str):
        from flash_cute.runtime.jit import DTYPES, CompileKey, KernelCall, TensorArg, tensor_arg

        if out.shape[-1] % _VEC16:
            raise ValueError(f"hdim_v must be a multiple of {_VEC16} (128-bit loads), "
                             f"got {out.shape[-1]}")
        name, hdim_v = dtype_name(out.dtype), out.shape[-1]
        varlen, has_dlse = cu_seqlens_q is not None, dlse is not None
        config = (varlen, has_dlse, seqused_q is not None, zero is not None)
        tile_m = row_split(hdim_v // _VEC16)[1]
        key = CompileKey("blocks.bwd.preprocess", target, name, None, hdim_v, (tile_m, hdim_v),
                         (("dlse", has_dlse), ("varlen", varlen), ("seqused_q", config[2]),
                          ("zero_fill", config[3])))
        vec = functools.partial(tensor_arg, align=4)
        args = (TensorArg(out), TensorArg(dout), vec(lse), vec(dlse), vec(lse), vec(lse),
                vec(cu_seqlens_q), vec(seqused_q), 1,
                None if zero is None else TensorArg(zero.view(-1), 16))
        self.call = KernelCall(key, lambda: _kernel("BwdPreprocessKernel", DTYPES[name], hdim_v,
                                                    *config), args)

    def __call__(self, out, dout, lse, dlse, delta, lse_log2, cu_seqlens_q, seqused_q,
                 max_seqlen_q: int, zero):
        self.call(out, dout, lse, dlse, delta, lse_log2, cu_seqlens_q, seqused_q, max_seqlen_q,
                  None if zero is None else zero.view(-1))


def bwd_preprocess(out, dout, lse, dlse=None, cu_seqlens_q=None, max_seqlen_q=None,
                   delta=None, lse_log2=None, seqused_q=None, zero=None):
    """Delta and LSElog2 on the GPU, for inputs as `validate_backward_inputs` accepts them.

    out, dout: padded [b, sq, h, dv] or varlen [total_q, h, dv] (bf16/fp16, 16-byte aligned
    rows, dv % 8 == 0); lse, dlse: fp32 [b, h, sq] or [h, total_q]; cu_seqlens_q: int32 [b + 1]
    for varlen, with `max_seqlen_q` its longest sequence (computed, with a host sync, when None);
    seqused_q: int32 [b], the rows of each sequence used (at most `max_seqlen_q`). Returns
    (delta, lse_log2), fp32 shaped like lse, written into `delta`/`lse_log2` when given;
    entries of rows outside every sequence, or past seqused_q[b], are left as they were.
    `zero`: a contiguous fp32 tensor (16-byte aligned, numel % 4 == 0, e.g. the main kernel's
    dQaccum) set to 0 by the same kernel.
    """
    from flash_cute.runtime.jit import current_target

    varlen = cu_seqlens_q is not None
    if delta is None:
        delta = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
    if lse_log2 is None:
        lse_log2 = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
    if max_seqlen_q is None:
        max_seqlen_q = _longest_sequence(cu_seqlens_q) if varlen else out.shape[1]
    if delta.numel() == 0 or max_seqlen_q == 0:
        if zero is not None:
            zero.zero_()
        return delta, lse_log2
    if zero is not None and not (zero.dtype == torch.float32 and zero.is_contiguous()
                                 and zero.numel() % 4 == 0 and zero.data_ptr() % 16 == 0):
        raise ValueError("zero: a contiguous, 16-byte aligned fp32 tensor with numel % 4 == 0")
    Preprocess(out, dout, lse, dlse, cu_seqlens_q, seqused_q, zero, current_target())(
        out, dout, lse, dlse, delta, lse_log2, cu_seqlens_q, seqused_q, int(max_seqlen_q), zero)
    return delta, lse_log2


class Postprocess:
    """The postprocess launch of one configuration (dQaccum's head dim and layout, dQ's
    dtype), worked out once; called as ``(dq_accum, scale) -> dq``, allocating dQ."""

    def __init__(self, dq_accum, dtype, target: str):
        from flash_cute.runtime.jit import DTYPES, CompileKey, KernelCall, TensorArg

        hdim = dq_accum.shape[-1]
        if hdim % _VEC32:
            raise ValueError(f"hdim must be a multiple of {_VEC32}, got {hdim}")
        name, varlen = dtype_name(dtype), dq_accum.dim() == 3
        self.shape, self.dtype, self.device = tuple(dq_accum.shape), dtype, dq_accum.device
        self.empty = dq_accum.numel() == 0
        key = CompileKey("blocks.bwd.postprocess", target, name, hdim, None,
                         (row_split(hdim // _VEC32)[1], hdim), (("varlen", varlen),))
        example = torch.empty((0,) * len(self.shape), dtype=dtype, device=dq_accum.device)
        self.call = KernelCall(key, lambda: _kernel("BwdPostprocessKernel", DTYPES[name], hdim,
                                                    varlen),
                               (TensorArg(dq_accum), TensorArg(example), 1.0))

    def __call__(self, dq_accum, scale: float, out=None):
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if not self.empty:
            self.call(dq_accum, out, scale)
        return out


def bwd_postprocess(dq_accum, scale: float, dtype, out=None):
    """dQ = dq_accum · scale as `dtype` (torch.bfloat16/float16), on the GPU.

    dq_accum: fp32 [b, sq, h, d] or varlen [total_q, h, d], 16-byte aligned rows, d % 4 == 0.
    Returns dq shaped like dq_accum, written into `out` (16-byte aligned, strides % 4 == 0)
    when given.
    """
    from flash_cute.runtime.jit import current_target

    return Postprocess(dq_accum, dtype, current_target())(dq_accum, float(scale), out)
