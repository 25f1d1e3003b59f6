"""Incoherent processing (FA3): Q and K multiplied by M = D·H/√d, D a random ±1 diagonal and
H the d × d Hadamard matrix, before quantizing. M is orthogonal, so (QM)(KM)ᵀ = QKᵀ, and it
spreads a few large entries of a row over all of them, which per-block scales then fit.
H is applied as the fast Walsh–Hadamard transform: log2(d) butterfly stages of torch
operations, never a dense matmul. On CUDA the stages and the sign flip run as one kernel:
the same function through torch.compile, whose Inductor fuses the pointwise stages (one pass
over the rows instead of log2(d) + 1)."""

from __future__ import annotations

import math

import torch


def fwht(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh–Hadamard transform of the last dim: x · H / √d, in log2(d)
    butterfly stages.

    Args:
        x: any shape whose last dim d is a power of two.

    Returns:
        x's shape and dtype.

    Raises:
        ValueError: the last dim is not a power of two."""
    d = x.shape[-1]
    if d & (d - 1) or d == 0:
        raise ValueError(f"the Walsh–Hadamard transform needs a power-of-two head dim, got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(*lead, d) / math.sqrt(d)


def random_signs(d: int, seed: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The ±1 diagonal of M, from `seed` (the same on every call with that seed).

    Args:
        d: the head dim.
        seed: any integer.
        device: where the result lives (default: the CPU).
        dtype: its dtype (default: float32).

    Returns:
        [d] of ±1.

    Raises:
        Nothing of its own."""
    g = torch.Generator().manual_seed(int(seed))
    signs = torch.randint(0, 2, (d,), generator=g) * 2 - 1
    return signs.to(device=device, dtype=dtype)


def _signed_fwht(rows: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    return fwht(rows * signs)


_FUSED = {}


def _fused_signed_fwht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """`fwht(x * signs)` as one compiled kernel: rows [n, d] with n dynamic, so a new batch or
    length reuses it (one compile per head dim and dtype)."""
    if "fn" not in _FUSED:
        _FUSED["fn"] = torch.compile(_signed_fwht, fullgraph=True)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > 1:  # a single row is specialized by the compiler whatever we mark
        torch._dynamo.mark_dynamic(rows, 0)
    return _FUSED["fn"](rows, signs).reshape(x.shape)


def incoherent(q: torch.Tensor, k: torch.Tensor, seed: int = 0, fused=None):
    """(Q·M, K·M) along the head dim (last), M = diag(±1)·H/√d from `seed`: QKᵀ unchanged.

    Args:
        q: [..., d], d a power of two.
        k: [..., d], the same d.
        seed: picks the ±1 diagonal (`random_signs`); use the same for q and k.
        fused: run each transform as one compiled kernel (torch.compile); default: on CUDA
            tensors. False: the torch butterflies.

    Returns:
        (q · M, k · M), their shapes and dtypes.

    Raises:
        ValueError: d is not a power of two."""
    signs = random_signs(q.shape[-1], seed, q.device, q.dtype)
    # Inside a caller's torch.compile the butterflies are traced and fused with the rest
    # (a compiled function within the trace could not mark its rows dynamic).
    fused = (q.is_cuda if fused is None else fused) and not torch.compiler.is_compiling()
    transform = _fused_signed_fwht if fused else _signed_fwht
    return transform(q, signs), transform(k, signs)
