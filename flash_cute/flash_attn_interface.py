"""flash_attn 2's module, for code written against it: ``from flash_cute.flash_attn_interface
import flash_attn_func`` in place of ``from flash_attn.flash_attn_interface import ...``.

The functions take FlashAttention-2's parameters in its order, with its defaults (dropout_p
fourth, window_size=(-1, -1) for unbounded, softcap <= 0 for off) and its layouts (the packed
qkv [b, s, 3, h, d] and kv [b, s, 2, h_kv, d] forms, and their varlen [total, 3, h, d]
ones), and return like it: ``out``, or ``(out, softmax_lse, None)`` with
``return_attn_probs=True`` (the LSE that ring-attention code unpacks; the attention
probabilities and the dropout mask are not returned). They run flash-cute's kernels through
`flash_cute.flash_attn_func` / `flash_attn_varlen_func`.

``dropout_p`` > 0 is dropout in the kernels, forward and backward, with FA2's scaling (kept
weights times 1 / (1 - p)); the keep decision takes 16 random bits per element (not FA2's
8), so an element is kept with probability exactly ``flash_cute.reference.rng.keep_probability(p)``,
within 2^-17 of 1 - p, and the masks are not FA2's bit for bit. Not built yet, refused with
NotImplementedError: block_table (paged KV, the decode issue). alibi_slopes runs where flash-cute's
mods run (CPU tensors today; the GPU kernels refuse it until the variants issue).
"""

from flash_cute.api import interface
from flash_cute.api.kvcache import flash_attn_with_kvcache  # noqa: F401 - FA2's name, here too


def _refuse(block_table=None) -> None:
    if block_table is not None:
        raise NotImplementedError(
            "block_table in flash_attn 2's varlen function (its paged form, with cu_seqlens_k) "
            "is not taken here: use flash_attn_with_kvcache(block_table=...) or "
            "flash_cute.flash_attn_varlen_func(page_table=..., seqused_k=...)")


def _common(dropout_p, softmax_scale, causal, window_size, softcap, deterministic) -> dict:
    return dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                window_size=tuple(window_size), softcap=softcap if softcap > 0 else 0.0,
                deterministic=deterministic, return_lse=True)


def _result(out, lse, return_attn_probs):
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv [b, s, 3, h, d]; returns out [b, s, h, d] (see the module docstring)."""
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q [b, sq, h, d], kv [b, sk, 2, h_kv, d]."""
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q [b, sq, h, d], k/v [b, sk, h_kv, d] (GQA/MQA when h_kv < h); causal aligned
    bottom-right; softmax_lse [b, h, sq]."""
    out, lse = interface.flash_attn_func(
        q, k, v, alibi_slopes=alibi_slopes,
        **_common(dropout_p, softmax_scale, causal, window_size, softcap, deterministic))
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv [total, 3, h, d] with int32 cu_seqlens [b + 1]."""
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """q [total_q, h, d], kv [total_k, 2, h_kv, d]."""
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """q [total_q, h, d], k/v [total_k, h_kv, d] with int32 cu_seqlens [b + 1];
    softmax_lse [h, total_q]."""
    _refuse(block_table)
    out, lse = interface.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes,
        **_common(dropout_p, softmax_scale, causal, window_size, softcap, deterministic))
    return _result(out, lse, return_attn_probs)
