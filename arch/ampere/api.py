"""Host entry of the Ampere pipeline: what it supports, and the forward launch with its cache."""

import torch

from flash_cute.validation import AttentionProblem
from flash_cute.variant import Variant

from .config import COMPILE_OPTIONS, SUPPORTED_HDIMS, TILES
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# dQ is accumulated with fp32 atomics, so its rounding depends on the order CTAs finish.
DETERMINISTIC_BACKWARD = False


def check_supported(problem: AttentionProblem) -> None:
    if (problem.hdim, problem.hdim_v) not in SUPPORTED_HDIMS:
        pairs = ", ".join(f"{a}/{b}" for a, b in sorted(SUPPORTED_HDIMS))
        raise NotImplementedError(
            f"the ampere pipeline has no kernel for hdim/hdim_v {problem.hdim}/{problem.hdim_v}; "
            f"supported: {pairs}"
        )


def forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None, tile=None):
    """(out, lse) for validated inputs; out has v's head dim, lse is fp32. `tile` overrides
    (tile_m, tile_n, num_warps) for ablations."""
    from cutlass import Int32
    import cutlass.cute as cute

    from flash_cute.jit import (DTYPES, CompileKey, attention_runtime_args, compile_cache, current_arch,
                                current_stream, to_cute_tensor)

    from .fwd import AmpereFwd

    out = torch.empty(*q.shape[:-1], problem.hdim_v, dtype=q.dtype, device=q.device)
    if problem.varlen:
        lse = torch.empty(problem.nheads, q.shape[0], dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty(problem.batch, problem.nheads, q.shape[1], dtype=torch.float32,
                          device=q.device)
    if out.numel() == 0 or problem.max_seqlen_q == 0:
        lse.fill_(-float("inf"))
        return out.zero_(), lse
    variant = Variant.from_problem(problem)
    dtype = _DTYPE_NAMES[q.dtype]
    tile = tuple(tile or TILES[problem.hdim])
    key = CompileKey("ampere.fwd", current_arch(), dtype, problem.hdim, problem.hdim_v, tile,
                     variant.flags())
    scalars, cu = attention_runtime_args(problem, cu_seqlens_q, cu_seqlens_k)
    args = (to_cute_tensor(q), to_cute_tensor(k), to_cute_tensor(v), to_cute_tensor(out),
            to_cute_tensor(lse, 4)) + scalars + (Int32(problem.max_seqlen_q),) + cu \
        + (current_stream(),)

    def build():
        kernel = AmpereFwd(DTYPES[dtype], problem.hdim, problem.hdim_v, variant, tile=tile)
        return cute.compile(kernel, *args, options=COMPILE_OPTIONS)

    compile_cache.get(key, build)(*args)
    return out, lse


def backward(dout, dlse, q, k, v, out, lse, problem: AttentionProblem, cu_seqlens_q=None,
             cu_seqlens_k=None, deterministic: bool = False):
    """(dq, dk, dv): preprocess (Δ, LSE·log2 e), the main kernel, then dQ's scale-and-convert.

    With GQA the kernel writes fp32 dK/dV per query head and the group is summed here.
    """
    from cutlass import Int32
    import cutlass.cute as cute

    from flash_cute.bwd_prep import bwd_postprocess, bwd_preprocess
    from flash_cute.jit import (DTYPES, CompileKey, attention_runtime_args, compile_cache, current_arch,
                                current_stream, to_cute_tensor)

    from .bwd import AmpereBwd
    from .config import BWD_TILES

    dout = dout.contiguous()
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta, lse_log2 = bwd_preprocess(out, dout, lse, dlse, cu_seqlens_q, problem.max_seqlen_q)
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    group = problem.nheads // problem.nheads_kv
    kv_lead = k.shape[:-2]
    dkv_dtype = torch.float32 if group > 1 else q.dtype
    dk = torch.empty(*kv_lead, problem.nheads, problem.hdim, dtype=dkv_dtype, device=q.device)
    dv = torch.empty(*kv_lead, problem.nheads, problem.hdim_v, dtype=dkv_dtype, device=q.device)
    variant = Variant.from_problem(problem)
    dtype = _DTYPE_NAMES[q.dtype]
    key = CompileKey("ampere.bwd", current_arch(), dtype, problem.hdim, problem.hdim_v,
                     BWD_TILES[problem.hdim][:3], variant.flags() + (("dkv_fp32", group > 1),))
    scalars, cu = attention_runtime_args(problem, cu_seqlens_q, cu_seqlens_k)
    dkv_align = 16 if group == 1 else 4
    args = (to_cute_tensor(q), to_cute_tensor(k), to_cute_tensor(v), to_cute_tensor(dout),
            to_cute_tensor(lse_log2, 4), to_cute_tensor(delta, 4), to_cute_tensor(dq_accum, 4),
            to_cute_tensor(dk, dkv_align), to_cute_tensor(dv, dkv_align)) + scalars \
        + (Int32(problem.max_seqlen_k),) + cu + (current_stream(),)

    def build():
        kernel = AmpereBwd(DTYPES[dtype], problem.hdim, problem.hdim_v, variant)
        return cute.compile(kernel, *args, options=COMPILE_OPTIONS)

    compile_cache.get(key, build)(*args)
    dq = bwd_postprocess(dq_accum, problem.softmax_scale, q.dtype)
    if group > 1:
        dk = dk.view(*kv_lead, problem.nheads_kv, group, problem.hdim).sum(-2).to(q.dtype)
        dv = dv.view(*kv_lead, problem.nheads_kv, group, problem.hdim_v).sum(-2).to(q.dtype)
    return dq, dk, dv
