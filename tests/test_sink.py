"""FA4's learnable_sink: one logit per query head joining every row's softmax (no value),
checked against an independent float64 attention with the sink as an explicit extra column,
forward (O, LSE) and backward (dQ, dK, dV, d(sink)), by the FlashAttention rule; CPU tensors
(the reference path) here, the kernels in `test_sink_gpu`."""

import math

import pytest
import torch

import flash_cute
from flash_cute.api.interface import fold_sink


def _explicit(q, k, v, sink, causal):
    """float64 attention over keys + one sink column per head (padded [b, s, h, d])."""
    b, sq, h, d = q.shape
    group = h // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if causal:
        sk = k.shape[1]
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    col = sink.to(s.dtype)[None, :, None, None].expand(b, h, sq, 1)
    full = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.exp(full - lse[..., None])[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _native(q, k, v, sink, causal):
    b, sq, h, d = q.shape
    group = h // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).float() / math.sqrt(d)
    if causal:
        sk = k.shape[1]
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    full = torch.cat([s, sink.float()[None, :, None, None].expand(b, h, sq, 1)], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.exp(full - lse[..., None])[..., :-1].to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _inputs(sq, sk, h=4, hk=2, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, heads, d, generator=g).to(dtype)
               for n, heads in ((sq, h), (sk, hk), (sk, hk)))
    sink = (torch.randn(h, generator=g) * 2).requires_grad_()
    return q, k, v, sink


def _close(ours, ref, native, name):
    """The FlashAttention rule: our error at most 2x a native-precision run's, plus a floor."""
    err = (ours.double() - ref).abs().max().item()
    base = (native.double() - ref).abs().max().item()
    floor = 1e-3 * max(ref.abs().max().item(), 1e-6)
    assert err <= 2 * base + floor, f"{name}: {err:.3e} vs native {base:.3e}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(37, 61), (64, 64), (5, 130)])
def test_sink_forward_and_backward_match_an_explicit_sink_column(causal, sq, sk):
    _check_sink_case(causal, sq, sk, "cpu", None)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["hopper", "ampere"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(37, 61), (257, 1031)])
def test_sink_in_the_gpu_pipelines(arch, causal, sq, sk):
    if arch == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the hopper pipeline runs on sm90")
    _check_sink_case(causal, sq, sk, "cuda", arch)


def _check_sink_case(causal, sq, sk, device, arch):
    q, k, v, sink = _inputs(sq, sk)
    sinks = sink.detach().to(device).requires_grad_()
    qs, ks, vs = (t.to(device).requires_grad_() for t in (q, k, v))
    out, lse = flash_cute.flash_attn_func(qs, ks, vs, causal=causal, learnable_sink=sinks,
                                          return_lse=True, arch=arch)
    out, lse = out.cpu(), lse.cpu()
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s64 = sink.detach().double().requires_grad_()
    ref, lse_ref = _explicit(q64, k64, v64, s64, causal)
    qn, kn, vn = (t.clone().requires_grad_() for t in (q, k, v))
    sn = sink.detach().clone().requires_grad_()
    # A bf16 PyTorch attention: QKᵀ and PV in bf16, the softmax in fp32, P cast to bf16.
    nat, lse_nat = _native(qn, kn, vn, sn, causal)
    _close(out, ref, nat, "O")
    torch.testing.assert_close(lse.double(), lse_ref, atol=2e-5, rtol=2e-5)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g)
    dlse = torch.randn(lse.shape, generator=g)
    out_d, lse_d = flash_cute.flash_attn_func(qs, ks, vs, causal=causal, learnable_sink=sinks,
                                              return_lse=True, arch=arch)
    grads = torch.autograd.grad((out_d * dout.to(device)).sum() + (lse_d * dlse.to(device)).sum(),
                                (qs, ks, vs, sinks))
    grads = tuple(g.cpu() for g in grads)
    refs = torch.autograd.grad((ref * dout.double()).sum() + (lse_ref * dlse.double()).sum(),
                               (q64, k64, v64, s64))
    nats = torch.autograd.grad((nat.float() * dout.float()).sum() + (lse_nat * dlse).sum(),
                               (qn, kn, vn, sn))
    # dsink is a sum over every row of dO·O: stored in bf16, O alone carries an error into it
    # that a native run, differentiating its own rounded arithmetic, does not show; so its
    # baseline is also the exact attention's O rounded to bf16, with the sink folded in.
    stored = _stored_o_dsink(q64, k64, v64, sink, causal, out.dtype, dout, dlse)
    err = [(b.double() - refs[3]).abs().max() for b in (nats[3], stored)]
    nats = nats[:3] + ((nats[3], stored)[int(err[1] > err[0])],)
    for name, g, r, n in zip(("dQ", "dK", "dV", "dsink"), grads, refs, nats):
        _close(g, r, n, name)


