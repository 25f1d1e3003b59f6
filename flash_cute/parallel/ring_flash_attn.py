"""ring-flash-attention's names, for code written against it, with that package's
parameters and returns:

* `ring_flash_attn_func` (contiguous shards), `zigzag_ring_flash_attn_func` (zigzag),
  `stripe_flash_attn_func` (striped), each with its kvpacked and qkvpacked forms, and their
  `*_varlen_*` forms (packed documents, `cu_seqlens` the rank's local offsets: every
  document split evenly over the ranks), running `ring.ring_attention` (float32 partials
  between ranks);
* `llama3_flash_attn_varlen_func` (and its packed forms) with
  `llama3_flash_attn_prepare_cu_seqlens`: the packed stream split contiguously, documents
  crossing ranks; every rank gathers K/V and runs `flash_attn_varlen_func` on the keys its
  queries need (the all-gather's backward sums dK / dV back to their owners).
  `heads_k_stride` gathers K/V that many heads at a time (each chunk's attention runs
  before the next is gathered), to save memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flash_cute.parallel.ring import ring_attention


def _call(layout, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
          deterministic, return_attn_probs, group):
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes inside the ring: pass the bias as a score_mod to "
                         "flash_cute.parallel.ring_attention")
    out = ring_attention(q, k, v, group=group, layout=layout, causal=causal,
                         window_size=window_size, softmax_scale=softmax_scale,
                         dropout_p=dropout_p, return_lse=return_attn_probs)
    if return_attn_probs:
        out, lse = out
        return out, lse, None
    return out


def _varlen_call(layout, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size,
                 alibi_slopes, deterministic, return_attn_probs, group):
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes inside the ring: pass the bias as a score_mod to "
                         "flash_cute.parallel.ring_attention")
    world = dist.get_world_size(group or dist.group.WORLD)
    out = ring_attention(q, k, v, group=group, layout=layout, causal=causal,
                         window_size=window_size, softmax_scale=softmax_scale,
                         dropout_p=dropout_p, return_lse=return_attn_probs,
                         cu_seqlens=cu_seqlens.long() * world)
    if return_attn_probs:
        out, lse = out
        return out, lse, None
    return out


def _varlen_family(layout: str):
    def func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
             causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
             return_attn_probs=False, group=None):
        return _varlen_call(layout, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal,
                            window_size, alibi_slopes, deterministic, return_attn_probs, group)

    def kvpacked(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                 causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                 return_attn_probs=False, group=None):
        return func(q, kv[:, 0], kv[:, 1], cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                    causal, window_size, alibi_slopes, deterministic, return_attn_probs, group)

    def qkvpacked(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                  causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                  return_attn_probs=False, group=None):
        return func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, dropout_p,
                    softmax_scale, causal, window_size, alibi_slopes, deterministic,
                    return_attn_probs, group)

    for f, suffix in ((func, "varlen_func"), (kvpacked, "varlen_kvpacked_func"),
                      (qkvpacked, "varlen_qkvpacked_func")):
        f.__doc__ = (f"ring-flash-attention's `{suffix}` form over the {layout} layout: "
                     f"`cu_seqlens` this rank's offsets of the packed documents.")
    return func, kvpacked, qkvpacked


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size):
    """For the packed stream `cu_seqlens` (global offsets) split contiguously over
    `world_size` ranks: rank `rank`'s (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, local_k_slice). Its queries are stream rows [rank · T / w, (rank + 1) ·
    T / w); its keys the slice of the gathered stream from the start of its first document
    to its last row (causal) or its last document's end, cu_seqlens_k relative to it."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    if cu[-1] % world_size:
        raise ValueError(f"the packed stream's {cu[-1]} tokens do not split over {world_size} "
                         f"ranks: pad it to a multiple of {world_size}")
    per = cu[-1] // world_size
    lo, hi = rank * per, (rank + 1) * per
    docs = [(s, e) for s, e in zip(cu[:-1], cu[1:]) if e > lo and s < hi and e > s]
    q_bounds = [0] + [min(e, hi) - lo for _, e in docs]
    k_left = docs[0][0] if docs else lo
    k_right = hi if causal or not docs else docs[-1][1]
    k_bounds = [0] + [min(e, k_right) - k_left for _, e in docs]
    device = cu_seqlens.device
    cu_q = torch.tensor(q_bounds, dtype=torch.int32, device=device)
    cu_k = torch.tensor(k_bounds, dtype=torch.int32, device=device)
    lengths = lambda b: max((y - x for x, y in zip(b, b[1:])), default=0)  # noqa: E731
    return cu_q, cu_k, lengths(q_bounds), lengths(k_bounds), slice(k_left, k_right)


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, heads_k_stride, local_k_slice, dropout_p=0.0,
                                  softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None):
    """ring-flash-attention's Llama 3 context parallelism: q, k, v [t_local, h, d] this
    rank's contiguous part of the packed stream, the rest from
    `llama3_flash_attn_prepare_cu_seqlens`."""
    from torch.distributed.nn.functional import all_gather

    from flash_cute.flash_attn_interface import flash_attn_varlen_func

    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: pass the bias as a score_mod to "
                         "flash_cute.parallel.ring_attention")
    group = group or dist.group.WORLD
    heads_kv = k.shape[1]
    stride = heads_kv if not heads_k_stride or heads_k_stride <= 0 else heads_k_stride
    if heads_kv % stride:
        raise ValueError(f"heads_k_stride {heads_k_stride} must divide the {heads_kv} K/V "
                         f"heads")
    group_size = q.shape[1] // heads_kv
    outs, lses = [], []
    # A few K/V heads at a time: only their gathered keys are held at once.
    for h0 in range(0, heads_kv, stride):
        kv_heads, q_heads = slice(h0, h0 + stride), slice(h0 * group_size,
                                                           (h0 + stride) * group_size)
        k_all, v_all = (torch.cat(all_gather(t[:, kv_heads].contiguous(),
                                             group=group))[local_k_slice] for t in (k, v))
        res = flash_attn_varlen_func(q[:, q_heads], k_all, v_all, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, dropout_p=dropout_p,
                                     softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, deterministic=deterministic,
                                     return_attn_probs=return_attn_probs)
        out = res[0] if isinstance(res, tuple) else res
        outs.append(out)
        if isinstance(res, tuple):
            lses.append(res[1])
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    if not return_attn_probs:
        return out
    return out, torch.cat(lses, dim=0) if len(lses) > 1 else lses[0], None


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, heads_k_stride, local_k_slice,
                                           *args, **kwargs):
    """`llama3_flash_attn_varlen_func` with kv [t_local, 2, hk, d]."""
    return llama3_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, heads_k_stride,
                                         local_k_slice, *args, **kwargs)


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, heads_k_stride, local_k_slice,
                                            *args, **kwargs):
    """`llama3_flash_attn_varlen_func` with qkv [t_local, 3, h, d]."""
    return llama3_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q,
                                         cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         heads_k_stride, local_k_slice, *args, **kwargs)


