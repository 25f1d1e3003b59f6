"""`flash_cute.flash_attn_interface`, flash_attn 2's module (CPU: the operators' reference
implementation): FA2's parameter lists, layouts and returns."""

import inspect

import pytest
import torch

from flash_cute import flash_attn_interface as fa2
from flash_cute.reference import attention_ref, tolerance_check

BF16 = torch.bfloat16
_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
         ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
         ("deterministic", False), ("return_attn_probs", False)]
# flash-attn 2's parameter lists (flash_attn/flash_attn_interface.py), written out.
_FA2 = {
    "flash_attn_func": [("q", None), ("k", None), ("v", None)] + _TAIL,
    "flash_attn_qkvpacked_func": [("qkv", None)] + _TAIL,
    "flash_attn_kvpacked_func": [("q", None), ("kv", None)] + _TAIL,
    "flash_attn_varlen_func": [("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None),
                               ("cu_seqlens_k", None), ("max_seqlen_q", None),
                               ("max_seqlen_k", None)] + _TAIL + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [("qkv", None), ("cu_seqlens", None),
                                         ("max_seqlen", None)] + _TAIL,
    "flash_attn_varlen_kvpacked_func": [("q", None), ("kv", None), ("cu_seqlens_q", None),
                                        ("cu_seqlens_k", None), ("max_seqlen_q", None),
                                        ("max_seqlen_k", None)] + _TAIL,
}


_FA2["flash_attn_with_kvcache"] = [
    ("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None),
    ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
    ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
    ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
    ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
    ("return_softmax_lse", False)]


@pytest.mark.parametrize("name", sorted(_FA2))
def test_parameter_lists_are_flash_attn_2s(name):
    params = inspect.signature(getattr(fa2, name)).parameters.values()
    got = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
           for p in params]
    assert got == _FA2[name]


def _check(out, ref_args, **kw):
    ref, _ = attention_ref(*ref_args, mode="float64", **kw)
    nat, _ = attention_ref(*ref_args, mode="native", **kw)
    assert tolerance_check(out, ref, nat).ok


def test_padded_and_packed_forms():
    torch.manual_seed(0)
    qkv = torch.randn(2, 37, 3, 4, 64, dtype=BF16, requires_grad=True)
    out = fa2.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.unbind(2)
    _check(out, (q, k, v), causal=True)
    (g,) = torch.autograd.grad(out.float().sum(), qkv)
    assert g.shape == qkv.shape and g.abs().amax((0, 1, 3, 4)).min() > 0
    q = torch.randn(2, 37, 4, 64, dtype=BF16)
    kv = torch.randn(2, 50, 2, 2, 64, dtype=BF16)
    out, lse, probs = fa2.flash_attn_kvpacked_func(q, kv, window_size=(5, -1), softcap=-1.0,
                                                   return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 37)
    _check(out, (q, *kv.unbind(2)), window_size=(5, None))


def test_varlen_forms():
    torch.manual_seed(1)
    cu = torch.tensor([0, 10, 10, 41], dtype=torch.int32)
    qkv = torch.randn(41, 3, 4, 64, dtype=BF16)
    out = fa2.flash_attn_varlen_qkvpacked_func(qkv, cu, 31, causal=True)
    _check(out, qkv.unbind(1), causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    q, kv = torch.randn(41, 4, 64, dtype=BF16), torch.randn(41, 2, 1, 64, dtype=BF16)
    out, lse, _ = fa2.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 31, 31,
                                                      return_attn_probs=True)
    assert lse.shape == (4, 41)
    _check(out, (q, *kv.unbind(1)), cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_unbuilt_features_are_refused():
    q = torch.randn(1, 8, 2, 64, dtype=BF16)
    with pytest.raises(NotImplementedError, match="dropout"):
        fa2.flash_attn_func(q, q, q, 0.1)
    with pytest.raises(NotImplementedError, match="alibi"):
        fa2.flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="paged"):
        fa2.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8,
                                   block_table=torch.zeros(1, 1, dtype=torch.int32))
