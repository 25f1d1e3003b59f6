"""Incoherent processing (FA3): Q and K multiplied by M = D·H/√d, D a random ±1 diagonal and
H the d × d Hadamard matrix, before quantizing. M is orthogonal, so (QM)(KM)ᵀ = QKᵀ, and it
spreads a few large entries of a row over all of them, which per-block scales then fit.
On the CPU, H is applied as the fast Walsh–Hadamard transform: log2(d) butterfly stages of
torch operations, never a dense matmul."""

from __future__ import annotations

import math

import torch


def fwht(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh–Hadamard transform of the last dim (a power of two): x · H / √d."""
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
    """The ±1 diagonal of M, from `seed` (the same on every call with that seed)."""
    g = torch.Generator().manual_seed(int(seed))
    signs = torch.randint(0, 2, (d,), generator=g) * 2 - 1
    return signs.to(device=device, dtype=dtype)


def incoherent(q: torch.Tensor, k: torch.Tensor, seed: int = 0):
    """(Q·M, K·M) along the head dim (last), M = diag(±1)·H/√d from `seed`: QKᵀ unchanged."""
    signs = random_signs(q.shape[-1], seed, q.device, q.dtype)
    return fwht(q * signs), fwht(k * signs)
