"""`flash_cute.flash_attn_interface`, flash_attn 2's module (CPU: the operators' reference
implementation): FA2's parameter lists, layouts and returns."""

import inspect

import pytest
import torch

from flash_cute import flash_attn_interface as fa2
from flash_cute.reference.attention import attention_ref, tolerance_check

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
    """FA2's parameters, in its order and with its defaults; flash-cute's own (the FP8
    forward's FA3 keywords on flash_attn_with_kvcache) only after them, keyword-only."""
    params = list(inspect.signature(getattr(fa2, name)).parameters.values())
    got = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
           for p in params[:len(_FA2[name])]]
    assert got == _FA2[name]
    extra = params[len(_FA2[name]):]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)
    assert [p.name for p in extra] in ([], ["q_descale", "k_descale", "v_descale",
                                            "out_dtype"])


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
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="paged"):
        fa2.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8,
                                   block_table=torch.zeros(1, 1, dtype=torch.int32))


def test_alibi_slopes_follow_flash_attn_2():
    """ALiBi as flash_attn 2 defines it: −slope · |i + sk − sq − j| added to the scaled score,
    slopes [nheads] or [batch, nheads], padded and varlen (each sequence's own lengths)."""
    torch.manual_seed(4)
    b, sq, sk, h, d = 2, 21, 40, 4, 64
    q, k, v = torch.randn(b, sq, h, d, dtype=BF16), torch.randn(b, sk, 2, d, dtype=BF16), \
        torch.randn(b, sk, 2, d, dtype=BF16)
    for slopes in (torch.rand(h), torch.rand(b, h)):
        out = fa2.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
        for i in range(b):
            s = slopes if slopes.dim() == 1 else slopes[i]
            bias = -s.double().view(h, 1, 1) * (torch.arange(sq).view(-1, 1) + sk - sq
                                                 - torch.arange(sk).view(1, -1)).abs()
            ref, nat = _alibi_ref(q[i], k[i], v[i], bias, causal=True)
            assert tolerance_check(out[i], ref, nat).ok
    cu_q = torch.tensor([0, 5, 21], dtype=torch.int32)
    cu_k = torch.tensor([0, 17, 40], dtype=torch.int32)
    slopes = torch.rand(b, h)
    out = fa2.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 16, 23, alibi_slopes=slopes)
    for i, (a, c, e, f) in enumerate(((0, 5, 0, 17), (5, 21, 17, 40))):
        lq, lk = c - a, f - e
        bias = -slopes[i].double().view(h, 1, 1) * (torch.arange(lq).view(-1, 1) + lk - lq
                                                    - torch.arange(lk).view(1, -1)).abs()
        ref, nat = _alibi_ref(q[0, a:c], k[0, e:f], v[0, e:f], bias)
        assert tolerance_check(out[a:c], ref, nat).ok
    with pytest.raises(ValueError, match="alibi_slopes must be fp32"):
        fa2.flash_attn_func(q, k, v, alibi_slopes=torch.rand(3))


def _alibi_ref(q, k, v, bias, causal=False):
    """float64 and bf16-native attention of one sequence [s, h, d] with an additive bias."""
    outs = []
    for dtype, mm in ((torch.float64, torch.float64), (torch.float32, BF16)):
        kk, vv = (t.repeat_interleave(q.shape[1] // k.shape[1], 1).to(mm) for t in (k, v))
        s = torch.einsum("qhd,khd->hqk", q.to(mm), kk).to(dtype) * q.shape[-1] ** -0.5
        s = s + bias.to(dtype)
        if causal:
            i, j = torch.arange(s.shape[1]).view(-1, 1), torch.arange(s.shape[2]).view(1, -1)
            s = s.masked_fill(j > i + s.shape[2] - s.shape[1], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1).to(mm), vv))
    return outs
