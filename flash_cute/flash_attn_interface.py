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
within 2^-17 of 1 - p, and the masks are not FA2's bit for bit. ``block_table`` in the varlen
function is refused with NotImplementedError (``flash_attn_with_kvcache(block_table=...)``
reads paged caches). ``alibi_slopes`` runs where flash-cute's mods run: the CPU reference and
the ampere and hopper kernels.
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


# The parameters every function shares, FA2's, appended to each docstring below.
_SHARED = """
    dropout_p: dropout of the attention weights (FA2's scaling), 0 for none.
    softmax_scale: the scores' scale (default 1 / sqrt(d)).
    causal: the causal mask, aligned bottom-right.
    window_size: (left, right), -1 for an unbounded side.
    softcap: > 0: cap · tanh(S / cap); <= 0 off.
    alibi_slopes: float32 [h] or [b, h], FA2's ALiBi.
    deterministic: a bitwise reproducible backward (the hopper pipeline's).
    return_attn_probs: return (out, softmax_lse, None) instead of out.

Returns:
    out, q's shape with v's head dim; or (out, softmax_lse, None) with
    `return_attn_probs` (softmax_lse float32 [b, h, sq], varlen [h, total_q]).

Raises:
    TypeError, ValueError: inputs flash_cute.flash_attn_func refuses (dtypes, shapes,
        devices, cu_seqlens), before any launch.
    NotImplementedError: a feature the GPU's pipeline lacks (deterministic=True on the
        ampere pipeline, a head dim without a kernel); block_table (varlen).
"""
_ARGS = {
    flash_attn_qkvpacked_func: "qkv: [b, s, 3, h, d].",
    flash_attn_kvpacked_func: "q: [b, sq, h, d].\n    kv: [b, sk, 2, h_kv, d].",
    flash_attn_func: "q: [b, sq, h, d], bf16 or fp16.\n    k: [b, sk, h_kv, d], h_kv dividing "
                     "h.\n    v: like k.",
    flash_attn_varlen_qkvpacked_func: "qkv: [total, 3, h, d].\n    cu_seqlens: int32 [b + "
                                      "1].\n    max_seqlen: the longest sequence.",
    flash_attn_varlen_kvpacked_func: "q: [total_q, h, d].\n    kv: [total_k, 2, h_kv, d]."
                                     "\n    cu_seqlens_q: int32 [b + 1].\n    cu_seqlens_k: "
                                     "int32 [b + 1].\n    max_seqlen_q: the longest query "
                                     "sequence.\n    max_seqlen_k: the longest key sequence.",
    flash_attn_varlen_func: "q: [total_q, h, d].\n    k: [total_k, h_kv, d].\n    v: like k."
                            "\n    cu_seqlens_q: int32 [b + 1].\n    cu_seqlens_k: int32 [b "
                            "+ 1].\n    max_seqlen_q: the longest query sequence.\n    "
                            "max_seqlen_k: the longest key sequence.\n    block_table: "
                            "refused (FA2's paged form).",
}
for _fn, _own in _ARGS.items():
    _fn.__doc__ = f"{_fn.__doc__}\n\nArgs:\n    {_own}{_SHARED}"

