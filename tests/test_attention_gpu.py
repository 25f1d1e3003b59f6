"""flash_attn_func / flash_attn_varlen_func against the float64 reference, by the FlashAttention
rule (our error <= 2x the error of a bf16/fp16 PyTorch implementation, plus rounding atol).

Each pipeline that is built runs the same matrix (``PIPELINES``): dtypes, head dims (including
dqk != dv), causal / local / softcap / scale, GQA and MQA, odd lengths, seqlen_q != seqlen_k,
fully masked rows, varlen with a zero-length sequence. Outputs are poisoned with NaN first.
"""

import math

import pytest
import torch
from attention_checks import check_forward

from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.reference.attention import attention_ref, tolerance_check

pytestmark = pytest.mark.gpu

PIPELINES = ["ampere", "hopper"]  # pipelines with a forward
BWD_PIPELINES = ["ampere", "hopper"]  # pipelines with a backward


def _inputs(batch, sq, sk, h, hk, d, dv, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    return make(batch, sq, h, d), make(batch, sk, hk, d), make(batch, sk, hk, dv)


# (hdim, hdim_v, causal, window, softcap, dtype): each line is one compiled kernel.
KERNELS = [
    (64, 64, False, (None, None), 0.0, torch.bfloat16),
    (64, 64, True, (None, None), 0.0, torch.float16),
    (96, 96, False, (None, None), 0.0, torch.bfloat16),
    (96, 96, True, (None, None), 0.0, torch.bfloat16),
    (128, 128, False, (None, None), 0.0, torch.bfloat16),
    (128, 128, True, (None, None), 0.0, torch.bfloat16),
    (128, 128, False, (None, None), 0.0, torch.float16),
    (192, 192, False, (None, None), 0.0, torch.bfloat16),
    (192, 192, True, (None, None), 0.0, torch.float16),
    (256, 256, False, (None, None), 0.0, torch.bfloat16),
    (256, 256, True, (None, None), 0.0, torch.bfloat16),
    (192, 128, False, (None, None), 0.0, torch.bfloat16),
    (192, 128, True, (None, None), 0.0, torch.bfloat16),
    (64, 64, False, (97, 33), 0.0, torch.bfloat16),
    (128, 128, True, (200, None), 0.0, torch.bfloat16),
    (128, 128, False, (None, None), 15.0, torch.bfloat16),
    (128, 128, False, (61, 40), 15.0, torch.bfloat16),
    (64, 64, True, (None, None), 30.0, torch.float16),
]
SHAPES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_kv
    (2, 113, 203, 4, 4),
    (1, 300, 130, 8, 1),  # MQA; causal: the first 170 rows see no key
    (3, 1, 1, 2, 2),
]


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("hdim,hdim_v,causal,window,softcap,dtype", KERNELS)
@pytest.mark.parametrize("batch,sq,sk,h,hk", SHAPES)
def test_forward_matches_float64(pipeline, hdim, hdim_v, causal, window, softcap, dtype,
                                 batch, sq, sk, h, hk):
    q, k, v = _inputs(batch, sq, sk, h, hk, hdim, hdim_v, dtype, seed=sq * 7 + hdim)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = flash_attn_func(q, k, v, return_lse=True, arch=pipeline, **kw)
    assert out.shape == (batch, sq, h, hdim_v) and lse.shape == (batch, h, sq)
    check_forward(out, lse, q, k, v, **kw)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_forward_long_gqa_8_to_1_with_scale(pipeline):
    q, k, v = _inputs(2, 1537, 2049, 16, 2, 128, 128, torch.bfloat16, seed=1)
    out, lse = flash_attn_func(q, k, v, softmax_scale=0.05, causal=True, return_lse=True,
                               arch=pipeline)
    check_forward(out, lse, q, k, v, softmax_scale=0.05, causal=True)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_fully_masked_rows_give_zero_and_neg_inf(pipeline):
    q, k, v = _inputs(1, 200, 70, 2, 2, 64, 64, torch.bfloat16, seed=2)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, arch=pipeline)
    empty = slice(0, 130)  # row i sees keys <= i - 130
    assert (out[:, empty] == 0).all()
    assert torch.isneginf(lse[:, :, empty]).all()
    assert torch.isfinite(lse[:, :, 130:]).all()


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("causal,hdim", [(False, 128), (True, 64)])
def test_varlen_with_empty_sequence(pipeline, causal, hdim):
    seqlens_q, seqlens_k = [37, 0, 129, 1, 300], [50, 17, 0, 1, 257]
    cu_q = torch.tensor([0] + list(torch.tensor(seqlens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(seqlens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(sum(seqlens_q), 6, hdim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(sum(seqlens_k), 2, hdim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(sum(seqlens_k), 2, hdim, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
                                      causal=causal, return_lse=True, arch=pipeline)
    assert out.shape == q.shape and lse.shape == (6, sum(seqlens_q))
    check_forward(out, lse, q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_every_output_element_is_written(pipeline, monkeypatch):
    """Poison the allocator's outputs with NaN: any element the kernel skips stays NaN."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    q, k, v = _inputs(2, 333, 251, 4, 2, 128, 128, torch.bfloat16, seed=4)
    out, lse = flash_attn_func(q, k, v, return_lse=True, arch=pipeline)
    monkeypatch.undo()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    check_forward(out, lse, q, k, v)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_new_lengths_reuse_the_compiled_kernel(pipeline):
    from flash_cute.runtime.jit import compile_cache

    q, k, v = _inputs(1, 100, 100, 2, 2, 64, 64, torch.bfloat16, seed=5)
    flash_attn_func(q, k, v, arch=pipeline)
    before = len(compile_cache)
    for sq, sk, b in [(777, 555, 3), (64, 4096, 1)]:
        q, k, v = _inputs(b, sq, sk, 2, 2, 64, 64, torch.bfloat16, seed=sq)
        out, lse = flash_attn_func(q, k, v, return_lse=True, arch=pipeline)
        check_forward(out, lse, q, k, v)
    assert len(compile_cache) == before


def _grads(fn, q, k, v, dout):
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(qg, kg, vg)
    return torch.autograd.grad(out, (qg, kg, vg), dout)


def _check_backward(pipeline, q, k, v, dout, **kw):
    ours = _grads(lambda a, b, c: flash_attn_func(a, b, c, arch=pipeline, **kw)[0], q, k, v, dout)
    ref = _grads(lambda a, b, c: attention_ref(a, b, c, mode="float64", **kw)[0],
                 q.double(), k.double(), v.double(), dout.double())
    nat = _grads(lambda a, b, c: attention_ref(a, b, c, mode="native", **kw)[0], q, k, v, dout)
    for name, g, g_ref, g_nat in zip(("dQ", "dK", "dV"), ours, ref, nat):
        assert g.shape == g_ref.shape and g.dtype == q.dtype
        res = tolerance_check(g, g_ref, g_nat)
        assert res.ok, f"{name}: err {res.err:.3e} vs native {res.err_native:.3e} (+atol {res.atol:.1e})"


@pytest.mark.parametrize("pipeline", BWD_PIPELINES)
@pytest.mark.parametrize("hdim,hdim_v,causal,window,softcap,dtype", KERNELS)
@pytest.mark.parametrize("batch,sq,sk,h,hk", SHAPES)
def test_backward_matches_float64(pipeline, hdim, hdim_v, causal, window, softcap, dtype,
                                  batch, sq, sk, h, hk):
    q, k, v = _inputs(batch, sq, sk, h, hk, hdim, hdim_v, dtype, seed=sq * 5 + hdim)
    dout = torch.randn(batch, sq, h, hdim_v, device="cuda", dtype=dtype)
    _check_backward(pipeline, q, k, v, dout, causal=causal, window_size=window, softcap=softcap)


@pytest.mark.parametrize("pipeline", BWD_PIPELINES)
def test_backward_long_gqa_8_to_1(pipeline):
    q, k, v = _inputs(2, 1031, 2047, 16, 2, 128, 128, torch.bfloat16, seed=11)
    dout = torch.randn_like(q)
    _check_backward(pipeline, q, k, v, dout, causal=True, softmax_scale=0.07)


@pytest.mark.parametrize("pipeline", BWD_PIPELINES)
def test_backward_through_lse(pipeline):
    """A loss that uses the returned LSE too: its gradient enters as dS = P (dP - (Δ - dLSE))."""
    q, k, v = _inputs(2, 157, 211, 4, 2, 64, 64, torch.bfloat16, seed=12)
    dout = torch.randn(2, 157, 4, 64, device="cuda", dtype=torch.bfloat16)
    dlse = torch.randn(2, 4, 157, device="cuda")

    def loss_grads(fn, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out, lse = fn(*leaves)
        loss = (out.double() * dout.double()).sum() + (lse.double() * dlse.double()).sum()
        return torch.autograd.grad(loss, leaves)

    ours = loss_grads(lambda a, b, c: flash_attn_func(a, b, c, causal=True, return_lse=True,
                                                      arch=pipeline), (q, k, v))
    ref = loss_grads(lambda a, b, c: attention_ref(a, b, c, causal=True, mode="float64"),
                     (q.double(), k.double(), v.double()))
    nat = loss_grads(lambda a, b, c: attention_ref(a, b, c, causal=True, mode="native"), (q, k, v))
    for name, g, g_ref, g_nat in zip(("dQ", "dK", "dV"), ours, ref, nat):
        res = tolerance_check(g, g_ref, g_nat)
        assert res.ok, f"{name}: err {res.err:.3e} vs native {res.err_native:.3e}"


@pytest.mark.parametrize("pipeline", BWD_PIPELINES)
def test_backward_varlen_with_empty_sequence(pipeline):
    seqlens_q, seqlens_k = [37, 0, 129, 1, 300], [50, 17, 0, 1, 257]
    cu_q = torch.tensor([0] + list(torch.tensor(seqlens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(seqlens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(13)
    q = torch.randn(sum(seqlens_q), 6, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(sum(seqlens_k), 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(sum(seqlens_k), 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn_like(q)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    ours = _grads(lambda a, b, c: flash_attn_varlen_func(
        a, b, c, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k), causal=True, arch=pipeline)[0],
        q, k, v, dout)
    ref = _grads(lambda a, b, c: attention_ref(a, b, c, mode="float64", **kw)[0],
                 q.double(), k.double(), v.double(), dout.double())
    nat = _grads(lambda a, b, c: attention_ref(a, b, c, mode="native", **kw)[0], q, k, v, dout)
    for name, g, g_ref, g_nat in zip(("dQ", "dK", "dV"), ours, ref, nat):
        res = tolerance_check(g, g_ref, g_nat)
        assert res.ok, f"{name}: err {res.err:.3e} vs native {res.err_native:.3e}"


@pytest.mark.parametrize("pipeline", ["ampere"])
def test_nondeterministic_backward_refuses_deterministic_before_launch(pipeline):
    """Ampere's backward adds dQ with unordered atomics and refuses deterministic=True before
    any launch (the forward alone still runs); Hopper's orders them (test_hopper_bwd_gpu.py)."""
    q, k, v = _inputs(1, 64, 64, 2, 2, 64, 64, torch.bfloat16, seed=14)
    q.requires_grad_()
    with pytest.raises(NotImplementedError, match="deterministic"):
        flash_attn_func(q, k, v, deterministic=True, arch=pipeline)
    out, _ = flash_attn_func(q.detach(), k, v, deterministic=True, arch=pipeline)
    assert out.shape == (1, 64, 2, 64)


def test_unknown_or_unbuilt_pipeline_is_a_clear_error():
    q, k, v = _inputs(1, 16, 16, 1, 1, 64, 64, torch.bfloat16, seed=15)
    with pytest.raises(NotImplementedError, match="no such pipeline"):
        flash_attn_func(q, k, v, arch="volta")
    with pytest.raises(NotImplementedError, match="hdim"):
        flash_attn_func(torch.randn(1, 16, 1, 80, device="cuda", dtype=torch.bfloat16),
                        torch.randn(1, 16, 1, 80, device="cuda", dtype=torch.bfloat16),
                        torch.randn(1, 16, 1, 80, device="cuda", dtype=torch.bfloat16), arch="ampere")


def test_default_dispatch_forward_and_backward():
    """arch=None: the newest forward for the GPU, and a backward from a pipeline that has one."""
    q, k, v = _inputs(2, 333, 517, 8, 2, 128, 128, torch.bfloat16, seed=16)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_forward(out, lse, q, k, v, causal=True)
    dout = torch.randn_like(out)
    ours = _grads(lambda a, b, c: flash_attn_func(a, b, c, causal=True)[0], q, k, v, dout)
    ref = _grads(lambda a, b, c: attention_ref(a, b, c, mode="float64", causal=True)[0],
                 q.double(), k.double(), v.double(), dout.double())
    nat = _grads(lambda a, b, c: attention_ref(a, b, c, mode="native", causal=True)[0], q, k, v, dout)
    for name, g, g_ref, g_nat in zip(("dQ", "dK", "dV"), ours, ref, nat):
        res = tolerance_check(g, g_ref, g_nat)
        assert res.ok, f"{name}: err {res.err:.3e} vs native {res.err_native:.3e}"


@pytest.mark.parametrize("return_lse", [False, True])
def test_lse_gradient_is_never_dropped(return_lse):
    """`lse` is returned whenever a gradient may flow; a loss that uses it gets its gradient."""
    q, k, v = _inputs(1, 97, 131, 4, 2, 64, 64, torch.bfloat16, seed=17)

    def grads(fn, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out, lse = fn(*leaves)
        (out.double().sum() + lse.double().sum()).backward()  # expanded (stride-0) gradients
        return [t.grad for t in leaves]

    ours = grads(lambda a, b, c: flash_attn_func(a, b, c, causal=True, return_lse=return_lse),
                 (q, k, v))
    ref = grads(lambda a, b, c: attention_ref(a, b, c, causal=True, mode="float64"),
                (q.double(), k.double(), v.double()))
    nat = grads(lambda a, b, c: attention_ref(a, b, c, causal=True, mode="native"), (q, k, v))
    for name, g, g_ref, g_nat in zip(("dQ", "dK", "dV"), ours, ref, nat):
        res = tolerance_check(g, g_ref, g_nat)
        assert res.ok, f"{name}: err {res.err:.3e} vs native {res.err_native:.3e}"


def test_varlen_rows_after_the_last_sequence_stay_defined():
    """Packed tensors longer than cu_seqlens[-1]: no garbage in O, dK, dV for those rows."""
    cu_q = torch.tensor([0, 40, 90], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 33, 70], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(18)
    q = torch.randn(100, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(80, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(80, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    max_seqlen_q=50, max_seqlen_k=37, causal=True)
    assert (out[90:] == 0).all()
    out.sum().backward()
    assert torch.isfinite(k.grad).all() and (k.grad[70:] == 0).all() and (v.grad[70:] == 0).all()


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_no_keys_gives_zero_output_and_neg_inf_lse(pipeline):
    q = torch.randn(2, 33, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 0, 4, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_func(q, k, k, return_lse=True, arch=pipeline)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("pipeline", [None] + PIPELINES)
def test_varlen_nan_in_the_unused_tail_does_not_leak(pipeline):
    cu_q = torch.tensor([0, 50, 97], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 61, 130], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(19)
    q = torch.randn(97, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(200, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(200, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k[130:], v[130:] = float("nan"), float("inf")  # rows that belong to no sequence
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=50, max_seqlen_k=69, return_lse=True, arch=pipeline)
    check_forward(out, lse, q, k[:130], v[:130], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


# --------------------------------------------------------------------------- seqused

# Pipelines whose kernels take seqused_q / seqused_k ("seqused" in their capabilities).
SEQUSED_PIPELINES = ["ampere", "hopper"]

SEQUSED_CASES = [
    # layout, spans_q, spans_k, seqused_q, seqused_k (None: not given). Odd lengths, used <
    # span, a used length of 0, and a span longer than max_seqlen (the grid covers the used).
    ("varlen", [37, 64, 129, 5], [50, 200, 1, 77], [30, 0, 129, 5], [50, 133, 0, 1]),
    ("varlen", [37, 64, 129], [50, 200, 77], None, [11, 200, 0]),
    ("varlen", [37, 64, 129], [50, 200, 77], [1, 63, 100], None),
    ("padded", [113] * 3, [203] * 3, [113, 0, 57], [1, 203, 150]),
    ("padded", [1] * 4, [300] * 4, None, [300, 17, 0, 129]),  # decode over a padded KV cache
    ("padded", [113] * 2, [203] * 2, [100, 7], None),
]
SEQUSED_IDS = ["varlen-qk", "varlen-k", "varlen-q", "padded-qk", "padded-k-decode", "padded-q"]


def _cu_seqlens(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int32, device="cuda").cumsum(0).to(torch.int32)


def _unused_rows(spans, used, layout):
    """Bool per row (varlen [total], padded [batch, seqlen]): True past the used length."""
    used = spans if used is None else used
    rows = torch.cat([torch.arange(span, device="cuda") >= u for span, u in zip(spans, used)])
    return rows if layout == "varlen" else rows.view(len(spans), spans[0])


def _seqused_inputs(layout, spans_q, spans_k, used_q, used_k, h, hk, d, dtype, seed):
    """q, k, v with NaN in every row past seqused (rows the kernels must never read), the
    call's keywords, the reference's keywords, and the unused-row masks of q and k."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lead_q = (sum(spans_q),) if layout == "varlen" else (len(spans_q), spans_q[0])
    lead_k = (sum(spans_k),) if layout == "varlen" else (len(spans_k), spans_k[0])
    make = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    q, k, v = make(*lead_q, h, d), make(*lead_k, hk, d), make(*lead_k, hk, d)
    unused_q = _unused_rows(spans_q, used_q, layout)
    unused_k = _unused_rows(spans_k, used_k, layout)
    q[unused_q], k[unused_k], v[unused_k] = float("nan"), float("nan"), float("nan")
    used = lambda u: None if u is None else torch.tensor(u, dtype=torch.int32, device="cuda")  # noqa: E731
    ref_kw = dict(seqused_q=used(used_q), seqused_k=used(used_k))
    call_kw = dict(ref_kw)
    if layout == "varlen":
        ref_kw.update(cu_seqlens_q=_cu_seqlens(spans_q), cu_seqlens_k=_cu_seqlens(spans_k))
        call_kw.update(cu_seqlens_q=ref_kw["cu_seqlens_q"], cu_seqlens_k=ref_kw["cu_seqlens_k"],
                       max_seqlen_q=max(used_q or spans_q), max_seqlen_k=max(used_k or spans_k))
    return q, k, v, call_kw, ref_kw, unused_q, unused_k


def _lse_rows(lse, layout):
    """LSE with the query rows first, indexable by `_unused_rows`."""
    return lse.transpose(0, 1) if layout == "varlen" else lse.transpose(1, 2)


@pytest.mark.parametrize("pipeline", SEQUSED_PIPELINES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout,spans_q,spans_k,used_q,used_k", SEQUSED_CASES, ids=SEQUSED_IDS)
def test_seqused_forward_matches_float64(pipeline, causal, layout, spans_q, spans_k, used_q,
                                         used_k, monkeypatch):
    q, k, v, call_kw, ref_kw, unused_q, _ = _seqused_inputs(
        layout, spans_q, spans_k, used_q, used_k, 6, 2, 128, torch.bfloat16, seed=20)
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    out, lse = flash_attn_varlen_func(q, k, v, causal=causal, return_lse=True, arch=pipeline,
                                      **call_kw)
    monkeypatch.undo()
    assert out.shape == q.shape and not torch.isnan(out).any() and not torch.isnan(lse).any()
    # Rows past seqused_q: O = 0 and LSE = -inf, like a row that sees no key.
    assert (out[unused_q] == 0).all() and torch.isneginf(_lse_rows(lse, layout)[unused_q]).all()
    check_forward(out, lse, q, k, v, causal=causal, **ref_kw)


@pytest.mark.parametrize("pipeline", SEQUSED_PIPELINES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout,spans_q,spans_k,used_q,used_k", SEQUSED_CASES, ids=SEQUSED_IDS)
def test_seqused_backward_matches_float64(pipeline, causal, layout, spans_q, spans_k, used_q,
                                          used_k):
    q, k, v, call_kw, ref_kw, unused_q, unused_k = _seqused_inputs(
        layout, spans_q, spans_k, used_q, used_k, 6, 2, 64, torch.bfloat16, seed=21)
    dout = torch.randn_like(q)
    dout[unused_q] = float("nan")  # the gradient of rows that are not attention outputs
    ours = _grads(lambda a, b, c: flash_attn_varlen_func(a, b, c, causal=causal, arch=pipeline,
                                                         **call_kw)[0], q, k, v, dout)
    ref = _grads(lambda a, b, c: attention_ref(a, b, c, mode="float64", causal=causal,
                                               **ref_kw)[0],
                 q.double(), k.double(), v.double(), dout.double())
    nat = _grads(lambda a, b, c: attention_ref(a, b, c, mode="native", causal=causal,
                                               **ref_kw)[0], q, k, v, dout)
    for name, g, g_ref, g_nat in zip(("dQ", "dK", "dV"), ours, ref, nat):
        res = tolerance_check(g, g_ref, g_nat)
        assert res.ok, f"{name}: err {res.err:.3e} vs native {res.err_native:.3e} (+atol {res.atol:.1e})"
    dq, dk, dv = ours
    assert (dq[unused_q] == 0).all() and (dk[unused_k] == 0).all() and (dv[unused_k] == 0).all()


@pytest.mark.parametrize("pipeline", SEQUSED_PIPELINES)
def test_seqused_gqa_window_softcap_and_new_values_reuse_the_kernel(pipeline):
    """Local window + softcap with GQA 4:1; new seqused values (not new flags) recompile nothing."""
    from flash_cute.runtime.jit import compile_cache

    kw = dict(window_size=(40, 7), softcap=20.0)
    for i, (used_q, used_k) in enumerate([([113, 50], [90, 203]), ([3, 113], [203, 0])]):
        q, k, v, call_kw, ref_kw, _, _ = _seqused_inputs(
            "padded", [113] * 2, [203] * 2, used_q, used_k, 8, 2, 128, torch.bfloat16, seed=22)
        out, lse = flash_attn_varlen_func(q, k, v, return_lse=True, arch=pipeline, **call_kw, **kw)
        check_forward(out, lse, q, k, v, **ref_kw, **kw)
        if i == 0:
            before = len(compile_cache)
    assert len(compile_cache) == before


def test_seqused_default_dispatch_and_pipelines_without_it():
    """arch=None picks a pipeline that takes seqused; one that does not refuses before launch."""
    from flash_cute.runtime.dispatch import PIPELINES as BUILT

    q, k, v, call_kw, ref_kw, _, _ = _seqused_inputs(
        "padded", [1] * 2, [300] * 2, None, [123, 7], 4, 4, 64, torch.bfloat16, seed=23)
    out, lse = flash_attn_varlen_func(q, k, v, causal=True, return_lse=True, **call_kw)
    check_forward(out, lse, q, k, v, causal=True, **ref_kw)
    major = torch.cuda.get_device_capability()[0]
    for pipeline in BUILT:
        if pipeline.runs_on(major) and "seqused" not in pipeline.capabilities:
            with pytest.raises(NotImplementedError, match="seqused"):
                flash_attn_varlen_func(q, k, v, arch=pipeline.name, **call_kw)


@pytest.mark.parametrize("arch", BWD_PIPELINES)
def test_forward_and_backward_run_on_the_current_stream_and_replay_in_a_cuda_graph(arch):
    """Kernels are launched on torch's current stream (the stream TVM-FFI finds current): a
    forward + backward captured into a CUDA graph (capture refuses a launch on any other
    stream) replays to the eager results, on inputs refilled after the capture."""
    q, k, v = (t.requires_grad_() for t in _inputs(2, 131, 131, 4, 2, 64, 64, torch.bfloat16,
                                                   seed=41))
    dout = torch.randn_like(q)

    def step():
        out, _ = flash_attn_func(q, k, v, causal=True, arch=arch)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for t in (q, k, v, dout):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
