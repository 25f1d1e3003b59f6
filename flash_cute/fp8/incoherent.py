"""Incoherent processing (FA3): Q and K multiplied by M = D·H/√d, D a random ±1 diagonal and
H the d × d Hadamard matrix, before quantizing. M is orthogonal, so (QM)(KM)ᵀ = QKᵀ, and it
spreads a few large entries of a row over all of them, which per-block scales then fit.
H is applied as the fast Walsh–Hadamard transform, never a dense matmul: on the CPU (and
inside a caller's torch.compile, which traces and fuses them) log2(d) butterfly stages of
torch operations; on CUDA one Triton kernel per tensor, each program a block of rows held in
registers through the sign flip and every stage, rounded once to the input dtype. (Inductor
alone splits the stages into several kernels at their reshapes.)"""

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


_KERNEL = {}
# Rows per Triton program.
_BLOCK_ROWS = 16


def _triton_kernel():
    """The Triton FWHT kernel, built on first use (triton comes with CUDA builds of torch)."""
    if "fn" in _KERNEL:
        return _KERNEL["fn"]
    import triton
    import triton.language as tl

    @triton.jit
    def signed_fwht(x_ptr, signs_ptr, y_ptr, rows, scale, D: tl.constexpr,
                    LOG_D: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        c = tl.arange(0, D)
        offsets = r[:, None] * D + c[None, :]
        inside = r[:, None] < rows
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        x = x * tl.load(signs_ptr + c).to(tl.float32)[None, :]
        for i in tl.static_range(LOG_D):
            # Stage i pairs columns 2^i apart: (.., pair, 2, 2^i) as in `fwht`.
            y = tl.permute(tl.reshape(x, (BLOCK, D // (2 << i), 2, 1 << i)), (0, 1, 3, 2))
            a, b = tl.split(y)
            y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
            x = tl.reshape(y, (BLOCK, D))
        tl.store(y_ptr + offsets, (x * scale).to(y_ptr.dtype.element_ty), mask=inside)

    _KERNEL["fn"] = signed_fwht
    return signed_fwht


def _fused_signed_fwht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """`fwht(x * signs)` as one Triton kernel (fp32 in registers, one rounding at the end)."""
    d = x.shape[-1]
    if d & (d - 1) or d == 0:
        raise ValueError(f"the Walsh–Hadamard transform needs a power-of-two head dim, got {d}")
    rows = x.reshape(-1, d).contiguous()
    out = torch.empty_like(rows)
    n = rows.shape[0]
    grid = ((n + _BLOCK_ROWS - 1) // _BLOCK_ROWS,)
    _triton_kernel()[grid](rows, signs.contiguous(), out, n, 1.0 / math.sqrt(d), D=d,
                           LOG_D=d.bit_length() - 1, BLOCK=_BLOCK_ROWS)
    return out.reshape(x.shape)


def incoherent(q: torch.Tensor, k: torch.Tensor, seed: int = 0, fused=None):
    """(Q·M, K·M) along the head dim (last), M = diag(±1)·H/√d from `seed`: QKᵀ unchanged.

    Args:
        q: [..., d], d a power of two.
        k: [..., d], the same d.
        seed: picks the ±1 diagonal (`random_signs`); use the same for q and k.
        fused: run each transform as one Triton kernel; default: on CUDA tensors (and not
            inside a caller's torch.compile, which fuses the butterflies itself). False: the
            torch butterflies.

    Returns:
        (q · M, k · M), their shapes and dtypes.

    Raises:
        ValueError: d is not a power of two; fused=True with CPU tensors."""
    if fused and not q.is_cuda:
        raise ValueError("incoherent(fused=True) runs a Triton kernel: it needs CUDA tensors "
                         "(the CPU runs the butterflies, fused=None or False)")
    signs = random_signs(q.shape[-1], seed, q.device, q.dtype)
    # Inside a caller's torch.compile the butterflies are traced and fused with the rest.
    fused = (q.is_cuda if fused is None else fused) and not torch.compiler.is_compiling()
    transform = _fused_signed_fwht if fused else _signed_fwht
    return transform(q, signs), transform(k, signs)
