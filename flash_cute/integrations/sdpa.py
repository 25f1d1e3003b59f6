"""flash-cute as the flash-attention implementation behind `F.scaled_dot_product_attention`.

    import flash_cute.integrations.sdpa as fc_sdpa
    fc_sdpa.register()                                    # once: names the impl to torch
    torch.nn.attention.activate_flash_attention_impl("flash_cute")
    F.scaled_dot_product_attention(q, k, v, is_causal=True)   # SDPA's flash backend runs ours

torch's pluggable registry (`torch.nn.attention.register_flash_attention_impl`, in the torch
versions that have it) calls our register function on activation. It overrides, for CUDA,
the two operators SDPA's flash backend dispatches to (`aten::_scaled_dot_product_flash_
attention` and its backward) with ours, which run on every GPU flash-cute runs on (sm80 and
up, not only sm90/sm100). The kernels it replaces are kept (`torch.library.get_kernel`):
inputs flash-cute cannot take (fp32, a head dim with no kernel, ...) run them
instead, with a one-time warning naming the reason. Dropout runs in our kernels: the call's seed
(`rng.draw_seed`) travels in the rng_state slot (philox_seed) to the backward.
"""

import warnings

import torch

from flash_cute.reference.rng import draw_seed

IMPL = "flash_cute"
_FWD = "_scaled_dot_product_flash_attention"
_BWD = "_scaled_dot_product_flash_attention_backward"


def register() -> None:
    """Register flash-cute with torch's flash-attention registry (activation is the user's
    call, `torch.nn.attention.activate_flash_attention_impl("flash_cute")`)."""
    registry = getattr(torch.nn.attention, "register_flash_attention_impl", None)
    if registry is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no pluggable flash-attention registry "
            "(torch.nn.attention.register_flash_attention_impl); call flash_cute's functions "
            "directly, or upgrade torch")
    registry(IMPL, register_fn=_activate)


class _Handle:
    """What activation keeps alive: the library holding our kernels, and the previous ones."""

    def __init__(self, library, previous: dict):
        self.library, self.previous = library, previous

    def remove(self) -> None:
        self.library = None


_STATE = {"previous": {}, "warned": set()}


def _activate() -> _Handle:
    previous = {}
    for name in (_FWD, _BWD):
        try:
            previous[name] = torch.library.get_kernel(f"aten::{name}", "CUDA")
        except (AttributeError, RuntimeError):
            previous[name] = None   # a CPU-only torch, or one without get_kernel
    _STATE["previous"] = previous
    lib = torch.library.Library("aten", "IMPL", "CUDA")
    lib.impl(_FWD, _forward, "CUDA", with_keyset=True)
    lib.impl(_BWD, _backward, "CUDA", with_keyset=True)
    return _Handle(lib, previous)


def _fallback(name: str, reason: str, keyset, *args, **kwargs):
    kernel = _STATE["previous"].get(name)
    if kernel is None:
        raise RuntimeError(f"flash_cute SDPA: {reason}, and torch's own kernel for aten::{name} "
                           "could not be kept")
    if reason not in _STATE["warned"]:
        _STATE["warned"].add(reason)
        warnings.warn(f"flash_cute SDPA: {reason}; running torch's previous flash kernel",
                      stacklevel=3)
    return kernel.call_boxed(keyset, *args, **kwargs)


def _refusal(query, return_debug_mask=False):
    if return_debug_mask:
        return "return_debug_mask is not supported"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {query.dtype} has no kernel"
    return None


def _forward(keyset, query, key, value, dropout_p=0.0, is_causal=False,
             return_debug_mask=False, *, scale=None):
    args = (query, key, value, dropout_p, is_causal, return_debug_mask)
    reason = _refusal(query, return_debug_mask)
    if reason is None:
        # The backward redraws this call's dropout from its seed, kept in philox_seed.
        seed = draw_seed(query.device) if dropout_p > 0 else None
        try:
            # SDPA's [b, h, s, d] as our [b, s, h, d] views. needs_grad: a backward we could
            # not run would meet torch's kernel, whose dropout masks are not ours.
            out, lse = torch.ops.flash_cute.fwd(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None,
                None, None, None, None, scale, bool(is_causal), None, None, 0.0, None,
                torch.are_deterministic_algorithms_enabled(), None, True, 0, float(dropout_p),
                seed)
        except (TypeError, ValueError, NotImplementedError) as exc:
            reason = str(exc).split(";")[0]
    if reason is not None:
        return _fallback(_FWD, reason, keyset, *args, scale=scale)
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    if seed is not None:
        rng_state.view(torch.int64)[:1].copy_(seed)
    return (out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], rng_state,
            torch.zeros((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


def _backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
              max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    args = (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
            dropout_p, is_causal, philox_seed, philox_offset)
    reason = _refusal(query)
    if reason is None:
        seed = philox_seed.view(torch.int64)[:1] if dropout_p > 0 else None
        try:
            dq, dk, dv, _ = torch.ops.flash_cute.bwd(
                grad_out.transpose(1, 2), None, query.transpose(1, 2), key.transpose(1, 2),
                value.transpose(1, 2), out.transpose(1, 2), logsumexp, None, None, None, None,
                None, None, scale, bool(is_causal), None, None, 0.0, None,
                torch.are_deterministic_algorithms_enabled(), None, 0, float(dropout_p), seed)
        except (TypeError, ValueError, NotImplementedError) as exc:
            reason = str(exc).split(";")[0]
    if reason is not None:
        return _fallback(_BWD, reason, keyset, *args, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
