"""The torch.library operators (CPU): registration, opcheck, the CPU implementation against
the float64 reference, fake and meta tensors, mixed packed/padded layouts, and
torch.compile(fullgraph=True, dynamic=True) of a transformer block."""

import pytest
import torch
from attention_checks import AttentionBlock
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_cute
from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.reference.attention import attention_ref, attention_ref_backward, tolerance_check

BF16 = torch.bfloat16


def _randn(*shape, grad=False):
    return torch.randn(*shape, dtype=BF16).requires_grad_(grad)


def _cu(*offsets):
    return torch.tensor(offsets, dtype=torch.int32)


# Options of both operators after the tensors, in schema order: max_seqlen_q, max_seqlen_k,
# softmax_scale, causal, window_left, window_right, softcap, pack_gqa, deterministic, arch.
def _options(causal=False, window=(None, None), softcap=0.0, max_q=None, max_k=None):
    return (max_q, max_k, None, causal, *window, softcap, None, False, None)


def test_the_operators_are_registered():
    for name in ("fwd", "bwd"):
        op = getattr(torch.ops.flash_cute, name).default
        assert {"CPU", "CUDA", "Meta"} <= {k for k in ("CPU", "CUDA", "Meta")
                                             if torch._C._dispatch_has_kernel_for_dispatch_key(
                                                 op.name(), k)}
    assert torch._C._dispatch_has_kernel_for_dispatch_key("flash_cute::fwd", "Autograd")


