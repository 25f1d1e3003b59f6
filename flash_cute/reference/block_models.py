"""Plain-PyTorch models of the building blocks the CuTe DSL kernels are made of.

Each model does, block by block and in float32/float64, what a kernel does in
registers and shared memory, so the algorithm can be checked on the CPU against
:func:`flash_cute.reference.attention.attention_ref` before any GPU code exists:

* :class:`OnlineSoftmax` -- the running (max, sum, accumulator) state of one
  query tile, in the kernel's exp2 form with the softmax scale folded in.
* :func:`block_range` -- which K/V blocks a query block visits and which of them
  need masking; integer-only so the DSL kernel can reuse the very same formula.
* :func:`tiled_attention_forward` -- the FlashAttention-2 forward loop.
* :func:`lse_merge` -- combining partial results over disjoint key ranges
  (split-KV / the backward's LSE bookkeeping).
* :func:`exp2_poly` -- a software exp2 (FA4 style) to offload the MUFU unit.
* :func:`tile_order`, :func:`schedule_makespan` -- the order in which a forward
  launch's query tiles start, and how evenly SMs finish them (static persistent
  round robin vs. the hardware's one CTA per tile).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from flash_cute.contract.block_range import block_range
from flash_cute.contract.constants import EXP2_POLY_COEFFS
from flash_cute.reference.attention import Window, attention_mask, normalize_window

__all__ = [
    "EXP2_POLY_COEFFS",
    "EXP2_POLY_MAX_REL_ERR",
    "OnlineSoftmax",
    "OnlineSoftmaxModel",
    "block_range",
    "exp2_poly",
    "lse_merge",
    "schedule_makespan",
    "tile_order",
    "tiled_attention_forward",
]

LOG2_E = math.log2(math.e)

# ---------------------------------------------------------------------------
# Online softmax
# ---------------------------------------------------------------------------


class OnlineSoftmax:
    """Online-softmax state ``(M, l, acc)`` for a tile of query rows.

    Scores are kept *raw* (unscaled, as the QK^T MMA produces them); the true
    score is ``raw * scale``. The kernel folds the scale into the exponent,
    ``p = exp2(raw * scale_log2 - M)`` with ``scale_log2 = scale * log2(e)`` and
    ``M = max(raw) * scale_log2`` rounded once, so one FFMA feeds each exp2.

    * ``m`` [rows]: running M, the max of raw scores times ``scale_log2`` (-inf
      until a visible key is seen); every exponent, rescale and the LSE subtract
      this one value, so a max that stays put rescales by exactly 1,
    * ``l`` [rows]: running sum of ``p`` relative to ``M``,
    * ``acc`` [rows, hdim_v]: unnormalised output ``sum p * v`` relative to ``M``.

    ``fma`` (float32 states): the exponent ``raw * scale_log2 - M`` rounded once,
    as the kernel's FFMA does. Masked entries are passed in as -inf. While ``M``
    is -inf the exp2 offset is 0, so ``-inf - (-inf)`` (NaN) never occurs.
    """

    def __init__(self, rows: int, hdim_v: int, scale: float, dtype=torch.float64, device=None,
                 fma: bool = False):
        self.scale = scale
        # In the state's precision, as the kernel holds it (a float32 scalar).
        self.scale_log2 = torch.tensor(scale * LOG2_E, dtype=dtype).item() if dtype in (
            torch.float32, torch.float64) else scale * LOG2_E
        self.fma = fma
        self.m = torch.full((rows,), -math.inf, dtype=dtype, device=device)
        self.l = torch.zeros(rows, dtype=dtype, device=device)
        self.acc = torch.zeros(rows, hdim_v, dtype=dtype, device=device)

    def _exponent(self, scores: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        if not self.fma:
            return scores * self.scale_log2 - offset[:, None]
        exact = scores.double() * self.scale_log2 - offset.double()[:, None]
        return exact.to(scores.dtype)

    def update(self, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Absorb one K/V block: raw ``scores`` [rows, n] (-inf = masked), ``v`` [n, hdim_v].

        Returns the block's ``p`` [rows, n] (what the kernel feeds the PV MMA).
        """
        m_new = torch.maximum(self.m, scores.amax(dim=1) * self.scale_log2)
        offset = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        rescale = torch.exp2(self.m - offset)
        p = torch.exp2(self._exponent(scores, offset))
        self.l = self.l * rescale + p.sum(dim=1)
        self.acc = self.acc * rescale[:, None] + p @ v
        self.m = m_new
        return p

    def finalize(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return ``(O, LSE)``: ``O = acc / l``, ``LSE = (M + log2 l) * ln 2`` (natural log).

        Rows that saw no visible key (``l == 0``) get ``O = 0`` and ``LSE = -inf``.
        """
        empty = self.l == 0
        safe_l = torch.where(empty, torch.ones_like(self.l), self.l)
        out = torch.where(empty[:, None], torch.zeros_like(self.acc), self.acc / safe_l[:, None])
        lse = torch.where(empty, torch.full_like(self.l, -math.inf),
                          (self.m + torch.log2(safe_l)) * math.log(2.0))
        return out, lse


OnlineSoftmaxModel = OnlineSoftmax  # the name the DSL blocks' docstrings refer to


# ---------------------------------------------------------------------------
# Tiled forward (FlashAttention-2 loop)
# ---------------------------------------------------------------------------

Order = Union[str, Callable[[Sequence[int]], Sequence[int]], None]

# Out-of-bounds K/V rows of a partial last block hold whatever the smem tile
# had; a huge finite junk value makes a missing bounds mask visible in tests.
_OOB_JUNK = 1.0e4


def _block_order(blocks: Sequence[int], order: Order) -> list:
    """Apply ``order`` ("ascending", "descending" or a permutation callable)."""
    blocks = list(blocks)
    if order is None or order == "ascending":
        visit = blocks
    elif order == "descending":
        visit = blocks[::-1]
    elif callable(order):
        visit = [int(n) for n in order(blocks)]
    else:
        raise ValueError(f"order must be 'ascending', 'descending' or a callable, got {order!r}")
    if sorted(visit) != blocks:
        raise ValueError(f"order produced {visit}, not a permutation of {blocks}")
    return visit


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad dim 0 to ``rows`` with junk, as an out-of-bounds smem tile would hold."""
    pad = x.new_full((rows - x.shape[0],) + tuple(x.shape[1:]), _OOB_JUNK)
    return torch.cat([x, pad], dim=0)


def _tiled_head(q, k, v, mask, *, block_m, block_n, order, scale, softcap, window, pack=1):
    """FlashAttention-2 forward for one (batch, head): q [sq, d], k [sk, d], v [sk, dv]. With
    ``pack`` > 1, q and mask hold ``pack`` heads' rows interleaved (row r is query r // pack)."""
    rows_q, seqlen_k = q.shape[0], k.shape[0]
    n_blocks = (seqlen_k + block_n - 1) // block_n
    k, v = _pad_rows(k, n_blocks * block_n), _pad_rows(v, n_blocks * block_n)
    mask = torch.cat([mask, mask.new_zeros(rows_q, n_blocks * block_n - seqlen_k)], dim=1)
    # With softcap the kernel keeps tanh(raw * scale / softcap); the remaining
    # factor, softcap, becomes the scale folded into exp2.
    exp_scale = softcap if softcap > 0 else scale
    out = q.new_zeros(rows_q, v.shape[1])
    lse = q.new_empty(rows_q)
    for m_block in range((rows_q + block_m - 1) // block_m):
        rows = slice(m_block * block_m, min((m_block + 1) * block_m, rows_q))
        n_min, n_max, nm_min, nm_max = block_range(
            m_block, block_m, block_n, rows_q // pack, seqlen_k, False, window[0], window[1], pack
        )
        state = OnlineSoftmax(rows.stop - rows.start, v.shape[1], exp_scale, q.dtype, q.device)
        for n_block in _block_order(range(n_min, max(n_min, n_max)), order):
            cols = slice(n_block * block_n, (n_block + 1) * block_n)
            scores = q[rows] @ k[cols].T
            if softcap > 0:
                scores = torch.tanh(scores * (scale / softcap))
            if not nm_min <= n_block < nm_max:
                scores = scores.masked_fill(~mask[rows, cols], -math.inf)
            state.update(scores, v[cols])
        out[rows], lse[rows] = state.finalize()
    return out, lse


def tiled_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_m: int,
    block_n: int,
    order: Order = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Window = (None, None),
    softcap: float = 0.0,
    dtype: torch.dtype = torch.float64,
    pack_gqa: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Model of the tiled FlashAttention-2 forward; returns ``(out, lse)``.

    Layouts as :func:`~flash_cute.reference.attention.attention_ref` (batched, GQA
    allowed): ``q`` [b, sq, h, d], ``k``/``v`` [b, sk, h_kv, d/dv]; ``out``
    [b, sq, h, dv], ``lse`` [b, h, sq], computed in ``dtype``.

    For each query block only the K/V blocks of :func:`block_range` are
    visited, in ``order`` ("ascending" (default), "descending", or a callable
    returning a permutation of the block list), and the mask is applied only
    to blocks outside the no-mask range. K/V rows past ``seqlen_k`` hold junk,
    so a missing bounds mask shows up as a wrong result.

    ``pack_gqa``: the query heads that share a K/V head are tiled together, their rows
    interleaved (packed row r is query r // group of head r % group), as the Hopper forward's
    packed GQA tiles them; `block_range` and the mask then work on packed rows.
    """
    if (q.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]
            or q.shape[3] != k.shape[3]):
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"nheads {q.shape[2]} must be a multiple of nheads_kv {k.shape[2]}")
    if block_m < 1 or block_n < 1:
        raise ValueError("block sizes must be positive")
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else softmax_scale
    window = normalize_window(causal, window_size)
    mask = attention_mask(q.shape[1], k.shape[1], False, window, device=q.device)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    batch, seqlen_q, nheads, _ = q.shape
    group = nheads // k.shape[2]
    out = q.new_zeros(batch, seqlen_q, nheads, v.shape[3])
    lse = q.new_empty(batch, nheads, seqlen_q)
    kw = dict(block_m=block_m, block_n=block_n, order=order, scale=scale, softcap=softcap,
              window=window)
    for b in range(batch):
        if pack_gqa:
            for hk in range(k.shape[2]):
                heads = slice(hk * group, (hk + 1) * group)
                o, l = _tiled_head(q[b, :, heads].reshape(seqlen_q * group, -1), k[b, :, hk],
                                   v[b, :, hk], mask.repeat_interleave(group, dim=0),
                                   pack=group, **kw)
                out[b, :, heads] = o.view(seqlen_q, group, -1)
                lse[b, heads] = l.view(seqlen_q, group).T
            continue
        for h in range(nheads):
            out[b, :, h], lse[b, h] = _tiled_head(q[b, :, h], k[b, :, h // group],
                                                  v[b, :, h // group], mask, **kw)
    return out, lse


# ---------------------------------------------------------------------------
# LSE merge
# ---------------------------------------------------------------------------


def lse_merge(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention results over disjoint key ranges.

    ``o_parts`` [splits, ..., d] (each normalised over its own keys),
    ``lse_parts`` [splits, ...]. Returns ``(O, LSE)`` with
    ``LSE = log(sum_i exp(LSE_i))`` and ``O = sum_i exp(LSE_i - LSE) * O_i``.
    Parts with ``LSE_i = -inf`` (no visible key) contribute nothing, whatever
    their O; if all parts are -inf the result is ``O = 0``, ``LSE = -inf``.
    """
    if o_parts.shape[:-1] != lse_parts.shape:
        raise ValueError(f"o_parts {tuple(o_parts.shape)} does not match lse_parts "
                         f"{tuple(lse_parts.shape)}")
    lse_max = lse_parts.amax(dim=0)
    # All -inf: shift by 0 so exp(-inf - 0) = 0 rather than exp(NaN).
    lse_max = torch.where(torch.isneginf(lse_max), torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(lse_parts - lse_max)
    total = weights.sum(dim=0)
    empty = total == 0
    safe_total = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, -math.inf), lse_max + torch.log(safe_total))
    coeff = (weights / safe_total).unsqueeze(-1)
    out = torch.where(coeff > 0, coeff * o_parts, torch.zeros_like(o_parts)).sum(dim=0)
    return out, lse


# ---------------------------------------------------------------------------
# Software exp2
# ---------------------------------------------------------------------------

# Max relative error of exp2_poly vs. exact 2^x, measured in float32 on a
# 4M-point grid plus every integer of [-126, 127] (where the result is a
# normal float). On [-127, -126) the result is a denormal bit pattern and only
# the absolute error (< 2^-126) means anything -- irrelevant for softmax P.
EXP2_POLY_MAX_REL_ERR = {3: 1.04e-4, 4: 3.5e-6, 5: 2.0e-7}

_EXP2_MIN_INPUT = -127.0


def exp2_poly(x: torch.Tensor, degree: int = 3, fused: bool = False) -> torch.Tensor:
    """Software 2^x in float32: ``2^floor(x) * p(x - floor(x))``.

    ``fused``: each Horner step rounded once, as the kernels' FMA (`flash_cute.blocks.exp2_emu`)
    rounds it: the product is exact in float64 and the sum is rounded to float64, then to
    float32 (the same as one rounding unless the float64 sum lands exactly halfway between
    two float32 values, which an H200 comparison counts); otherwise a multiply and an add,
    each rounded to float32.

    Models the FA4 exp2 emulation step by step:

    1. clamp ``x >= -127`` so the exponent arithmetic cannot wrap (-inf -> 0);
    2. ``j = floor(x)`` -- in hardware, ``x + 1.5 * 2^23`` with round-down
       leaves ``j`` in the low mantissa bits; ``f = x - j`` is in [0, 1);
    3. ``p(f)`` by Horner with :data:`EXP2_POLY_COEFFS` (FMA chain, p(0) = 1);
    4. scale by ``2^j`` by adding ``j << 23`` to the float bits of ``p(f)``,
       valid because ``p(f)`` is in [1, 2) so its exponent field is 127.

    Inputs above 127 overflow the exponent field; softmax only feeds x <= 0.
    """
    if degree not in EXP2_POLY_COEFFS:
        raise ValueError(f"degree must be one of {sorted(EXP2_POLY_COEFFS)}, got {degree}")
    x = x.to(torch.float32).clamp(min=_EXP2_MIN_INPUT)
    j = torch.floor(x)
    f = x - j  # exact in float32
    poly = torch.zeros_like(f)
    for c in (*reversed(EXP2_POLY_COEFFS[degree]), 1.0):
        if fused:
            c32 = torch.tensor(c, dtype=torch.float32).double()
            poly = (poly.double() * f.double() + c32).float()
        else:
            poly = poly * f + c
    bits = poly.view(torch.int32) + (j.to(torch.int32) << 23)
    return bits.view(torch.float32)


# ---------------------------------------------------------------------------
# Tile order and schedule
# ---------------------------------------------------------------------------


def tile_order(num_m_blocks: int, num_heads: int, num_batches: int, *, lpt: bool,
               section: int = 1, persistent: bool = False, grid: int = 1) -> list:
    """``(m_block, head, batch)`` of every tile number of a launch, in number order: the
    kernels' own formula (:class:`flash_cute.contract.tile_order.TileOrder`). ``grid`` CTAs (a
    persistent launch's) walk them, CTA i taking numbers i, i + grid, ...; an empty number
    (folded persistent LPT) has m_block = num_m_blocks.
    """
    from flash_cute.contract.tile_order import TileOrder

    order = TileOrder(num_m_blocks, num_heads, num_batches, section, lpt, persistent)
    return [order.coords(t, grid) for t in range(order.num_numbers(grid))]


def schedule_makespan(work: Sequence[float], num_sms: int, persistent: bool) -> float:
    """Time until the last SM is done with the tiles of ``work`` (in number order), one CTA
    per SM.

    ``persistent``: a static round robin over ``min(len(work), num_sms)`` CTAs, CTA i doing
    numbers i, i + grid, ... Otherwise one CTA per number, which the hardware starts on
    whichever SM frees first: a greedy list schedule, and in LPT order LPT scheduling. Only
    the balance is modelled, not what persistence saves per tile (the next tile's loads
    under the last one's epilogue, CTA launches).
    """
    if persistent:
        loads = [0.0] * min(num_sms, len(work))
        for t, w in enumerate(work):
            loads[t % len(loads)] += w
        return max(loads, default=0.0)
    free = [0.0] * num_sms
    for w in work:
        heapq.heappush(free, heapq.heappop(free) + w)
    return max(free)
