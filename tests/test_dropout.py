"""Dropout on the CPU (issue 22): the Philox4x32-10 generator against Random123's known
answers, the keep rule and each element's draw, the operators' CPU implementation against
an independent masked softmax, opcheck, validation, and the kernels' cross-compiled SASS."""

import math

import pytest
import torch

from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.reference import rng
from flash_cute.reference.attention import attention_ref

BF16 = torch.bfloat16

# Random123's kat_vectors for philox4x32-10: (counter, key, output).
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_matches_random123(counter, key, expected):
    out = rng.philox4x32(tuple(torch.tensor(c, dtype=torch.int64) for c in counter), key)
    assert tuple(int(o) for o in out) == expected


@pytest.mark.parametrize("p", [1e-7, 0.1, 0.17, 0.5, 0.9, 0.999999])
def test_keep_probability_is_t_over_65536_within_2_pow_17_of_one_minus_p(p):
    t = rng.keep_threshold(p)
    assert 1 <= t <= 65535 and rng.keep_probability(p) == t / 65536
    if 2 ** -16 <= 1 - p <= 1 - 2 ** -16:
        assert abs(rng.keep_probability(p) - (1 - p)) <= 2 ** -17


def test_each_group_of_eight_elements_is_one_philox_block():
    """{q, q+8} x {k, k+1, k+8, k+9} take the eight 16-bit halves of one block, as the
    kernels' accumulator layout needs (`flash_cute.blocks.dropout`)."""
    seed = torch.tensor([-0x1234_5678_9ABC_DEF0], dtype=torch.int64)  # the sign bit set
    q0, k0, bh = 16 * 3 + 5, 16 * 7 + 4, 11
    qs = torch.tensor([q0, q0 + 8])[:, None]
    ks = torch.tensor([k0, k0 + 1, k0 + 8, k0 + 9])[None, :]
    got = rng.random16(seed, torch.tensor(bh), qs, ks)
    words = rng.philox4x32(tuple(torch.tensor(c) for c in (k0, q0, bh, 0)), rng.seed_words(seed))
    halves = [(int(w) >> s) & 0xFFFF for w in words for s in (0, 16)]
    assert sorted(got.flatten().tolist()) == sorted(halves)
    assert int(got[1, 2]) == int(words[3]) & 0xFFFF   # q+8, k+8: word 3, low half


def test_keep_rate_and_independence_on_the_cpu():
    seed = torch.tensor([987654321], dtype=torch.int64)
    mask = rng.keep_mask(seed, 0.3, range(4), 8, 256, 256)
    n = mask.numel()
    rate = mask.float().mean().item()
    assert abs(rate - rng.keep_probability(0.3)) < 5 * math.sqrt(0.21 / n)
    # Neighbours (the same Philox block and the next one) are uncorrelated.
    a, b = mask[..., :-1].float().flatten(), mask[..., 1:].float().flatten()
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.01
    assert not torch.equal(mask, rng.keep_mask(seed + 1, 0.3, range(4), 8, 256, 256))


