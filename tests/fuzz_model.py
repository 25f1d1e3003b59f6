"""The API fuzz's own model of attention and of a KV cache, written from the documented
semantics and sharing no code with flash_cute's reference or paging: one sequence at a
time, every mask, mod, sink and dropout decision spelled out on a dense score matrix, in a
chosen dtype (float64 for the oracle, the input dtype for the "PyTorch in bf16/fp16" error
the FlashAttention rule compares against)."""

import math

import torch

from flash_cute.reference.rng import keep_mask  # the dropout draws' specification


def attend(q, k, v, *, scale, causal=False, window=(None, None), softcap=0.0,
           score_mod=None, mask_mod=None, alibi=None, sink=None, dropout=None, seq=0,
           dtype=torch.float64):
    """One sequence: q [sq, h, d], k [sk, hk, d], v [sk, hk, dv] -> (out [sq, h, dv] in
    `dtype`, lse [h, sq] in float64 for the oracle, float32 otherwise). `seq`: the sequence's
    batch index (mods' b, dropout's stream); `dropout`: (p, seed); `alibi`: slopes [h]."""
    sq, h, _ = q.shape
    sk, hk = k.shape[:2]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    group = h // hk
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", qf, kf).to(acc) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    qi = torch.arange(sq)[None, :, None]
    ki = torch.arange(sk)[None, None, :]
    hi = torch.arange(h)[:, None, None]
    diag = qi + (sk - sq)                   # bottom-right alignment
    if alibi is not None:
        s = s - alibi.to(acc)[:, None, None] * (diag - ki).abs()
    if score_mod is not None:
        s = score_mod(s, torch.tensor(seq), hi, qi, ki).to(acc)
    seen = torch.ones(h, sq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        seen &= ki >= diag - left
    if right is not None:
        seen &= ki <= diag + right
    if mask_mod is not None:
        seen &= mask_mod(torch.tensor(seq), hi, qi, ki).bool()
    s = s.masked_fill(~seen, -math.inf)
    columns = s if sink is None else torch.cat(
        [s, sink.to(acc)[:, None, None].expand(h, sq, 1)], dim=-1)
    lse = torch.logsumexp(columns, dim=-1) if sk or sink is not None else \
        torch.full((h, sq), -math.inf, dtype=acc)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0) if sk else s
    if dropout is not None and sk:
        prob, seed = dropout
        keep = keep_mask(seed, prob, [seq], h, sq, sk, device="cpu")[0]
        p = torch.where(keep, p / (1.0 - prob), torch.zeros_like(p))
    out = torch.einsum("hqk,khd->qhd", p.to(dtype), vf)
    return out, lse


def rotate(x, cos, sin, positions, interleaved: bool):
    """Rotary embedding of x [b, s, h, d] at `positions` [b, s], on its first 2 · half dims,
    in float32, rounded back to x's dtype (flash_attn's formula)."""
    half = cos.shape[1]
    c = cos[positions].float()[:, :, None, :]
    s = sin[positions].float()[:, :, None, :]
    part = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = part[..., :half], part[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half:]), dim=-1)


def logical_rows(cache, table, b):
    """Sequence b's rows of a paged cache [pages, page_size, hk, d], page by page."""
    return torch.cat([cache[int(p)] for p in table[b]], dim=0)


def appended(cache, new, starts, *, table=None, entries=None):
    """The cache after writing new [b, s_new, hk, d] at positions starts[b] + i of each
    sequence (dense cache entry `entries[b]`, or through `table`), rows past the capacity
    dropped; a copy, built row by row."""
    out = cache.clone()
    for b in range(new.shape[0]):
        for i in range(new.shape[1]):
            pos = int(starts[b]) + i
            if table is not None:
                page_size = cache.shape[1]
                if 0 <= pos < table.shape[1] * page_size:
                    out[int(table[b, pos // page_size]), pos % page_size] = new[b, i]
            elif 0 <= pos < cache.shape[1]:
                out[b if entries is None else int(entries[b]), pos] = new[b, i]
    return out
