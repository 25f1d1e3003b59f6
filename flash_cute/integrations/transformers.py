"""``attn_implementation="flash_cute"`` for Hugging Face transformers models.

    import flash_cute.integrations.transformers as fc_hf
    fc_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flash_cute")

`register()` adds flash-cute to transformers' attention registry (`AttentionInterface`) and
gives it the flash-attention mask (`AttentionMaskInterface`: the 2-D padding mask, or None
when nothing is padded), so:

* no padding: q, k, v go to `flash_attn_func` as they are (GQA unrepeated, causal from the
  layer, bottom-right aligned, which is what a KV cache needs at decode);
* padding (left or right, training or `generate`): tokens are unpadded to the packed layout
  and run through `flash_attn_varlen_func`, and the output is padded back with zeros;
* `sliding_window` and `softcap` (Gemma-2) map to window_size=(sliding_window - 1, 0) and
  softcap; `scaling` to softmax_scale; attention dropout (training) to the kernels'
  dropout_p.

transformers is an optional dependency (``pip install flash-cute[transformers]``).
"""

import torch

from flash_cute.api.interface import flash_attn_func, flash_attn_varlen_func

NAME = "flash_cute"


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` run flash-cute in transformers models."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention_forward)
    _claim_flash_name(name)
    try:
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:  # older transformers build the flash-attention mask by name
        return
    AttentionMaskInterface.register(name, flash_attention_mask)


def _claim_flash_name(name: str) -> None:
    """transformers treats every implementation whose name holds "flash" as a flash-attention
    package to import (else a hub kernel to download) when a model is built. Its loader is
    given flash-cute's FlashAttention-2 functions for `name`, so building a model finds them
    instead of failing; attention itself runs `attention_forward` (registered above)."""
    try:
        from transformers import modeling_flash_attention_utils as fa_utils
    except ImportError:
        return
    lazy_imports = getattr(fa_utils, "_lazy_imports", None)
    if lazy_imports is None or getattr(lazy_imports, "flash_cute_names", None) is not None:
        if lazy_imports is not None:
            lazy_imports.flash_cute_names.add(name)
        return
    from flash_cute import flash_attn_interface as fa2

    def claimed(implementation, *args, **kwargs):
        if implementation is not None and implementation.split("|")[-1] in claimed.flash_cute_names:
            return (fa2.flash_attn_func, fa2.flash_attn_varlen_func, None, fa_utils._pad_input,
                    fa_utils._unpad_input)
        return lazy_imports(implementation, *args, **kwargs)

    claimed.flash_cute_names = {name}
    fa_utils._lazy_imports = claimed


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function contract: query [b, h, sq, d], key/value
    [b, h_kv, sk, d] and a 2-D [b, sk] padding mask (1 = token) or None; returns
    (out [b, sq, h, d], None)."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"flash_cute expects the flash-attention 2-D padding mask, got a "
                         f"{attention_mask.dim()}-D mask; call "
                         f"flash_cute.integrations.transformers.register() before building "
                         f"the model")
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    window = (None, None)
    if sliding_window:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    opts = dict(softmax_scale=scaling, causal=causal, window_size=window,
                softcap=float(softcap or 0.0), dropout_p=float(dropout or 0.0))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))   # [b, s, h, d]
    if attention_mask is None or bool(attention_mask.all()):
        out, _ = flash_attn_func(q, k, v, **opts)
        return out, None
    return _unpadded(q, k, v, attention_mask.bool(), opts), None


def _unpadded(q, k, v, mask_k, opts):
    """Attention over the tokens `mask_k` marks (keys) and their last sq columns (queries),
    as packed sequences; padded query rows get zeros."""
    batch, sq = q.shape[:2]
    mask_q = mask_k[:, -sq:]
    lens_q, lens_k = mask_q.sum(1, dtype=torch.int32), mask_k.sum(1, dtype=torch.int32)
    cu_q = torch.nn.functional.pad(lens_q.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = torch.nn.functional.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    packed, _ = flash_attn_varlen_func(q[mask_q], k[mask_k], v[mask_k], cu_seqlens_q=cu_q,
                                       cu_seqlens_k=cu_k, max_seqlen_q=int(lens_q.max()),
                                       max_seqlen_k=int(lens_k.max()), **opts)
    out = packed.new_zeros(batch, sq, *packed.shape[1:])
    out[mask_q] = packed
    return out