def _family(layout: str):
    def func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
             alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
        return _call(layout, q, k, v, dropout_p, softmax_scale, causal, window_size,
                     alibi_slopes, deterministic, return_attn_probs, group)

    def kvpacked(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
        return func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                    window_size, alibi_slopes, deterministic, return_attn_probs, group)

    def qkvpacked(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
        return func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                    causal, window_size, alibi_slopes, deterministic, return_attn_probs, group)

    for f, suffix in ((func, "func"), (kvpacked, "kvpacked_func"),
                      (qkvpacked, "qkvpacked_func")):
        f.__doc__ = (f"ring-flash-attention's `{suffix}` form over the {layout} layout "
                     f"(`flash_cute.parallel.ring_attention`).")
    return func, kvpacked, qkvpacked


ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func = \
    _family("contiguous")
zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func, \
    zigzag_ring_flash_attn_qkvpacked_func = _family("zigzag")
stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func = \
    _family("striped")

ring_flash_attn_varlen_func, ring_flash_attn_varlen_kvpacked_func, \
    ring_flash_attn_varlen_qkvpacked_func = _varlen_family("contiguous")
zigzag_ring_flash_attn_varlen_func, zigzag_ring_flash_attn_varlen_kvpacked_func, \
    zigzag_ring_flash_attn_varlen_qkvpacked_func = _varlen_family("zigzag")
stripe_flash_attn_varlen_func, stripe_flash_attn_varlen_kvpacked_func, \
    stripe_flash_attn_varlen_qkvpacked_func = _varlen_family("striped")

__all__ = ["llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func",
           "llama3_flash_attn_varlen_kvpacked_func", "llama3_flash_attn_varlen_qkvpacked_func",
           "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
           "ring_flash_attn_varlen_qkvpacked_func", "stripe_flash_attn_varlen_func",
           "stripe_flash_attn_varlen_kvpacked_func", "stripe_flash_attn_varlen_qkvpacked_func",
           "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_kvpacked_func",
           "zigzag_ring_flash_attn_varlen_qkvpacked_func", "ring_flash_attn_func",
           "ring_flash_attn_kvpacked_func",
           "ring_flash_attn_qkvpacked_func", "stripe_flash_attn_func",
           "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
           "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
           "zigzag_ring_flash_attn_qkvpacked_func"]
