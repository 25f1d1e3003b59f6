"""The FP8 forward's computation in torch operations: the model the FP8 kernel is held to,
and what FP8 inputs run on the CPU. No FP8 arithmetic exists on the CPU, so every e4m3 value
is upcast (exactly) to float32 and every cast to e4m3 saturates first (`quant.to_e4m3`).

Per K/V tile of `tile_n` keys (a divisor of the 128-token scale block, so a tile has one K
and one V scale), visited as the kernel visits them:
  S = (Q₈ K₈ᵀ) · q_scale · k_scale · softmax_scale     (fp32 products and sums)
  m = max(m, rowmax S); l, O rescaled by exp2((m_old − m)·log2 e)
  P = exp2((S − m)·log2 e); l += rowsum P              (fp32 P, before its cast)
  P₈ = e4m3(P · 256)                                    (e4m3 flushes below 2⁻⁹)
  O += (P₈ V₈) · v_scale / 256                          (each tile's PV summed in fp32,
                                                         then added: two-level accumulation)
and O / l, LSE = m + log l at the end.
"""

from __future__ import annotations

import math

import torch

from flash_cute.fp8.quant import BLOCK, to_e4m3

P_SCALE = 256.0


def _per_token(scale: torch.Tensor, s: int, block) -> torch.Tensor:
    """[b, s, h] scales of each token (block scales repeated, or per-(b, h) ones broadcast)."""
    if block is None:
        return scale.float()[:, None, :].expand(scale.shape[0], s, scale.shape[1])
    return scale.float().repeat_interleave(block, dim=1)[:, :s]


def _visible(cols: torch.Tensor, sq: int, sk: int, causal: bool, window) -> torch.Tensor:
    """[sq, len(cols)] keys each query row sees: bottom-right aligned (row i is key
    i + sk - sq), inside the window (left, right; None unbounded), before sk."""
    rows = torch.arange(sq, device=cols.device)[:, None] + (sk - sq)
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    visible = cols[None, :] < sk
    if right is not None:
        visible = visible & (cols[None, :] <= rows + right)
    if left is not None:
        visible = visible & (cols[None, :] >= rows - left)
    return visible


def emulate(q8, k8, v8, q_scale, k_scale, v_scale, causal: bool = False,
            softmax_scale=None, tile_n: int = 128, block=BLOCK, window_size=(None, None),
            softcap: float = 0.0, seqused_k=None):
    """The FP8 forward's computation in torch, the model its kernel is held to.

    Masks align bottom-right, as the kernels do.

    Args:
        q8: e4m3 [b, sq, h, d].
        k8: e4m3 [b, sk, hk, d].
        v8: e4m3 [b, sk, hk, dv].
        q_scale: Q's scales (`quantize_fp8`'s): [b, ceil(sq / 128), h], or [b, h] with
            `block` None.
        k_scale: K's, [b, ceil(sk / 128), hk] or [b, hk].
        v_scale: V's, as K's.
        causal: the causal mask.
        softmax_scale: the scores' scale (default 1 / sqrt(d)).
        tile_n: the kernel's key tile: P is rounded to e4m3 against each tile's running max.
        block: the tokens per scale (None: one per (batch, head)).
        window_size: (left, right), None or negative for an unbounded side.
        softcap: > 0: cap · tanh(S / cap) of the scaled scores.
        seqused_k: int [b]: keys past it unseen, the mask aligned to it.

    Returns:
        (O float32 [b, sq, h, dv], LSE float32 [b, h, sq]); a row that sees no key has O = 0,
        LSE = −inf.

    Raises:
        ValueError: `tile_n` straddles the 128-token scale blocks."""
    if block is not None and BLOCK % tile_n and tile_n % BLOCK:
        raise ValueError(f"tile_n {tile_n} must divide the {BLOCK}-token scale block or be a "
                         f"multiple of it")
    if seqused_k is not None:
        # One batch entry at a time: each has its own key length and mask alignment.
        parts = [_emulate(q8[i:i + 1], k8[i:i + 1, :int(seqused_k[i])],
                          v8[i:i + 1, :int(seqused_k[i])], q_scale[i:i + 1], k_scale[i:i + 1],
                          v_scale[i:i + 1], causal, softmax_scale, tile_n, block, window_size,
                          softcap) for i in range(q8.shape[0])]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
    return _emulate(q8, k8, v8, q_scale, k_scale, v_scale, causal, softmax_scale, tile_n, block,
                    window_size, softcap)


def _emulate(q8, k8, v8, q_scale, k_scale, v_scale, causal, softmax_scale, tile_n, block,
             window_size, softcap):
    window = tuple(None if w is None or w < 0 else int(w) for w in window_size)
    b, sq, h, d = q8.shape
    sk, hk = k8.shape[1], k8.shape[2]
    group = h // hk
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    q = q8.float() * _per_token(q_scale, sq, block)[..., None]
    k_rep = k8.float().repeat_interleave(group, dim=2)
    v_rep = v8.float().repeat_interleave(group, dim=2)
    k_sc = _per_token(k_scale, sk, block).repeat_interleave(group, dim=2)   # [b, sk, h]
    v_sc = _per_token(v_scale, sk, block).repeat_interleave(group, dim=2)
    dev = q8.device
    m = torch.full((b, h, sq), -math.inf, device=dev)
    l = torch.zeros(b, h, sq, device=dev)
    o = torch.zeros(b, h, sq, v8.shape[3], device=dev)
    log2e = 1.0 / math.log(2.0)
    # Right to left, as the kernel visits K/V blocks: P is rounded to e4m3 against the
    # running max, so the order decides which max each block's P sees.
    for n0 in reversed(range(0, sk, tile_n)):
        cols = slice(n0, min(n0 + tile_n, sk))
        kt = k_rep[:, cols] * k_sc[:, cols, :, None]
        s_tile = torch.einsum("bqhd,bkhd->bhqk", q, kt) * scale
        if softcap:
            s_tile = softcap * torch.tanh(s_tile / softcap)
        if causal or window != (None, None):
            visible = _visible(torch.arange(cols.start, cols.stop, device=dev), sq, sk, causal,
                               window)
            s_tile = s_tile.masked_fill(~visible, -math.inf)
        m_new = torch.maximum(m, s_tile.amax(dim=-1))
        safe = torch.where(torch.isinf(m_new), 0.0, m_new)
        corr = torch.where(torch.isinf(m), 0.0, torch.exp2((m - safe) * log2e))
        p = torch.exp2((s_tile - safe[..., None]) * log2e)
        l = l * corr + p.sum(-1)
        p8 = to_e4m3(p * P_SCALE).float()
        # One V scale per key row (per tile, as tile_n divides the scale block).
        pv = torch.einsum("bhqk,bkhd->bhqd", p8, v_rep[:, cols] * v_sc[:, cols, :, None])
        o = o * corr[..., None] + pv / P_SCALE
        m = m_new
    lse = torch.where(l > 0, m + torch.log(l), torch.full_like(l, -math.inf))
    out = torch.where(l[..., None] > 0, o / l.clamp(min=1e-30)[..., None], 0.0)
    return out.transpose(1, 2).contiguous(), lse