_CASES = {
    "padded gqa causal": dict(q=(2, 37, 4, 64), k=(2, 45, 2, 64), opts=_options(causal=True)),
    "window softcap dv": dict(q=(1, 50, 2, 64), k=(1, 50, 2, 64), dv=32,
                              opts=_options(window=(7, 3), softcap=5.0)),
    "varlen": dict(q=(40, 4, 64), k=(45, 2, 64), cu_q=_cu(0, 10, 10, 40), cu_k=_cu(0, 5, 20, 45),
                   opts=_options(causal=True, max_q=30, max_k=25)),
    "seqused": dict(q=(2, 20, 2, 64), k=(2, 30, 2, 64), used_k=_cu(3, 30),
                    opts=_options()),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_opcheck_forward_and_backward(name):
    case = _CASES[name]
    q, k = _randn(*case["q"], grad=True), _randn(*case["k"], grad=True)
    v = _randn(*case["k"][:-1], case.get("dv", case["k"][-1]), grad=True)
    lengths = (case.get("cu_q"), case.get("cu_k"), None, case.get("used_k"))
    torch.library.opcheck(torch.ops.flash_cute.fwd.default,
                          (q, k, v, *lengths, *case["opts"], True, 0))
    out, lse = torch.ops.flash_cute.fwd(q.detach(), k.detach(), v.detach(), *lengths,
                                        *case["opts"], False, 0)
    for dlse in (None, torch.randn_like(lse)):
        torch.library.opcheck(torch.ops.flash_cute.bwd.default,
                              (torch.randn_like(out), dlse, q.detach(), k.detach(), v.detach(),
                               out, lse, *lengths, *case["opts"], 0))


def _check(got, q, k, v, dout=None, **kw):
    """The FlashAttention rule against the float64 reference, forward and (with dout)
    backward through the public function's autograd."""
    out, lse = got
    ref, ref_lse = attention_ref(q, k, v, mode="float64", **kw)
    nat, nat_lse = attention_ref(q, k, v, mode="native", **kw)
    assert tolerance_check(out, ref, nat).ok
    assert tolerance_check(lse, ref_lse, nat_lse, atol=1e-4).ok
    if dout is None:
        return
    grads = torch.autograd.grad(out, (q, k, v), dout)
    grads64 = torch.autograd.grad(ref, (q, k, v), dout.double())
    grads_nat = torch.autograd.grad(nat, (q, k, v), dout)
    for g, r, n in zip(grads, grads64, grads_nat):
        assert tolerance_check(g, r, n).ok


def test_cpu_operators_meet_the_flashattention_rule():
    q, k, v = _randn(2, 37, 4, 64, grad=True), _randn(2, 45, 2, 64, grad=True), \
        _randn(2, 45, 2, 64, grad=True)
    got = flash_attn_func(q, k, v, causal=True, softcap=10.0, return_lse=True)
    _check(got, q, k, v, torch.randn(got[0].shape, dtype=BF16), causal=True, softcap=10.0)


def test_packed_q_with_padded_kv_and_the_reverse():
    """One side packed (cu_seqlens), the other padded with seqused, as FA4's tests call them:
    the result is that of both sides packed."""
    torch.manual_seed(1)
    b, s, h, hk, d = 3, 33, 4, 2, 64
    lens_q, lens_k = [5, 33, 0], [12, 1, 33]
    used_q, used_k = _cu(*lens_q), _cu(*lens_k)
    cu_q = _cu(0, *torch.tensor(lens_q).cumsum(0).tolist())
    cu_k = _cu(0, *torch.tensor(lens_k).cumsum(0).tolist())
    q_pad, k_pad, v_pad = _randn(b, s, h, d), _randn(b, s, hk, d), _randn(b, s, hk, d)
    q_pack = torch.cat([q_pad[i, :n] for i, n in enumerate(lens_q)]).requires_grad_()
    k_pack = torch.cat([k_pad[i, :n] for i, n in enumerate(lens_k)]).requires_grad_()
    v_pack = torch.cat([v_pad[i, :n] for i, n in enumerate(lens_k)]).requires_grad_()
    want, want_lse = flash_attn_varlen_func(q_pack, k_pack, v_pack, cu_seqlens_q=cu_q,
                                            cu_seqlens_k=cu_k, max_seqlen_q=s, max_seqlen_k=s,
                                            causal=True, return_lse=True)
    # Packed q, padded k/v.
    k_in, v_in = k_pad.clone().requires_grad_(), v_pad.clone().requires_grad_()
    out, lse = flash_attn_varlen_func(q_pack, k_in, v_in, cu_seqlens_q=cu_q, max_seqlen_q=s,
                                      max_seqlen_k=s, seqused_k=used_k, causal=True,
                                      return_lse=True)
    assert out.shape == want.shape and lse.shape == want_lse.shape
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    dk, = torch.autograd.grad(out, k_in, out.detach())
    dk_want, = torch.autograd.grad(want, k_pack, want.detach())
    assert torch.equal(torch.cat([dk[i, :n] for i, n in enumerate(lens_k)]), dk_want)
    assert all((dk[i, n:] == 0).all() for i, n in enumerate(lens_k))
    # Padded q, packed k/v: out and lse in q's padded layout.
    q_in = q_pad.clone().requires_grad_()
    out, lse = flash_attn_varlen_func(q_in, k_pack, v_pack, cu_seqlens_k=cu_k, max_seqlen_q=s,
                                      max_seqlen_k=s, seqused_q=used_q, causal=True,
                                      return_lse=True)
    assert out.shape == (b, s, h, d) and lse.shape == (b, h, s) and lse.is_contiguous()
    for i, n in enumerate(lens_q):
        first = sum(lens_q[:i])
        assert torch.equal(out[i, :n], want[first:first + n])
        assert torch.equal(lse[i, :, :n], want_lse[:, first:first + n])
    with pytest.raises(ValueError, match="batch 3, but cu_seqlens_k has 2 entries"):
        flash_attn_varlen_func(q_in, k_pack, v_pack, cu_seqlens_k=_cu(0, 46), max_seqlen_k=46)
    with pytest.raises(ValueError, match="padded"):
        flash_attn_varlen_func(q_pack, k_pack, v_pack, cu_seqlens_q=cu_q, max_seqlen_q=s)


def test_reference_backward_formula_equals_autograd():
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 37, 4, 64), torch.randn(2, 45, 2, 64), torch.randn(2, 45, 2, 32)
    cu_q, cu_k = _cu(0, 10, 10, 37), _cu(0, 5, 20, 45)
    cases = [
        (q, k, v, dict(causal=True, softcap=5.0)),
        (q, k, v, dict(window_size=(7, 3))),
        (q, k, v, dict(causal=True, seqused_q=_cu(37, 0), seqused_k=_cu(3, 45))),
        (q[0], k[0], v[0], dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)),
    ]
    for q_, k_, v_, kw in cases:
        q64, k64, v64 = (t.double().requires_grad_() for t in (q_, k_, v_))
        out, lse = attention_ref(q64, k64, v64, mode="float64", **kw)
        dout = torch.randn_like(out)
        dlse = torch.randn_like(lse).masked_fill(torch.isinf(lse), 0.0)
        want = torch.autograd.grad((out, lse), (q64, k64, v64), (dout, dlse))
        got = attention_ref_backward(q_, k_, v_, dout, dlse, dtype=torch.float64, **kw)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_fake_and_meta_tensors_get_shapes_and_the_same_refusals():
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 300, 8, 128, dtype=BF16)
                   for _ in range(3))
        out, lse = flash_attn_func(q, k[:, :, :2], v[:, :, :2], causal=True, return_lse=True)
        assert out.shape == (2, 300, 8, 128) and lse.shape == (2, 8, 300)
        with pytest.raises(NotImplementedError, match="multiples of 8"):
            flash_attn_func(q[..., :60], k[..., :60], v[..., :60])
        packed = torch.empty(300, 8, 128, dtype=BF16)
        cu = torch.empty(3, dtype=torch.int32)
        out, lse = flash_attn_varlen_func(packed, packed, packed, cu_seqlens_q=cu,
                                          cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200)
        assert out.shape == (300, 8, 128) and lse is None
    q = torch.empty(1, 77, 4, 64, dtype=BF16, device="meta")
    out, lse = flash_attn_func(q, q, q, return_lse=True)
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (1, 4, 77)


