"""Public API: `flash_attn_func` and `flash_attn_varlen_func`, with flash_attn.cute's names,
layouts and return convention ``(out, lse)``, and the dispatch to an arch pipeline.

Dispatch picks the newest pipeline that is built and runs on the device; ``arch=`` forces one
(e.g. ``arch="ampere"`` runs the sm80 pipeline on a Hopper GPU, for per-arch comparison).
"""

from typing import Optional, Tuple

import torch

from flash_cute.validation import AttentionProblem, validate_attention_inputs

# Pipelines by name: (minimum compute capability major, module with `forward`/`backward`).
PIPELINES = {"ampere": (8, "flash_cute.arch.ampere.api"),
             "hopper": (9, "flash_cute.arch.hopper.api")}
# Pipelines the dispatcher may pick on its own, newest first. A pipeline still being validated
# is in PIPELINES (reachable with arch=...) but not here.
DEFAULT_ORDER = ("ampere",)


def select_pipeline(device: torch.device, arch: Optional[str] = None) -> str:
    """The pipeline to run on `device`: `arch` if given (and able to run there), else the newest."""
    major = torch.cuda.get_device_capability(device)[0]
    if arch is not None:
        if arch not in PIPELINES:
            built = ", ".join(sorted(PIPELINES))
            raise NotImplementedError(f"arch={arch!r}: no such pipeline is built (built: {built})")
        if major < PIPELINES[arch][0]:
            raise ValueError(f"arch={arch!r} needs compute capability {PIPELINES[arch][0]}.x or "
                             f"newer; {torch.cuda.get_device_name(device)} is {major}.x")
        return arch
    for name in DEFAULT_ORDER:
        if major >= PIPELINES[name][0]:
            return name
    raise NotImplementedError(f"no pipeline runs on compute capability {major}.x")


def _pipeline_module(name: str):
    from importlib import import_module

    return import_module(PIPELINES[name][1])


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, problem: AttentionProblem, pipeline: str,
                deterministic: bool, return_lse: bool):
        out, lse = _pipeline_module(pipeline).forward(q, k, v, problem, cu_seqlens_q, cu_seqlens_k)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.problem, ctx.pipeline, ctx.deterministic = problem, pipeline, deterministic
        ctx.return_lse = return_lse
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        backward = getattr(_pipeline_module(ctx.pipeline), "backward", None)
        if backward is None:
            raise NotImplementedError(f"the {ctx.pipeline} pipeline has no backward pass yet")
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward(dout, dlse if ctx.return_lse else None, q, k, v, out, lse, ctx.problem,
                              cu_seqlens_q, cu_seqlens_k, ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None, None


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    arch: Optional[str] = None,
):
    """Exact attention on [batch, seqlen, nheads, hdim] tensors; returns ``(out, lse)``.

    ``lse`` is [batch, nheads, seqlen_q] fp32 (natural log), ``None`` unless `return_lse` or a
    backward pass needs it. Masks are bottom-right aligned; ``window_size=(left, right)`` with
    None (or a negative int) for an unbounded side; GQA/MQA when k/v have fewer heads.
    """
    problem = validate_attention_inputs(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                        window_size=window_size, softcap=softcap)
    return _run(q, k, v, None, None, problem, arch, deterministic, return_lse)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    arch: Optional[str] = None,
):
    """Attention over packed sequences: q [total_q, nheads, hdim], k/v [total_k, nheads_kv, d],
    int32 cu_seqlens [batch + 1]. Returns ``(out, lse)`` with lse [nheads, total_q]."""
    problem = validate_attention_inputs(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    return _run(q, k, v, cu_seqlens_q, cu_seqlens_k, problem, arch, deterministic, return_lse)


def _run(q, k, v, cu_seqlens_q, cu_seqlens_k, problem, arch, deterministic, return_lse):
    pipeline = select_pipeline(q.device, arch)
    module = _pipeline_module(pipeline)
    module.check_supported(problem)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if deterministic and needs_grad and not module.DETERMINISTIC_BACKWARD:
        raise NotImplementedError(f"deterministic=True: the {pipeline} pipeline's backward adds dQ "
                                  "with atomics and is not deterministic")
    out, lse = _FlashAttnFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, problem, pipeline,
                                    deterministic, return_lse)
    return out, (lse if (return_lse or needs_grad) else None)
