"""Dropout in the kernels on the GPU (issue 22): outputs and gradients against float64 with
the same mask (`flash_cute.reference.rng`), the mask bit for bit against the reference's draws, the
keep rate over 1e8 draws, reproducibility under a fixed seed, and fresh masks under CUDA
graph replay."""

import pytest
import torch

from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.reference import rng
from flash_cute.reference.attention import attention_ref, tolerance_check

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16
P = 0.17


def _seeded_call(fn, seed: int):
    """fn() after torch.manual_seed(seed), and the dropout seed that call drew (the same
    draw repeated: `rng.draw_seed` is the call's first use of the CUDA generator)."""
    torch.manual_seed(seed)
    result = fn()
    torch.manual_seed(seed)
    return result, rng.draw_seed("cuda")


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def _check(name, got, ref, nat, atol=None):
    res = tolerance_check(got, ref, nat) if atol is None else tolerance_check(got, ref, nat, atol=atol)
    assert res.ok, f"{name}: err {res.err:.3e} vs native {res.err_native:.3e} (+atol {res.atol:.1e})"


def _check_grads(grads, ref_grads, nat_grads):
    """dQ, dK, dV, each by the rule; a failure names every gradient's errors."""
    results = [tolerance_check(g, r, n) for g, r, n in zip(grads, ref_grads, nat_grads)]
    assert all(r.ok for r in results), "; ".join(
        f"{name}: err {r.err:.3e} vs native {r.err_native:.3e}"
        for name, r in zip(("dQ", "dK", "dV"), results))


def _check_with_mask(out, inputs, seed, **kw):
    """O and dQ, dK, dV of a dropout call against float64 and the native baseline, both with
    the mask drawn from `seed` (`attention_ref`'s dropout); returns their LSEs."""
    dout = torch.randn_like(out)
    grads = _grads(out, inputs, dout)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    nat_in = [t.detach().clone().requires_grad_() for t in inputs]
    ref, lse_ref = attention_ref(*ref_in, dropout=(P, seed), **kw)
    nat, lse_nat = attention_ref(*nat_in, mode="native", dropout=(P, seed), **kw)
    _check("O", out, ref, nat)
    _check_grads(grads, _grads(ref, ref_in, dout.double()), _grads(nat, nat_in, dout))
    return lse_ref, lse_nat


# (arch, batch, seqlen_q, seqlen_k, heads, heads_kv, hdim, causal, softcap)
PADDED = [
    ("hopper", 2, 333, 333, 4, 4, 128, False, 0.0),
    ("hopper", 2, 200, 517, 4, 2, 128, True, 0.0),
    ("hopper", 1, 257, 300, 4, 4, 64, True, 0.0),
    ("hopper", 2, 190, 190, 2, 2, 256, True, 0.0),
    ("hopper", 2, 300, 300, 2, 2, 128, False, 30.0),
    ("hopper", 1, 129, 1000, 8, 1, 96, False, 0.0),
    ("ampere", 2, 333, 333, 4, 4, 128, False, 0.0),
    ("ampere", 2, 200, 517, 4, 2, 64, True, 20.0),
]


@pytest.mark.parametrize("arch,b,sq,sk,h,hk,d,causal,softcap", PADDED)
def test_padded_against_float64_with_the_same_mask(arch, b, sq, sk, h, hk, d, causal, softcap):
    torch.manual_seed(sq * 7 + d)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=BF16, requires_grad=True)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=BF16, requires_grad=True)
            for _ in range(2))
    kw = dict(causal=causal, softcap=softcap)
    (out, lse), seed = _seeded_call(lambda: flash_attn_func(
        q, k, v, dropout_p=P, arch=arch, return_lse=True, **kw), seed=d + sq)
    lse_ref, lse_nat = _check_with_mask(out, (q, k, v), seed, **kw)
    _check("LSE", lse, lse_ref, lse_nat, atol=1e-4)


@pytest.mark.parametrize("arch", ["hopper", "ampere"])
def test_varlen_with_seqused_against_float64(arch):
    torch.manual_seed(3)
    cu_q = torch.tensor([0, 100, 101, 400], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 250, 260, 600], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([200, 10, 333], dtype=torch.int32, device="cuda")
    q = torch.randn(400, 4, 128, device="cuda", dtype=BF16, requires_grad=True)
    k, v = (torch.randn(600, 2, 128, device="cuda", dtype=BF16, requires_grad=True)
            for _ in range(2))
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used_k, causal=True)
    out, seed = _seeded_call(lambda: flash_attn_varlen_func(
        q, k, v, max_seqlen_q=300, max_seqlen_k=350, dropout_p=P, arch=arch, **kw)[0], seed=11)
    _check_with_mask(out, (q, k, v), seed, **kw)


def _mask_readout(batch, heads, seqlen, p, arch=None, seed=0):
    """The kernels' keep mask [b, h, sq, 128]: with q = 0 every key gets weight 1/128 and
    V = I, so O[q, j] = Z[q, j] · (1 / (1 - p)) / 128."""
    q = torch.zeros(batch, seqlen, heads, 128, device="cuda", dtype=BF16)
    k = torch.zeros(batch, 128, 1, 128, device="cuda", dtype=BF16)
    v = torch.eye(128, device="cuda", dtype=BF16).view(1, 128, 1, 128).expand(batch, -1, -1, -1)
    out, seed_t = _seeded_call(lambda: flash_attn_func(q, k, v.contiguous(), dropout_p=p,
                                                       arch=arch)[0], seed)
    return out.transpose(1, 2) != 0, seed_t


