"""The device side of one benchmark cell: fresh inputs, the reference output and gradients
(sdpa_flash, else float32 math SDPA), the sanity-check diffs, and each provider checked then
timed (`bench_provider`, `run_cell`). They take the device and the timer as arguments, so they
also run (slowly, with a fake timer) on the CPU."""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

from flash_cute.tools.bench.grid import BenchConfig
from flash_cute.tools.bench.providers import Provider, Unavailable, classify_error
from flash_cute.tools.bench.records import FP8_WRONG_TOL, WRONG_TOL, make_record


def make_inputs(cell: BenchConfig, dtype, device: str = "cuda"):
    """Fresh random q, k, v (requires_grad for bwd cells) and dout, all [b, s, h, d]. An FP8
    `dtype` (forward only): bf16 draws quantized per (batch, head), each FP8 tensor carrying
    its `descale` and its bf16 `dequantized` value (the reference's input)."""
    import torch

    shape = (cell.batch, cell.seqlen, cell.nheads, cell.hdim)
    if dtype.is_floating_point and dtype.itemsize == 1:
        return (*(_fp8_input(torch.randn(shape, device=device, dtype=torch.bfloat16), dtype)
                  for _ in range(3)), None)
    grad = cell.direction == "bwd"
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=grad)
               for _ in range(3))
    dout = torch.randn(shape, device=device, dtype=dtype) if grad else None
    return q, k, v, dout


def _fp8_input(x, dtype):
    from flash_cute.fp8 import dequantize_fp8, quantize_fp8

    x8, scale = quantize_fp8(x, block=None, dtype=dtype)
    x8.descale = scale
    x8.dequantized = dequantize_fp8(x8, scale, block=None).to(x.dtype)
    return x8


def is_fp8(t) -> bool:
    return getattr(t, "descale", None) is not None


def math_reference(q, k, v, causal: bool, max_bytes: int = 1 << 31):
    """float32 math-SDPA output in [b, s, h, d]; heads are processed in chunks so the
    materialized score matrix stays below `max_bytes` even at seqlen 16k."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, sq, h, _ = q.shape
    sk = k.shape[1]
    chunk = max(1, min(h, max_bytes // max(1, b * sq * sk * 4)))
    outs = []
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        for start in range(0, h, chunk):
            sl = slice(start, start + chunk)
            qc, kc, vc = (t[:, :, sl].float().transpose(1, 2) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)
                        .transpose(1, 2))
    return torch.cat(outs, dim=2)


def reference_output(q, k, v, causal: bool, flash: Provider | None):
    """(output, name) to check every provider against: sdpa_flash when it runs the
    config, else the float32 math reference; (None, reason) if neither fits."""
    import torch

    if flash is not None and flash.forward is not None:
        try:
            with flash.context(), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return flash.forward(q, k, v, causal), "sdpa_flash"
        except Exception:
            pass  # fall back to the math reference below
    try:
        return math_reference(q, k, v, causal), "math_fp32"
    except Exception as exc:
        return None, f"no reference: {classify_error(exc)[1]}"


def reference_grads(q, k, v, dout, causal: bool, flash: Provider | None):
    """(dq, dk, dv) of the same reference as `reference_output`, for bwd cells; None when no
    reference can run the cell."""
    import torch

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        if flash is not None and flash.forward is not None:
            with flash.context(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = flash.forward(*leaves, causal)
        else:
            out = math_reference(*leaves, causal)
        return torch.autograd.grad(out, leaves, dout)
    except Exception:
        return None


def grad_rel_diff(grads, ref_grads) -> float | None:
    """max over dq, dk, dv of max|g - g_ref| / max|g_ref| (NaN propagates)."""
    if ref_grads is None:
        return None
    rel = []
    for g, r in zip(grads, ref_grads):
        r = r.float()
        rel.append(((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-6)).item())
    return max(rel) if all(x == x for x in rel) else float("nan")


def max_abs_diff(out, ref) -> float | None:
    """max |out - ref| in float32 (NaN propagates, and is flagged WRONG)."""
    if ref is None:
        return None
    diff = (out.float() - ref.float()).abs()
    if diff.isnan().any():
        return float("nan")
    return diff.max().item()


def _free(device: str) -> None:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _warning_reason(caught: list) -> str:
    """Why a fused SDPA kernel was skipped: torch explains it in UserWarnings only."""
    texts = [" ".join(str(w.message).split()) for w in caught]
    return "; ".join(t for t in texts if t)[:300]


def bench_provider(provider: Provider, cell: BenchConfig, inputs, ref, timer,
                   device: str = "cuda", ref_grads=None) -> dict:
    """Sanity-check then time one provider on one cell; every failure becomes a record.

    `timer(fn) -> ms`. Forward times `forward(q, k, v)`; backward runs the forward once
    and times `torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)` alone.
    """
    import torch

    if provider.unavailable:
        return make_record(cell, provider.name, "unavailable", reason=provider.unavailable)
    q, k, v, dout = inputs
    fp8 = is_fp8(q)
    if fp8 and not provider.fp8:
        return make_record(cell, provider.name, "unavailable", reason="no FP8 path")
    tol = FP8_WRONG_TOL if fp8 else WRONG_TOL
    diff = gdiff = None
    out = fn = None
    try:
        with provider.context():
            with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    out = provider.forward(q, k, v, cell.causal)
                except Unavailable as exc:
                    detail = _warning_reason(caught)
                    raise Unavailable(f"{exc} ({detail})" if detail else str(exc)) from exc
            diff = max_abs_diff(out, ref)
            out = None
            fn = _timed_callable(provider, cell, q, k, v, dout)
            first = fn()  # first call compiles / raises here, outside the timed region
            if cell.direction == "bwd":
                gdiff = grad_rel_diff(first, ref_grads)
            first = None
            ms = timer(fn)
        return make_record(cell, provider.name, "ok", ms=ms, max_abs_diff=diff, grad_rel_diff=gdiff,
                           wrong_tol=tol)
    except Exception as exc:
        status, reason = classify_error(exc)
        return make_record(cell, provider.name, status, max_abs_diff=diff, reason=reason,
                           grad_rel_diff=gdiff, wrong_tol=tol)
    finally:
        del out, fn
        _free(device)


def _timed_callable(provider: Provider, cell: BenchConfig, q, k, v, dout) -> Callable:
    import torch

    if cell.direction == "fwd":
        return lambda: provider.forward(q, k, v, cell.causal)
    out = provider.forward(q, k, v, cell.causal)
    if out.grad_fn is None:
        raise NotImplementedError("forward output has no grad_fn (no backward pass)")
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def run_cell(cell: BenchConfig, providers: Sequence[Provider], dtype, timer,
             device: str = "cuda", reference_provider: Provider | None = None) -> list[dict]:
    """All providers on one cell, on the same fresh inputs; records carry the name of
    the reference used for the sanity check."""
    inputs = make_inputs(cell, dtype, device)
    plain = [getattr(t, "dequantized", t) for t in inputs[:3]]
    ref, ref_name = reference_output(*plain, cell.causal, reference_provider)
    ref_grads = None
    if cell.direction == "bwd":
        ref_grads = reference_grads(*inputs, cell.causal, reference_provider)
    try:
        records = [bench_provider(p, cell, inputs, ref, timer, device, ref_grads)
                   for p in providers]
    finally:
        del ref, ref_grads, inputs
        _free(device)
    for r in records:
        r["reference"] = ref_name
    return records


def cuda_healthy(device: str = "cuda") -> bool:
    """False after a sticky CUDA error (illegal address, ...): every later cell would
    fail too, so the run stops and keeps what it measured."""
    import torch

    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False