def test_compile_fullgraph_dynamic_has_no_break_and_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(3)
    block = AttentionBlock().to(BF16)
    explained = torch._dynamo.explain(block)(torch.randn(2, 40, 128, dtype=BF16))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    frames = None
    for t in (33, 64, 97):
        x = torch.randn(2, t, 128, dtype=BF16, requires_grad=True)
        y = compiled(x)
        (gx,) = torch.autograd.grad(y.float().sum(), x)
        x_eager = x.detach().requires_grad_()
        y_eager = block(x_eager)
        (gx_eager,) = torch.autograd.grad(y_eager.float().sum(), x_eager)
        assert torch.equal(y, y_eager) and torch.equal(gx, gx_eager)
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames, f"recompiled at seqlen {t}"
    torch._dynamo.reset()


def test_unregistered_variant_keys_are_refused():
    q = _randn(1, 8, 2, 64)
    with pytest.raises(KeyError, match="variant 12345 is not registered"):
        torch.ops.flash_cute.fwd(q, q, q, None, None, None, None, *_options(), False, 12345)


def test_check_inputs_switch_is_public():
    assert flash_cute.check_inputs(False) in (True, False)


@pytest.mark.parametrize("varlen", [False, True])
def test_forward_through_a_page_table_on_cpu(varlen):
    """The CPU operator reads a paged cache through its table as the K/V it stands for
    (pages shuffled; the gathered keys give the same result), padded or with packed q; fake
    tensors get the shapes; the autograd formula refuses a backward through pages."""
    from flash_cute.runtime.paging import gather

    torch.manual_seed(0)
    batch, pages_per, page, hk, d = 2, 3, 16, 2, 64
    k_pages = torch.randn(batch * pages_per + 1, page, hk, d, dtype=torch.bfloat16)
    v_pages = torch.randn_like(k_pages)
    table = torch.randperm(batch * pages_per + 1)[:batch * pages_per].view(batch, pages_per)
    table = table.to(torch.int32)
    used = torch.tensor([40, 17], dtype=torch.int32)
    kg, vg = gather(k_pages, v_pages, table)
    if varlen:
        q = torch.randn(5, 4, d, dtype=torch.bfloat16)
        cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
        lengths = (cu_q, None, None, used)
        opts = _options(max_q=3, max_k=pages_per * page)
        rows = pages_per * page
        cu_k = torch.tensor([0, rows, 2 * rows], dtype=torch.int32)
        want = torch.ops.flash_cute.fwd(q, kg.flatten(0, 1), vg.flatten(0, 1), cu_q, cu_k, None,
                                        used, *opts, False, 0)
    else:
        q = torch.randn(batch, 3, 4, d, dtype=torch.bfloat16)
        lengths, opts = (None, None, None, used), _options()
        want = torch.ops.flash_cute.fwd(q, kg, vg, *lengths, *opts, False, 0)
    got = torch.ops.flash_cute.fwd(q, k_pages, v_pages, *lengths, *opts, False, 0, 0.0, None, 1,
                                   None, table)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with torch._subclasses.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (q, k_pages, v_pages, table)]
        fake_lengths = tuple(None if t is None else mode.from_tensor(t) for t in lengths)
        out, lse = torch.ops.flash_cute.fwd(fake[0], fake[1], fake[2], *fake_lengths, *opts,
                                            False, 0, 0.0, None, 1, None, fake[3])
        assert out.shape == want[0].shape and lse.shape == want[1].shape
    with pytest.raises(ValueError, match="page_table must be int32"):
        torch.ops.flash_cute.fwd(q, k_pages, v_pages, *lengths, *opts, False, 0, 0.0, None, 1,
                                 None, table.long())
    qg = q.clone().requires_grad_()
    out, _ = torch.ops.flash_cute.fwd(qg, k_pages, v_pages, *lengths, *opts, True, 0, 0.0, None,
                                      1, None, table)
    with pytest.raises(NotImplementedError, match="page_table"):
        out.float().sum().backward()