@pytest.mark.parametrize("arch", ["hopper", "ampere"])
def test_the_kernels_draw_the_references_mask_bit_for_bit(arch):
    mask, seed = _mask_readout(2, 3, 1000, 0.5, arch=arch, seed=5)
    expected = rng.keep_mask(seed, 0.5, range(2), 3, 1000, 128, device="cuda")
    assert torch.equal(mask, expected)


def test_keep_rate_over_1e8_draws_matches_the_documented_probability():
    total, kept = 0, 0
    for seed in range(2):
        mask, _ = _mask_readout(8, 8, 8192, 0.1, seed=seed)
        total += mask.numel()
        kept += int(mask.sum())
    assert total >= 1e8
    assert abs(kept / total - rng.keep_probability(0.1)) < 1e-4


def test_a_fixed_seed_reproduces_outputs_and_gradients_bit_for_bit():
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=BF16, requires_grad=True)
               for _ in range(3))
    runs = []
    for _ in range(2):
        torch.manual_seed(42)
        out = flash_attn_func(q, k, v, dropout_p=0.3, causal=True, deterministic=True)[0]
        runs.append((out, *_grads(out, (q, k, v), torch.ones_like(out))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    torch.manual_seed(43)
    other = flash_attn_func(q, k, v, dropout_p=0.3, causal=True)[0]
    assert not torch.equal(other, runs[0][0])


def test_cuda_graph_replays_draw_fresh_masks():
    q, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=BF16) for _ in range(3))
    flash_attn_func(q, k, v, dropout_p=0.2)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_func(q, k, v, dropout_p=0.2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, dropout_p=0.2)[0]
    graph.replay()
    first = out.clone()
    graph.replay()
    second = out.clone()
    assert not torch.equal(first, second)
    # Each replay is still an exact dropout of the same attention: same undropped LSE, and
    # the outputs differ only where the masks do.
    ref = flash_attn_func(q, k, v)[0]
    for o in (first, second):
        assert (o.float() - ref.float()).abs().mean() < ref.float().abs().mean()


def test_fa2_module_dropout_runs_the_kernels():
    from flash_cute.flash_attn_interface import flash_attn_qkvpacked_func

    qkv = torch.randn(2, 200, 3, 4, 64, device="cuda", dtype=BF16, requires_grad=True)
    out, seed = _seeded_call(lambda: flash_attn_qkvpacked_func(qkv, 0.25, causal=True), 9)
    q, k, v = (t.detach().double() for t in qkv.unbind(2))
    ref, _ = attention_ref(q, k, v, causal=True, dropout=(0.25, seed))
    nat, _ = attention_ref(*(t.to(BF16) for t in (q, k, v)), mode="native", causal=True,
                           dropout=(0.25, seed))
    _check("O", out, ref, nat)
    out.float().sum().backward()
    assert qkv.grad.isfinite().all()


# Frames (`rng.framed_seed`): whole Philox groups (stride 1, first positions multiples of 16),
# shifted groups, and a stride (a striped ring step).
FRAMES = [dict(q_first=32, k_first=48, stride=1, head_offset=2, batch_offset=1, heads=8),
          dict(q_first=5, k_first=19, stride=1, head_offset=0, batch_offset=3, heads=3),
          dict(q_first=2, k_first=1, stride=3, head_offset=1, batch_offset=0, heads=5)]


def _op_options(arch, causal=False):
    return (None, None, None, causal, None, None, 0.0, None, False, arch)


@pytest.mark.parametrize("arch", ["hopper", "ampere"])
@pytest.mark.parametrize("frame", FRAMES, ids=["groups", "shifted", "strided"])
def test_a_framed_seed_draws_the_framed_positions_bit_for_bit(arch, frame):
    """The mask readout of `_mask_readout` through the operator with a framed seed: the
    kernels draw the decisions of the frame's positions in the larger attention."""
    q = torch.zeros(2, 300, 3, 128, device="cuda", dtype=BF16)
    k = torch.zeros(2, 128, 1, 128, device="cuda", dtype=BF16)
    v = torch.eye(128, device="cuda", dtype=BF16).view(1, 128, 1, 128).expand(2, -1, -1, -1)
    seed = rng.framed_seed(rng.draw_seed("cuda"), **frame)
    out = torch.ops.flash_cute.fwd(q, k, v.contiguous(), None, None, None, None,
                                   *_op_options(arch), False, 0, 0.5, seed)[0]
    expected = rng.keep_mask(seed, 0.5, range(2), 3, 300, 128, device="cuda")
    assert torch.equal(out.transpose(1, 2) != 0, expected)
    assert not torch.equal(expected, rng.keep_mask(seed[:1], 0.5, range(2), 3, 300, 128,
                                                   device="cuda"))


@pytest.mark.parametrize("arch,d", [("hopper", 128), ("hopper", 64), ("ampere", 128)])
@pytest.mark.parametrize("frame", FRAMES, ids=["groups", "shifted", "strided"])
def test_framed_forward_and_backward_against_float64_with_the_same_mask(arch, d, frame):
    torch.manual_seed(d + frame["q_first"])
    q = torch.randn(2, 211, 4, d, device="cuda", dtype=BF16, requires_grad=True)
    k, v = (torch.randn(2, 300, 2, d, device="cuda", dtype=BF16, requires_grad=True)
            for _ in range(2))
    seed = rng.framed_seed(rng.draw_seed("cuda"), **{**frame, "heads": frame["heads"] + 4})
    out = torch.ops.flash_cute.fwd(q, k, v, None, None, None, None, *_op_options(arch, True),
                                   True, 0, P, seed)[0]
    _check_with_mask(out, (q, k, v), seed, causal=True)