def _stored_o_dsink(q64, k64, v64, sink, causal, dtype, dout, dlse):
    """d(sink) through `fold_sink` from the float64 attention's O rounded to `dtype`."""
    with torch.no_grad():
        out, lse = _explicit(q64, k64, v64, torch.full_like(sink, -math.inf, dtype=torch.float64),
                             causal)
    s = sink.detach().clone().requires_grad_()
    folded, lse_f = fold_sink(out.to(dtype), lse.float(), s, False)
    return torch.autograd.grad((folded.float() * dout).sum() + (lse_f * dlse).sum(), s)[0]


def test_rows_that_see_no_key_get_zero_output_and_the_sink_as_lse():
    """Causal with more queries than keys: the first rows see no key (FA4's convention)."""
    q, k, v, sink = _inputs(9, 4)
    out, lse = flash_cute.flash_attn_func(q, k, v, causal=True, learnable_sink=sink.detach(),
                                          return_lse=True)
    empty = torch.arange(9) < 5
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    torch.testing.assert_close(lse[:, :, empty], sink.detach()[None, :, None].expand(2, 4, 5))


def test_varlen_sink_equals_the_padded_one():
    q, k, v, sink = _inputs(33, 33, seed=1)
    pad, lse_pad = flash_cute.flash_attn_func(q, k, v, learnable_sink=sink.detach(),
                                              return_lse=True)
    cu = torch.tensor([0, 33, 66], dtype=torch.int32)
    out, lse = flash_cute.flash_attn_varlen_func(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_q=cu, cu_seqlens_k=cu,
        max_seqlen_q=33, max_seqlen_k=33, learnable_sink=sink.detach(), return_lse=True)
    torch.testing.assert_close(out.view_as(pad), pad)
    torch.testing.assert_close(lse.view(4, 2, 33).transpose(0, 1), lse_pad)


def test_without_a_sink_nothing_changes_and_bad_sinks_are_refused():
    q, k, v, _ = _inputs(16, 16)
    plain = flash_cute.flash_attn_func(q, k, v)[0]
    minus_inf = torch.full((4,), float("-inf"))
    torch.testing.assert_close(flash_cute.flash_attn_func(q, k, v, learnable_sink=minus_inf)[0],
                               plain)
    with pytest.raises(ValueError, match=r"shape \(nheads,\) = \(4,\)"):
        flash_cute.flash_attn_func(q, k, v, learnable_sink=torch.zeros(2))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        flash_cute.flash_attn_func(q, k, v, learnable_sink=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="must be a tensor"):
        flash_cute.flash_attn_func(q, k, v, learnable_sink=[0.0] * 4)


def test_sink_traces_under_compile():
    q, k, v, sink = _inputs(24, 24)

    def f(q, k, v, s):
        return flash_cute.flash_attn_func(q, k, v, causal=True, learnable_sink=s,
                                          return_lse=True)

    eager = f(q, k, v, sink.detach())
    compiled = torch.compile(f, fullgraph=True, dynamic=True)(q, k, v, sink.detach())
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)