def _masked_attention(q, k, v, keep, p, causal):
    """Dropout attention written out independently of the reference: softmax in float64,
    kept weights scaled by 1/(1-p), GQA by repeating K/V."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), -math.inf)
    w = torch.softmax(s, dim=-1) * keep / (1 - p)
    return torch.einsum("bhqk,bkhd->bqhd", w, v)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_operator_equals_an_independent_masked_softmax(causal):
    torch.manual_seed(0)
    q = torch.randn(2, 37, 4, 64, dtype=BF16, requires_grad=True)
    k, v = (torch.randn(2, 45, 2, 64, dtype=BF16, requires_grad=True) for _ in range(2))
    torch.manual_seed(7)
    out, lse = flash_attn_func(q, k, v, causal=causal, dropout_p=0.25, return_lse=True)
    torch.manual_seed(7)
    seed = rng.draw_seed("cpu")
    keep = rng.keep_mask(seed, 0.25, range(2), 4, 37, 45)
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _masked_attention(*ins, keep, 0.25, causal)
    assert (out.double() - ref).abs().max() < 2e-2
    _, lse_plain = attention_ref(q.detach(), k.detach(), v.detach(), causal=causal)
    assert torch.allclose(lse, lse_plain.float(), atol=1e-5)   # LSE is the undropped one
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, ins, dout.double())
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max() < 3e-2 * r.abs().max()


def test_same_seed_same_mask_and_a_new_seed_a_new_one():
    q, k, v = (torch.randn(1, 40, 2, 64, dtype=BF16) for _ in range(3))
    torch.manual_seed(1)
    a = flash_attn_func(q, k, v, dropout_p=0.5)[0]
    torch.manual_seed(1)
    b = flash_attn_func(q, k, v, dropout_p=0.5)[0]
    c = flash_attn_func(q, k, v, dropout_p=0.5)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_varlen_dropout_draws_per_sequence_positions():
    """A packed batch draws each sequence's mask from its own positions (b the sequence):
    the same as the padded call of each sequence alone with that b."""
    torch.manual_seed(2)
    cu = torch.tensor([0, 20, 53], dtype=torch.int32)
    q, k, v = (torch.randn(53, 2, 64, dtype=BF16) for _ in range(3))
    torch.manual_seed(3)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=33,
                                 max_seqlen_k=33, dropout_p=0.4)[0]
    torch.manual_seed(3)
    seed = rng.draw_seed("cpu")
    for b, (lo, hi) in enumerate(((0, 20), (20, 53))):
        keep = rng.keep_mask(seed, 0.4, [b], 2, hi - lo, hi - lo)
        ref = _masked_attention(*(t[None, lo:hi].double() for t in (q, k, v)), keep, 0.4,
                                False)
        assert (out[lo:hi].double() - ref[0]).abs().max() < 2e-2


@pytest.mark.parametrize("frame", [None, dict(q_first=32, heads=4),
                                   dict(q_first=3, stride=2, heads=4)])
def test_opcheck_with_dropout(frame):
    """The operator with a plain seed and with each form of a framed one (the fake
    implementation and autograd take them as the real one does)."""
    q, k, v = (torch.randn(2, 19, 2, 64, dtype=BF16, requires_grad=True) for _ in range(3))
    seed = rng.draw_seed("cpu")
    seed = seed if frame is None else rng.framed_seed(seed, **frame)
    options = (None, None, None, True, None, None, 0.0, None, False, None)
    torch.library.opcheck(torch.ops.flash_cute.fwd,
                          (q, k, v, None, None, None, None, *options, True, 0, 0.3, seed))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_p_outside_0_1_is_refused(p):
    q = torch.randn(1, 8, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, q, q, dropout_p=p)


def test_dropout_needs_a_seed_and_turns_packed_gqa_off():
    from types import SimpleNamespace

    from flash_cute.runtime.launch import packed_heads

    q = torch.randn(1, 8, 2, 64, dtype=BF16)
    options = (None, None, None, False, None, None, 0.0, None, False, None)
    with pytest.raises(ValueError, match="rng_seed"):
        torch.ops.flash_cute.fwd(q, q, q, None, None, None, None, *options, False, 0, 0.1, None)
    problem = SimpleNamespace(qheads_per_kvhead=4, pack_gqa=None, dropout_p=0.1,
                              max_seqlen_q=1)
    assert packed_heads(problem, 128) == 1
    with pytest.raises(NotImplementedError, match="pack_gqa"):
        packed_heads(SimpleNamespace(**{**vars(problem), "pack_gqa": True}), 128)


def test_fa2_module_passes_dropout_to_the_kernels():
    from flash_cute.flash_attn_interface import flash_attn_func as fa2

    q, k, v = (torch.randn(1, 30, 2, 64, dtype=BF16) for _ in range(3))
    torch.manual_seed(4)
    out, lse, probs = fa2(q, k, v, 0.2, return_attn_probs=True)
    torch.manual_seed(4)
    assert torch.equal(out, flash_attn_func(q, k, v, dropout_p=0.2)[0]) and probs is None


@pytest.mark.parametrize("frame", [dict(q_first=16, k_first=32, stride=1),
                                   dict(q_first=5, k_first=3, stride=1),
                                   dict(q_first=2, k_first=1, stride=3)])
def test_a_framed_seed_draws_the_larger_attentions_decisions(frame):
    """A call framed inside a larger attention (rows first + stride · i, heads and batch
    entries offset) draws exactly that attention's decisions there."""
    seed = rng.draw_seed("cpu")
    whole = rng.keep_mask(seed, 0.4, range(4), 7, 80, 90)
    framed = rng.framed_seed(seed, head_offset=2, batch_offset=1, heads=7, **frame)
    got = rng.keep_mask(framed, 0.4, range(2), 3, 20, 24)
    rows = frame["q_first"] + frame["stride"] * torch.arange(20)
    cols = frame["k_first"] + frame["stride"] * torch.arange(24)
    assert torch.equal(got, whole[1:3, 2:5][:, :, rows][:, :, :, cols])
    assert framed.numel() == (6 if frame["stride"] == 1 and frame["q_first"] % 16 == 0 and
                              frame["k_first"] % 16 == 0 else 7)
    assert rng.frame_of(framed, 3) == dict(head_offset=2, batch_offset=1, heads=7, **frame)
    # The identity frame is the plain seed.
    plain = rng.framed_seed(seed, heads=3)
    assert torch.equal(rng.keep_mask(plain, 0.4, range(2), 3, 20, 24),
                       rng.keep_mask(seed, 0.4, range(2), 3, 20, 24))


def test_framed_seeds_are_checked():
    seed = rng.draw_seed("cpu")
    for bad in (dict(stride=0, heads=1), dict(heads=0), dict(q_first=-1, heads=2),
                dict(k_first=2 ** 31, heads=2), dict(q_first=1.5, heads=2)):
        with pytest.raises(ValueError, match="dropout frame"):
            rng.framed_seed(seed, **bad)
    q = torch.randn(1, 8, 2, 64, dtype=BF16)
    options = (None, None, None, False, None, None, 0.0, None, False, None)
    with pytest.raises(ValueError, match=r"\[6\] or \[7\] with a frame"):
        torch.ops.flash_cute.fwd(q, q, q, None, None, None, None, *options, False, 0, 0.1,
                                 torch.zeros(3, dtype=torch.int64))
    framed = rng.framed_seed(seed, q_first=8, k_first=8, heads=2)
    out = torch.ops.flash_cute.fwd(q, q, q, None, None, None, None, *options, False, 0, 0.1,
                                   framed)[0]
    assert not torch.equal(out, torch.ops.flash_cute.fwd(
        q, q, q, None, None, None, None, *options, False, 0, 0.1, seed)[0])
