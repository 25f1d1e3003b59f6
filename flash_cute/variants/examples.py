"""Documented score and mask mods, in FlexAttention's form: each factory returns the plain torch
function a user would pass to `torch.nn.attention.flex_attention`, and flash-cute runs it
unchanged (`flash_attn_func(..., score_mod=..., mask_mod=...)`, traced by `tracer`).

    from flash_cute import flash_attn_func
    from flash_cute.variants.examples import alibi, document_mask

    out = flash_attn_func(q, k, v, causal=True, score_mod=alibi(slopes))
    out = flash_attn_func(q, k, v, mask_mod=document_mask(doc_ids))

Captured tensors stay run-time kernel arguments (a learnable table is read as it is at each
call); captured Python numbers become compile-time constants of the kernel.
`tools.kernel_config.example_spec` gives `inspect`'s registry the kernels' view of each
(`contract.mods.KernelMods`).
"""

import torch


def alibi(slopes: torch.Tensor):
    """ALiBi (Press et al.): score − slope[h] · |q_idx − kv_idx|; slopes fp32 [nheads]."""
    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return alibi_mod


def relative_bias(table: torch.Tensor, max_distance: int):
    """T5-style relative position bias from a table [nheads, 2 · max_distance + 1]: distances
    beyond ±max_distance share the end entries (the kernels' loads clamp their indices)."""
    def relative_bias_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + max_distance]
    return relative_bias_mod


def softcap(cap: float):
    """Gemma 2's logit soft-capping written as a mod: cap · tanh(score / cap)."""
    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap_mod


def document_mask(doc_ids: torch.Tensor):
    """Packed documents in one sequence, each attending causally to itself only; doc_ids
    int32 [batch, seqlen], the document of each position."""
    def document_mask_mod(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (kv_idx <= q_idx)
    return document_mask_mod


def prefix_lm(prefix_len: torch.Tensor):
    """Prefix-LM: bidirectional over each sequence's first prefix_len[b] positions, causal
    after; prefix_len int32 [batch]."""
    def prefix_lm_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix_len[b])
    return prefix_lm_mod


def sliding_window(window: int):
    """Causal sliding window: each query sees itself and the window − 1 keys before it."""
    def sliding_window_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    return sliding_window_mod


def _row_col_bias(q_bias, k_bias):
    """A rank-one bias, a factor per query times one per key (`inspect`'s learnable row- and
    column-indexed loads)."""
    def row_col_bias_mod(score, b, h, q_idx, kv_idx):
        return score + q_bias[q_idx] * k_bias[kv_idx]
    return row_col_bias_mod


def by_name() -> dict:
    """name -> (score_mod, mask_mod) over small stand-in tensors (ranks and dtypes as in use)."""
    heads = 4
    docs = (torch.arange(256) >= 100).to(torch.int32)[None]   # two documents
    return {
        "alibi": (alibi(torch.ones(heads)), None),
        "relative_bias": (relative_bias(torch.zeros(heads, 257), 128), None),
        "softcap": (softcap(30.0), None),
        "document": (None, document_mask(docs)),
        "prefix_lm": (None, prefix_lm(torch.zeros(1, dtype=torch.int32))),
        "sliding_window": (None, sliding_window(256)),
        "causal": (None, lambda b, h, q_idx, kv_idx: kv_idx <= q_idx),
        "row_col_bias": (_row_col_bias(torch.zeros(300), torch.zeros(300)), None),
        "alibi_document": (alibi(torch.ones(heads)),
                           document_mask(docs)),
    }
