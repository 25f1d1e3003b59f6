"""ring-flash-attention's names, for code written against it: `ring_flash_attn_func`
(contiguous shards), `zigzag_ring_flash_attn_func` (zigzag), `stripe_flash_attn_func`
(striped), each with its kvpacked and qkvpacked forms, with that package's parameters and
returns, running `ring.ring_attention` (float32 partials between ranks). The packed varlen
forms (`*_varlen_*`, `llama3_flash_attn_varlen_func`) are not here yet."""

from __future__ import annotations

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

__all__ = ["ring_flash_attn_func", "ring_flash_attn_kvpacked_func",
           "ring_flash_attn_qkvpacked_func", "stripe_flash_attn_func",
           "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
           "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
           "zigzag_ring_flash_attn_qkvpacked_func"]