@pytest.mark.parametrize("gqa,dlse", [(False, False), (True, True)])
def test_the_backward_takes_p_and_delta_from_the_saved_out_and_lse(gqa, dlse):
    """A ring's local backward: out and lse come from a forward over more keys than the
    local ones. The float64 reference backward and the CPU operator both take P = exp(S·scale
    − lse) and Δ from them, so the local keys' dK, dV are the full attention's, and dQ
    sums over the key shards."""
    torch.manual_seed(3)
    heads_kv = 1 if gqa else 2
    q = torch.randn(2, 7, 2, 16, dtype=torch.float64)
    k, v = (torch.randn(2, 19, heads_kv, 16, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 7, 2, 16, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, mode="float64", softcap=4.0)
    dl = torch.randn_like(lse) if dlse else None
    loss = (out * dout).sum() + ((lse * dl).sum() if dlse else 0)
    want = torch.autograd.grad(loss, leaves)
    shards = (slice(0, 9), slice(9, 19))
    dq = 0
    for part in shards:
        got = attention_ref_backward(q, k[:, part], v[:, part], dout, dl, softcap=4.0,
                                     dtype=torch.float64, out=out.detach(), lse=lse.detach())
        dq = dq + got[0]
        torch.testing.assert_close(got[1], want[1][:, part], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[2], want[2][:, part], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dq, want[0], rtol=1e-10, atol=1e-10)
    # The CPU operator, in bf16, against its own backward over all the keys.
    qb, kb, vb, db = (t.bfloat16() for t in (q, k, v, dout))
    opts = _options(softcap=4.0)
    out_b, lse_b = torch.ops.flash_cute.fwd(qb, kb, vb, None, None, None, None, *opts, False, 0)
    dl_b = None if dl is None else dl.float()
    full = torch.ops.flash_cute.bwd(db, dl_b, qb, kb, vb, out_b, lse_b, None, None, None,
                                    None, *opts, 0)
    for part in shards:
        local = torch.ops.flash_cute.bwd(db, dl_b, qb, kb[:, part].contiguous(),
                                         vb[:, part].contiguous(), out_b, lse_b, None, None,
                                         None, None, *opts, 0)
        for g_local, g_full in zip(local[1:3], full[1:3]):
            torch.testing.assert_close(g_local.float(), g_full[:, part].float(), rtol=0,
                                       atol=1e-2)


def test_float32_partials_and_gradients_for_a_ring():
    """`partial_out` gives O in float32 (the reference's float32 result, not rounded to
    bf16) and `grads_fp32` float32 dQ, dK, dV, on the CPU operator, the fake (so a ring
    traces) and through opcheck; without them the outputs keep the input dtype."""
    q, k, v = (_randn(1, 9, 2, 16) for _ in range(3))
    opts = _options(causal=True)
    tail = (False, 0, 0.0, None, 1, None, None)
    out16, _ = torch.ops.flash_cute.fwd(q, k, v, None, None, None, None, *opts, *tail)
    out32, lse = torch.ops.flash_cute.fwd(q, k, v, None, None, None, None, *opts, *tail, True)
    ref = attention_ref(q, k, v, causal=True, mode="float32")[0]
    assert out16.dtype == q.dtype and out32.dtype == torch.float32
    assert torch.equal(out32, ref.float()) and not torch.equal(out32, out16.float())
    dout = torch.randn_like(out16)
    grads = torch.ops.flash_cute.bwd(dout, None, q, k, v, out16, lse, None, None, None, None,
                                     *opts, 0, 0.0, None, False, True)
    assert all(g.dtype == torch.float32 for g in grads[:3])
    narrow = torch.ops.flash_cute.bwd(dout, None, q, k, v, out16, lse, None, None, None, None,
                                      *opts, 0)
    assert all(g.dtype == q.dtype for g in narrow[:3])
    assert all(torch.equal(a.to(q.dtype), b) for a, b in zip(grads[:3], narrow[:3]))
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake_out, _ = torch.ops.flash_cute.fwd(fq, fk, fv, None, None, None, None, *opts,
                                               *tail, True)
        fake_grads = torch.ops.flash_cute.bwd(mode.from_tensor(dout), None, fq, fk, fv,
                                              mode.from_tensor(out16), mode.from_tensor(lse),
                                              None, None, None, None, *opts, 0, 0.0, None,
                                              False, True)
    assert fake_out.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in fake_grads[:3])
    torch.library.opcheck(torch.ops.flash_cute.fwd.default,
                          (q, k, v, None, None, None, None, *opts, *tail, True))
    torch.library.opcheck(torch.ops.flash_cute.bwd.default,
                          (dout, None, q, k, v, out16, lse, None, None, None, None, *opts, 0,
                           0.0, None, False, True))
