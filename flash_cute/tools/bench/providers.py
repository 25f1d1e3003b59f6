"""Providers: the benchmarked implementations (flash-cute's kernels, flash-attn-4, torch
SDPA's cuDNN and flash backends, SDPA with flash-cute as its flash impl), loaded by name
(`load_provider`), the `Unavailable` exception, and `classify_error`, which sorts a
provider's failure on a cell into "unavailable" or "error". torch and the peers are imported
only when a provider is loaded or run."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

PROVIDERS = ("flash_cute", "fa4", "sdpa_cudnn", "sdpa_flash", "sdpa_flash_cute")
# Providers that run flash-cute's kernels (no peers of the ratio column).
OURS = ("flash_cute", "sdpa_flash_cute")


class Unavailable(Exception):
    """A provider cannot run a config (missing package, feature or kernel): reported
    in the table as n/a with this message, never as an error."""


@dataclass
class Provider:
    """A benchmarked implementation.

    `forward(q, k, v, causal)` takes [b, s, h, d] tensors and returns the [b, s, h, d]
    output; with requires_grad inputs the output carries the autograd graph, which is
    how the backward pass is timed. `context()` is entered around all calls of a cell
    (e.g. the SDPA backend selection) so it is not part of the timed callable.
    `unavailable` holds the reason when the provider cannot run at all. `fp8`: it takes
    e4m3 inputs with their descales (`cells.make_inputs` hangs them on the tensors).
    """

    name: str
    forward: Callable | None = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    unavailable: str | None = None
    fp8: bool = False


def _first(result):
    """flash-attn-4 convention: `out` or `(out, lse)`."""
    return result[0] if isinstance(result, (tuple, list)) else result


def load_flash_cute(arch: str = "auto") -> Provider:
    """Our kernels through `flash_cute.flash_attn_func`; `arch="auto"` passes no arch
    keyword so the library's own dispatch decides."""
    import flash_cute

    func = getattr(flash_cute, "flash_attn_func", None)
    if func is None:
        return Provider("flash_cute",
                        unavailable="flash_cute.flash_attn_func is not implemented yet")
    kwargs = {} if arch == "auto" else {"arch": arch}

    def forward(q, k, v, causal):
        descales = {f"{n}_descale": t.descale for n, t in zip("qkv", (q, k, v))
                    if getattr(t, "descale", None) is not None}
        return _first(func(q, k, v, causal=causal, **kwargs, **descales))

    return Provider("flash_cute", forward, fp8=True)


def load_fa4() -> Provider:
    """flash-attn-4 (`flash_attn.cute.flash_attn_func`), when installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # a broken install raises more than ImportError
        return Provider("fa4", unavailable=f"flash_attn.cute not importable: {exc}")

    def forward(q, k, v, causal):
        return _first(flash_attn_func(q, k, v, causal=causal))

    return Provider("fa4", forward)


def load_sdpa(name: str) -> Provider:
    """torch SDPA restricted to one backend ("sdpa_cudnn" or "sdpa_flash"), on
    [b, h, s, d] transposed views of the [b, s, h, d] storage."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_flash": SDPBackend.FLASH_ATTENTION}[name]

    def forward(q, k, v, causal):
        try:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        except RuntimeError as exc:
            status, reason = classify_error(exc)
            if status == "unavailable":
                raise Unavailable(reason) from exc
            raise
        return out.transpose(1, 2)

    return Provider(name, forward, context=lambda: sdpa_kernel(backend))


def load_sdpa_flash_cute() -> Provider:
    """torch SDPA's flash backend with flash-cute activated as its implementation
    (`flash_cute.integrations.sdpa`), only around this provider's calls."""
    import torch.nn.attention as attention

    if not hasattr(attention, "register_flash_attention_impl"):
        return Provider("sdpa_flash_cute", unavailable="torch has no flash-attention registry")
    from flash_cute.integrations import sdpa

    sdpa.register()
    flash = load_sdpa("sdpa_flash")

    @contextlib.contextmanager
    def context():
        attention.activate_flash_attention_impl(sdpa.IMPL)
        try:
            with flash.context():
                yield
        finally:
            attention.restore_flash_attention_impl()

    return Provider("sdpa_flash_cute", flash.forward, context=context)


def load_provider(name: str, arch: str = "auto") -> Provider:
    """Provider by name; never raises for a missing package (see Provider.unavailable)."""
    if name == "flash_cute":
        return load_flash_cute(arch)
    if name == "fa4":
        return load_fa4()
    if name in ("sdpa_cudnn", "sdpa_flash"):
        return load_sdpa(name)
    if name == "sdpa_flash_cute":
        return load_sdpa_flash_cute()
    raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS}")


def classify_error(exc: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception raised while running one provider on one cell.

    Missing features, missing kernels and out-of-memory are "unavailable" (a property of
    the config), anything else is an "error" (a bug worth looking at).
    """
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, (Unavailable, NotImplementedError, ImportError)):
        return "unavailable", text or type(exc).__name__
    lowered = str(exc).lower()
    if isinstance(exc, _oom_types()) or "out of memory" in lowered:
        return "unavailable", "out of memory"
    if "no available kernel" in lowered or "no viable backend" in lowered:
        return "unavailable", text
    return "error", f"{type(exc).__name__}: {text}"


def _oom_types() -> tuple[type, ...]:
    import torch

    return tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                             getattr(torch.cuda, "OutOfMemoryError", None)) if t)
