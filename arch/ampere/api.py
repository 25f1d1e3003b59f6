"""Host entry of the Ampere pipeline: what it supports, and the forward and backward launches."""

import torch

from flash_cute import launch
from flash_cute.validation import AttentionProblem
from flash_cute.variant import Variant

from .config import (BWD_TILES, COMPILE_OPTIONS, SUPPORTED_HDIMS, TILES, bwd_smem_bytes,
                     fwd_smem_bytes)

# dQ is accumulated with fp32 atomics, so its rounding depends on the order CTAs finish.
DETERMINISTIC_BACKWARD = False


def check_supported(problem: AttentionProblem, device=None, backward: bool = False) -> None:
    """Head dims with a kernel, and (given a device) tiles that fit its shared memory: sm86,
    sm89 and sm120 give a CTA about 99 KiB, the tables are sized for sm80/sm90."""
    launch.check_head_dims("ampere", problem, SUPPORTED_HDIMS)
    if device is not None:
        launch.check_shared_memory("ampere forward", fwd_smem_bytes(
            problem.hdim, problem.hdim_v, TILES[problem.hdim]), device)
        if backward:
            launch.check_shared_memory("ampere backward",
                                       bwd_smem_bytes(problem.hdim, problem.hdim_v), device)


def forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None, tile=None):
    """(out, lse) for validated inputs. `tile` overrides (tile_m, tile_n, num_warps) for
    ablations."""
    from flash_cute.jit import current_arch

    from .fwd import AmpereFwd

    return launch.forward("ampere.fwd", AmpereFwd, q, k, v, problem, cu_seqlens_q, cu_seqlens_k,
                          tuple(tile or TILES[problem.hdim]), COMPILE_OPTIONS, current_arch())


def backward(dout, dlse, q, k, v, out, lse, problem: AttentionProblem, cu_seqlens_q=None,
             cu_seqlens_k=None, deterministic: bool = False):
    """(dq, dk, dv): preprocess (Δ, LSE·log2 e), the main kernel, then dQ's scale-and-convert.

    With GQA the kernel writes fp32 dK/dV per query head and the group is summed here. Varlen
    dK/dV start at zero: rows after the last sequence get no gradient.
    """
    from cutlass import Int32
    import cutlass.cute as cute

    from flash_cute.bwd_prep import bwd_postprocess, bwd_preprocess
    from flash_cute.jit import (DTYPES, CompileKey, attention_runtime_args, compile_cache,
                                current_arch, current_stream, to_cute_tensor)

    from .bwd import AmpereBwd

    if launch.has_no_work(q, k, problem):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta, lse_log2 = bwd_preprocess(out, dout, lse, dlse, cu_seqlens_q, problem.max_seqlen_q)
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    group = problem.qheads_per_kvhead
    kv_lead = k.shape[:-2]
    dkv_dtype = torch.float32 if group > 1 else q.dtype
    alloc = torch.zeros if problem.varlen else torch.empty
    dk = alloc(*kv_lead, problem.nheads, problem.hdim, dtype=dkv_dtype, device=q.device)
    dv = alloc(*kv_lead, problem.nheads, problem.hdim_v, dtype=dkv_dtype, device=q.device)
    variant = Variant.from_problem(problem)
    dtype = launch.dtype_name(q.dtype)
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
