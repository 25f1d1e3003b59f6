"""Traced score and mask mods in the GPU kernels (`flash_cute.blocks.graph_mods`): forward and
backward of the hopper and ampere pipelines against float64 by the FlashAttention rule, and
the forward against torch's FlexAttention running the very same functions; GQA, odd lengths,
causal with a mod, varlen with seqused, packed GQA, captured tensors read as they are at each
call, and the refusals."""

from typing import NamedTuple

import pytest
import torch

from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.reference.attention import attention_ref, tolerance_check
from flash_cute.variants import derivative, registry, tracer
from flash_cute.variants import examples as mod_examples

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


H, HK = 4, 2
_AUX = {}


def aux(name):
    """Captured CUDA tensors, made once (the same objects keep a mod's registry key)."""
    if name not in _AUX:
        g = torch.Generator(device="cuda").manual_seed(7)
        _AUX.update(
            slopes=torch.rand(H, device="cuda", generator=g) * 0.5 + 0.05,
            table=torch.randn(H, 1024, device="cuda", generator=g),
            doc=torch.randint(0, 4, (2, 400), device="cuda", generator=g,
                              dtype=torch.int32).sort(dim=1).values.to(torch.int32),
            prefix=torch.tensor([17, 90], device="cuda", dtype=torch.int32),
            gate=torch.rand(2, H, device="cuda", generator=g),
            keep=torch.rand(2, 400, 400, device="cuda", generator=g) > 0.2,
            short=torch.randn(H, 60, device="cuda", generator=g).to(torch.bfloat16),
            row_short=torch.randn(2, 100, device="cuda", generator=g),
            flags=torch.rand(120, device="cuda", generator=g) > 0.5,
            ids=torch.randint(0, 3, (2, 100), device="cuda", generator=g, dtype=torch.int32))
    return _AUX[name]


def alibi(score, b, h, q_idx, kv_idx):
    return score - aux("slopes")[h] * (q_idx - kv_idx).abs()


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + aux("table")[h, q_idx - kv_idx + 400]


def softcap(score, b, h, q_idx, kv_idx):
    return 8.0 * torch.tanh(score / 8.0)


def exotic(score, b, h, q_idx, kv_idx):
    """Most of the op subset: where, sigmoid, floor division and remainder of negatives,
    minimum, exp, log, sqrt, pow, a per-(batch, head) load, int/float promotion."""
    shift = ((q_idx - kv_idx) // 5) % 3 - 1
    smooth = torch.log(torch.exp(score / 4) + 1.0) * 4 + torch.sqrt(score * score + 1.0) / 8
    gated = score * torch.sigmoid(score) + aux("gate")[b, h] * shift
    return torch.where(kv_idx % 2 == 0, smooth, torch.minimum(gated, score ** 2 / 4))


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def document(b, h, q_idx, kv_idx):
    return (aux("doc")[b, q_idx] == aux("doc")[b, kv_idx]) & (kv_idx <= q_idx)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < aux("prefix")[b])


def dense_mask(b, h, q_idx, kv_idx):
    """A bool tensor lookup, with the diagonal kept so no row is empty."""
    return aux("keep")[b, q_idx, kv_idx] | (q_idx == kv_idx)


CASES = [(alibi, None), (relative_bias, causal), (softcap, prefix_lm), (exotic, None),
         (None, document), (alibi, dense_mask), (exotic, causal)]
_ID = lambda f: getattr(f, "__name__", "none")  # noqa: E731


def _inputs(seqlen_q, seqlen_k, d, dtype=torch.bfloat16, batch=2, heads_kv=HK):
    g = torch.Generator(device="cuda").manual_seed(seqlen_q * 1000 + seqlen_k + d)
    mk = lambda s, h: torch.randn(batch, s, h, d, device="cuda", dtype=dtype,  # noqa: E731
                                  generator=g).requires_grad_()
    return mk(seqlen_q, H), mk(seqlen_k, heads_kv), mk(seqlen_k, heads_kv)


def _check(got, ref, nat, name):
    res = tolerance_check(got, ref, nat)
    assert res.ok, f"{name}: err {res.err:.3e} vs native {res.err_native:.3e} (+{res.atol:.1e})"


class _Refs(NamedTuple):
    """`variant` on the inputs in float64 and in their own precision (`attention_ref`), each
    with its differentiable leaves."""
    leaves64: tuple
    ref: torch.Tensor
    lse_ref: torch.Tensor
    leaves_nat: tuple
    nat: torch.Tensor
    lse_nat: torch.Tensor


def _references(q, k, v, variant) -> _Refs:
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, lse_ref = attention_ref(q64, k64, v64, mode="float64", variant=variant)
    qn, kn, vn = (t.detach().requires_grad_() for t in (q, k, v))
    nat, lse_nat = attention_ref(qn, kn, vn, mode="native", variant=variant)
    return _Refs((q64, k64, v64), ref, lse_ref, (qn, kn, vn), nat, lse_nat)


def _check_grads(out, inputs, refs: _Refs, prefix: str = "", finite: bool = False):
    """dQ, dK, dV of `out` (from `inputs`) against float64 by the rule, one random dO."""
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    grads64 = torch.autograd.grad(refs.ref, refs.leaves64, dout.double())
    grads_nat = torch.autograd.grad(refs.nat, refs.leaves_nat, dout)
    for name, g, r, n in zip(("dQ", "dK", "dV"), grads, grads64, grads_nat):
        if finite:
            assert g.isfinite().all(), prefix + name
        _check(g, r, n, prefix + name)


def _flex(q, k, v, score_mod, mask_mod):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, q.shape[0], q.shape[2], q.shape[1],
                                       k.shape[1], device="cuda")
    out = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), score_mod=score_mod,
                         block_mask=block_mask, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _forward_against_float64(q, k, v, score_mod, mask_mod, arch):
    """(O, the float64 and native references) of the mods' forward, O and LSE (-inf exactly
    where the reference's is) checked by the FlashAttention rule."""
    out, lse = flash_attn_func(q, k, v, score_mod=score_mod, mask_mod=mask_mod, arch=arch,
                               return_lse=True)
    refs = _references(q, k, v, registry.lookup(registry.register(score_mod, mask_mod)))
    _check(out, refs.ref, refs.nat, "O")
    finite = refs.lse_ref.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    _check(lse[finite], refs.lse_ref[finite], refs.lse_nat[finite], "LSE")
    return out, refs


@pytest.mark.parametrize("arch", [None, "ampere"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("score_mod,mask_mod", CASES, ids=_ID)
def test_forward_and_backward_against_float64_and_flex(score_mod, mask_mod, d, arch):
    q, k, v = _inputs(113, 301, d)
    out, refs = _forward_against_float64(q, k, v, score_mod, mask_mod, arch)
    with torch.no_grad():
        flex = _flex(q.detach(), k.detach(), v.detach(), score_mod, mask_mod)
    # FlexAttention, an independent kernel of the same functions, as the baseline.
    _check(out, refs.ref, flex, "O vs FlexAttention's error")
    _check_grads(out, (q, k, v), refs)


@pytest.mark.parametrize("arch,splits", [(None, 1), (None, 3), ("ampere", 1)])
def test_a_large_max_that_stays_put_does_not_drift_the_lse(arch, splits):
    """FA4's `score + 2|q_idx - kv_idx|` over 16k keys in fp16: scores near 32,000, each
    row's max in the first block visited, 127 blocks after it. The LSE stays within a few
    float32 roundings of those scores (each block rescaling by exactly 1, `OnlineSoftmax`),
    and O passes the rule."""
    def far(score, b, h, q_idx, kv_idx):
        return score + 2 * (q_idx - kv_idx).abs()

    q, k, v = _inputs(256, 16384, 64, dtype=torch.float16, batch=1)
    out, lse = flash_attn_func(q, k, v, score_mod=far, arch=arch, num_splits=splits,
                               return_lse=True)
    refs = _references(q, k, v, registry.lookup(registry.register(far, None)))
    _check(out, refs.ref, refs.nat, "O")
    ulp = torch.finfo(torch.float32).eps * refs.lse_ref.abs().max().item()
    err = (lse.double() - refs.lse_ref).abs().max().item()
    assert err <= 4 * ulp, f"LSE err {err:.2e} vs float32's ulp {ulp:.2e} at the scores"


@pytest.mark.parametrize("arch", [None, "ampere"])
@pytest.mark.parametrize("sq,sk", [(799, 3), (3, 799), (113, 203)])
def test_a_mod_past_exp_range_leaves_padded_rows_out(sq, sk, arch):
    """A bias that grows to hundreds (FA4's rel_bias test): rows of a query tile past
    seqlen_q score far past fp32's exp range too, and must still give P = 0, not inf x 0."""
    def far_bias(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx).abs()

    q, k, v = _inputs(sq, sk, 128)
    out = flash_attn_func(q, k, v, score_mod=far_bias, arch=arch)[0]
    refs = _references(q, k, v, registry.lookup(registry.register(far_bias, None)))
    _check(out, refs.ref, refs.nat, "O")
    _check_grads(out, (q, k, v), refs, finite=True)


@pytest.mark.parametrize("arch", [None, "ampere"])
def test_varlen_with_seqused_sees_each_sequence(arch):
    """Packed sequences with seqused_k: b is the sequence, q_idx / kv_idx count from its
    start (the reference's varlen, on the same graphs)."""
    torch.manual_seed(3)
    cu_q = torch.tensor([0, 37, 117], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 120, 323], dtype=torch.int32, device="cuda")
    seqused_k = torch.tensor([101, 203], dtype=torch.int32, device="cuda")
    q = torch.randn(117, H, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(323, HK, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=80, max_seqlen_k=203, seqused_k=seqused_k,
                                 causal=True, score_mod=exotic, mask_mod=prefix_lm,
                                 arch=arch)[0]
    variant = registry.lookup(registry.register(exotic, prefix_lm))
    kw = dict(causal=True, variant=variant, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
              seqused_k=seqused_k)
    ref = attention_ref(q.double(), k.double(), v.double(), mode="float64", **kw)[0]
    nat = attention_ref(q, k, v, mode="native", **kw)[0]
    _check(out, ref, nat, "O")


def test_packed_gqa_split_kv_decode_with_a_mod():
    """Decode-sized queries (packed GQA, split-KV) with a per-head bias and a mask."""
    q, k, v = _inputs(3, 4000, 128, batch=2, heads_kv=1)
    for splits in (1, 0, 5):
        out = flash_attn_func(q, k, v, causal=True, score_mod=alibi, mask_mod=document,
                              pack_gqa=True, num_splits=splits)[0]
        variant = registry.lookup(registry.register(alibi, document))
        args = [t.detach() for t in (q, k, v)]
        ref = attention_ref(*(t.double() for t in args), mode="float64", causal=True,
                            variant=variant)[0]
        nat = attention_ref(*args, mode="native", causal=True, variant=variant)[0]
        _check(out, ref, nat, f"O, num_splits={splits}")


def test_captured_tensors_are_read_at_each_call():
    """A learnable table updated in place: the next call reads the new values (no copy kept),
    and the kernel is not compiled again."""
    from flash_cute.runtime.jit import compile_cache

    table = torch.zeros(H, 33, device="cuda")
    mod = mod_examples.relative_bias(table, 16)
    q, k, v = (t.detach() for t in _inputs(64, 64, 64))
    flash_attn_func(q, k, v, score_mod=mod)
    compiled = len(compile_cache)
    table.normal_()
    out = flash_attn_func(q, k, v, score_mod=mod)[0]
    assert len(compile_cache) == compiled
    variant = registry.lookup(registry.register(mod, None))
    ref = attention_ref(q.double(), k.double(), v.double(), mode="float64", variant=variant)[0]
    nat = attention_ref(q, k, v, mode="native", variant=variant)[0]
    _check(out, ref, nat, "O after the table changed")


def test_documented_examples_run():
    slopes = torch.rand(H, device="cuda")
    doc = torch.randint(0, 3, (2, 150), device="cuda", dtype=torch.int32).sort(1).values
    q, k, v = (t.detach() for t in _inputs(150, 150, 128))
    for score_mod, mask_mod in [(mod_examples.alibi(slopes), None),
                                (mod_examples.softcap(30.0), mod_examples.sliding_window(40)),
                                (None, mod_examples.document_mask(doc)),
                                (None, mod_examples.prefix_lm(torch.tensor(
                                    [5, 60], dtype=torch.int32, device="cuda")))]:
        out = flash_attn_func(q, k, v, score_mod=score_mod, mask_mod=mask_mod)[0]
        variant = registry.lookup(registry.register(score_mod, mask_mod))
        ref = attention_ref(q.double(), k.double(), v.double(), mode="float64",
                            variant=variant)[0]
        nat = attention_ref(q, k, v, mode="native", variant=variant)[0]
        _check(out, ref, nat, f"{_ID(score_mod)} / {_ID(mask_mod)}")


def test_bad_captured_tensors_are_refused_before_launch():
    q = torch.randn(1, 16, H, 64, device="cuda", dtype=torch.bfloat16)
    on_cpu = torch.ones(H)

    def cpu_bias(score, b, h, q_idx, kv_idx):
        return score + on_cpu[h]

    with pytest.raises(ValueError, match="move it there"):
        flash_attn_func(q, q, q, score_mod=cpu_bias)
    wide = torch.ones(H, device="cuda", dtype=torch.float64)

    def wide_bias(score, b, h, q_idx, kv_idx):
        return score + wide[h]

    with pytest.raises(tracer.UnsupportedMod, match="float64"):
        flash_attn_func(q, q, q, score_mod=wide_bias)


# Indices past both ends of short tensors (bf16, fp32, bool, int32), one index varying by
# element, row or column: loads that take the clamp's edge values (`graph_mods._Walk.edges`).
def e_edges(score, b, h, q_idx, kv_idx):
    by_element = aux("short")[h, q_idx - kv_idx + 20] * 0.5
    return score + by_element + aux("row_short")[b, q_idx - 30]


def e_edge_mask(b, h, q_idx, kv_idx):
    return aux("flags")[kv_idx - 50] | (aux("ids")[b, q_idx + 7] == 2)


@pytest.mark.parametrize("arch", [None, "ampere"])
def test_indices_past_a_captured_tensor_read_its_edge_values(arch):
    """A load's index below 0 or past the end reads the tensor's first or last entry (the
    clamp of `tracer.evaluate`), forward and backward, against float64."""
    q, k, v = _inputs(113, 301, 128)
    out, refs = _forward_against_float64(q, k, v, e_edges, e_edge_mask, arch)
    _check_grads(out, (q, k, v), refs, finite=True)


def _graph_cases():
    def e_div(score, b, h, q_idx, kv_idx):
        return score + (((q_idx - kv_idx) // 5) % 3 - 1) * 0.5 + (kv_idx - q_idx) % 7

    def e_float_div(score, b, h, q_idx, kv_idx):
        return score // 0.75 + score % 1.5 - (q_idx - kv_idx) / 3

    def e_pow(score, b, h, q_idx, kv_idx):
        return score ** 3 / 8 + torch.abs(score) ** 0.5 - (q_idx + 1) ** 2 / 1000

    def e_bool(b, h, q_idx, kv_idx):
        return ~((q_idx - kv_idx) % 4 == 1) | (aux("keep")[b, q_idx, kv_idx] != (h > 1))

    return [(e_div, None), (e_float_div, None), (e_pow, None), (exotic, e_bool),
            (softcap, document), (alibi, prefix_lm), (relative_bias, dense_mask),
            (e_edges, e_edge_mask)]


@pytest.mark.parametrize("score_mod,mask_mod", _graph_cases(), ids=_ID)
def test_block_matches_the_graph_on_index_grids(score_mod, mask_mod):
    """The block alone (`block_kernels.graph_mods_on_gpu`, no attention around it) against
    `tracer.evaluate` on the same graphs: every op's semantics, negative integer division
    and remainder included, and the derivative in the score."""
    from flash_cute.tools import block_kernels

    variant = registry.lookup(registry.register(score_mod, mask_mod))
    scores = torch.randn(2, H, 150, 200, device="cuda") * 4
    out, grad = block_kernels.graph_mods_on_gpu(variant, scores)
    grids = tracer.index_grids([0, 1], H, 150, 200, device="cuda")
    want = scores.double()

    def full(t):
        return torch.broadcast_to(t.to(scores.device), scores.shape)

    if variant.score_mod is not None:
        want = full(tracer.evaluate(variant.score_mod, {"score": want, **grids}).double())
        d = derivative.score_derivative(variant.score_mod)
        want_grad = full(tracer.evaluate(d, {"score": scores.double(), **grids}))
        torch.testing.assert_close(grad.double(), want_grad.double(), rtol=2e-3, atol=2e-3)
    if variant.mask_mod is not None:
        keep = full(tracer.evaluate(variant.mask_mod, grids))
        assert torch.equal(out.isinf() & (out < 0), ~keep.bool())
        want = want.masked_fill(~keep.bool(), float("-inf"))
    torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)


def _block_cases(seqlen, heads=H):
    """(name, block mask, mask_mod) on [2, heads, seqlen, seqlen]: masks whose blocks agree
    with their mod (`create_block_mask`), one ≥ 90 % empty, and one whose blocks disagree
    with it (listed by hand, shared by the heads: full blocks the mod would mask, partial ones
    it decides)."""
    from torch.nn.attention.flex_attention import BlockMask

    from flash_cute import create_block_mask

    g = torch.Generator(device="cuda").manual_seed(11)
    blocks = -(-seqlen // 128)
    doc = (torch.arange(seqlen, device="cuda") * 5 // seqlen).to(torch.int32)
    doc = doc.expand(2, seqlen).contiguous()
    # The diagonal and one far block per row: ≥ 90 % of the blocks empty, not contiguous.
    i = torch.arange(blocks, device="cuda")
    table = (i[:, None] == i[None, :]) | (i[:, None] - i[None, :] == 7)

    def docs(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 300)

    def scattered(b, h, q_idx, kv_idx):
        return table[q_idx // 128, kv_idx // 128] & ((q_idx + kv_idx) % 3 != 0)

    def checker(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx) % 2 == 0

    cases = [(name, create_block_mask(fn, 2, heads, seqlen, seqlen, device="cuda"), fn)
             for name, fn in (("document", docs), ("window", window),
                              ("scattered", scattered))]
    # By hand: in each query block, its diagonal block partial (the mod decides) and a random
    # earlier one full (every key visible, whatever the mod says).
    rows = torch.arange(blocks, device="cuda", dtype=torch.int32)
    partial_idx = torch.zeros(1, 1, blocks, blocks, device="cuda", dtype=torch.int32)
    partial_idx[..., 0] = rows
    full_idx = torch.zeros_like(partial_idx)
    full_idx[..., 0] = (torch.rand(blocks, device="cuda", generator=g) * rows).to(torch.int32)
    ones = torch.ones(1, 1, blocks, dtype=torch.int32, device="cuda")
    full_count = (rows > 0).to(torch.int32).view(1, 1, blocks)
    by_hand = BlockMask.from_kv_blocks(ones, partial_idx, full_count, full_idx,
                                       BLOCK_SIZE=128, mask_mod=checker,
                                       seq_lengths=(seqlen, seqlen))
    return cases + [("disagreeing", by_hand, checker)]


@pytest.mark.parametrize("arch,d,pack", [(None, 128, None), (None, 64, None),
                                         ("ampere", 128, None), (None, 128, True)])
def test_block_masks_skip_tiles_and_match_the_reference(arch, d, pack):
    """Block sparsity in the kernels: empty tiles skipped, full ones without the mask rule,
    FlexAttention's meaning per element (also where the blocks disagree with the mod, and
    with ≥ 90 % of the tiles empty): forward and backward against float64 by the rule. hdim
    64's forward tiles (192 rows) straddle the 128-row blocks; `pack`: the masks, shared by
    the heads, on packed GQA rows (D-PACK-BLOCKS)."""
    seqlen = 2055
    q, k, v = _inputs(seqlen, seqlen, d)
    # Held for the whole test: a block mask's registry entry goes with the block mask.
    cases = _block_cases(seqlen, 1 if pack else H)
    for name, block_mask, mask_mod in cases:
        out, lse = flash_attn_func(q, k, v, block_mask=block_mask, arch=arch, return_lse=True,
                                   pack_gqa=pack)
        refs = _references(q, k, v, registry.lookup(registry.register(None, None, block_mask)))
        _check(out, refs.ref, refs.nat, f"{name}: O")
        assert torch.equal(lse.isfinite(), refs.lse_ref.isfinite()), name
        _check_grads(out, (q, k, v), refs, f"{name}: ")
    scattered = registry.lookup(registry.register(None, None, cases[2][1]))
    assert (scattered.block_states == 0).float().mean() >= 0.9


# FA4-form mods (`flash_cute.blocks.fa4_mods`) paired with FlexAttention-form twins, whose float64
# reference and native baseline check them.
def _fa4_twins():
    from flash_cute.blocks import fa4_mod_examples as fa4

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score - 0.01 * (q_idx - kv_idx).abs()

    def softcap30(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def causal_top_left(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    bias = torch.linspace(-1.0, 1.0, H, device="cuda")

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    def scaled_shift(score, b, h, q_idx, kv_idx):
        return score * 3 + 0.25

    slopes = torch.linspace(0.05, 0.4, H, device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    ids = (torch.arange(301, device="cuda") * 3 // 301).to(torch.int32).expand(2, 301)
    ids = ids.contiguous()

    def document(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 50)

    return [("rel_bias", dict(score_mod=fa4.rel_bias), (rel_bias, None)),
            ("alibi_causal", dict(score_mod=fa4.alibi, mask_mod=fa4.causal,
                                  aux_tensors=[slopes]), (alibi, causal_top_left)),
            ("document", dict(mask_mod=fa4.document, aux_tensors=[ids]), (None, document)),
            ("sliding", dict(mask_mod=fa4.sliding_window(50)), (None, sliding)),
            ("softcap_causal", dict(score_mod=fa4.softcap30, mask_mod=fa4.causal),
             (softcap30, causal_top_left)),
            ("head_bias", dict(score_mod=fa4.head_bias, aux_tensors=[bias]), (head_bias, None)),
            ("aux_scalars", dict(score_mod=fa4.scaled_shift, aux_scalars=[3, 0.25]),
             (scaled_shift, None))]


@pytest.mark.parametrize("arch", [None, "ampere"])
@pytest.mark.parametrize("case", range(7))
def test_fa4_form_mods_forward_and_backward(case, arch):
    """FA4's @cute.jit form in our kernels, its derivative from dual numbers (no
    score_mod_bwd), against float64 with the FlexAttention-form twin."""
    name, fa4_kwargs, (score_mod, mask_mod) = _fa4_twins()[case]
    q, k, v = _inputs(113, 301, 128)
    out, lse = flash_attn_func(q, k, v, arch=arch, return_lse=True, **fa4_kwargs)
    refs = _references(q, k, v, registry.lookup(registry.register(score_mod, mask_mod)))
    _check(out, refs.ref, refs.nat, f"{name}: O")
    assert torch.equal(lse.isfinite(), refs.lse_ref.isfinite())
    _check_grads(out, (q, k, v), refs, f"{name}: ")


@pytest.mark.parametrize("arch,d", [(None, 128), (None, 64), ("ampere", 128)])
def test_fa4_form_mods_with_fa4_block_sparse_tensors(arch, d):
    """FA4's mask mod with FA4's block-sparsity tensors (a block mask, `from_fa4`), forward
    and backward against float64 with the FlexAttention twin and its BlockMask; hdim 64's
    forward tiles straddle the blocks (the per-element rule)."""
    from collections import namedtuple

    from flash_cute import create_block_mask
    from flash_cute.blocks import fa4_mod_examples as fa4

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    seqlen = 1031
    q, k, v = _inputs(seqlen, seqlen, d)
    flex = create_block_mask(causal, 1, 1, seqlen, seqlen, device="cuda")
    Tensors = namedtuple("Tensors", "mask_block_cnt mask_block_idx full_block_cnt "
                                    "full_block_idx block_size")
    fa4_blocks = Tensors(flex.kv_num_blocks, flex.kv_indices, flex.full_kv_num_blocks,
                         flex.full_kv_indices, (128, 128))
    out = flash_attn_func(q, k, v, mask_mod=fa4.causal, block_sparse_tensors=fa4_blocks,
                          arch=arch)[0]
    refs = _references(q, k, v, registry.lookup(registry.register(None, causal, flex)))
    _check(out, refs.ref, refs.nat, "O")
    _check_grads(out, (q, k, v), refs)


def _affine(scale, shift):
    def affine(score, b, h, q_idx, kv_idx):
        return score * scale + shift
    return affine


def test_fa4_aux_scalars_are_read_at_each_call_without_a_recompile():
    """aux_scalars are kernel parameters: new values give new results from the same kernel."""
    from flash_cute.blocks import fa4_mod_examples as fa4
    from flash_cute.runtime.jit import compile_cache

    q, k, v = (t.detach() for t in _inputs(77, 190, 128))
    outs = []
    for scale, shift in ((1, 0.0), (3, 0.25), (-2, 1.5)):
        before = set(compile_cache._entries)
        outs.append(flash_attn_func(q, k, v, score_mod=fa4.scaled_shift,
                                    aux_scalars=[scale, shift])[0])
        compiled = set(compile_cache._entries) - before
        variant = registry.lookup(registry.register(_affine(scale, shift), None))
        ref, _ = attention_ref(q.double(), k.double(), v.double(), mode="float64",
                               variant=variant)
        nat, _ = attention_ref(q, k, v, mode="native", variant=variant)
        _check(outs[-1], ref, nat, f"scale {scale}, shift {shift}")
        if len(outs) > 1:
            assert not compiled, f"a new scalar value compiled {compiled}"
    assert not torch.equal(outs[0], outs[1])


def test_fa4_form_score_mod_bwd_is_used_when_given():
    """An explicit score_mod_bwd (FA4's signature) replaces the dual numbers: a wrong one
    (twice the derivative) changes dQ, a right one matches."""
    import cutlass.cute as cute

    from flash_cute.blocks import fa4_mod_examples as fa4

    @cute.jit
    def right(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        t = cute.math.tanh(score * cute.full_like(score, 1.0 / 30.0))
        return grad * (cute.full_like(score, 1.0) - t * t)

    @cute.jit
    def doubled(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return right(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors) * \
            cute.full_like(score, 2.0)

    q, k, v = _inputs(97, 97, 64)
    dout = torch.randn(2, 97, H, 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for bwd in (None, right, doubled):
        out = flash_attn_func(q, k, v, score_mod=fa4.softcap30, score_mod_bwd=bwd)[0]
        results.append(torch.autograd.grad(out, (q,), dout)[0].float())
    torch.testing.assert_close(results[1], results[0], atol=2e-2, rtol=2e-2)
    assert (results[2] - results[0]).abs().max() > 10 * (results[1] - results[0]).abs().max()


def _learnable_case(which: str):
    """(score mod, its learnable tensors): ALiBi slopes (an index uniform over a tile: one
    atomic per warp) with a relative-bias table (an index per element), or a rank-one bias
    q_bias[q_idx] * k_bias[kv_idx] (an index per row, one per column). A bias of the query
    alone would not do: softmax ignores a row's shift, so its gradient is exactly 0 and every
    implementation's is rounding noise."""
    if which == "alibi_table":
        span = 400
        slopes = (torch.rand(H, device="cuda") + 0.1).requires_grad_()
        table = (0.5 * torch.randn(H, 2 * span + 1, device="cuda")).requires_grad_()

        def mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs() + table[h, q_idx - kv_idx + span]
        return mod, (slopes, table)
    q_bias = (0.5 * torch.randn(301, device="cuda")).requires_grad_()
    k_bias = (0.5 * torch.randn(389, device="cuda")).requires_grad_()

    def mod(score, b, h, q_idx, kv_idx):
        return score + q_bias[q_idx] * k_bias[kv_idx]
    return mod, (q_bias, k_bias)


def _flex_learned_grads(q, k, v, mod, learned, dout):
    """The learnable tensors' gradients from torch.compile'd FlexAttention (bottom-right
    causal, as ours), an independent kernel with the same rounding sources as ours: O in
    bf16, dS from it in fp32."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    shift = k.shape[1] - q.shape[1]
    causal = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + shift  # noqa: E731
    block_mask = create_block_mask(causal, None, None, q.shape[1], k.shape[1], device="cuda")
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    # Smaller tiles than its defaults: those ask for more shared memory than an H200 has
    # with a captured table's gradient.
    tiles = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 1, "bwd_BLOCK_M1": 32,
             "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_stages": 1}
    out = torch.compile(flex_attention)(qt, kt, vt, score_mod=mod, block_mask=block_mask,
                                        enable_gqa=True, kernel_options=tiles)
    return torch.autograd.grad(out, learned, dout.transpose(1, 2))


@pytest.mark.parametrize("which", ["alibi_table", "row_col"])
@pytest.mark.parametrize("arch", [None, "ampere"])
@pytest.mark.parametrize("d", [128, 64])
def test_learnable_captured_tensors_get_their_gradients(which, arch, d):
    """Learnable captured tensors (`_learnable_case`), with causal and GQA at odd lengths:
    their gradients, accumulated by the backward kernels, and dQ/dK/dV against float64 by the
    FlashAttention rule (the baseline: the same attention in the inputs' precision)."""
    mod, learned = _learnable_case(which)
    q, k, v = _inputs(301, 389, d)
    out = flash_attn_func(q, k, v, score_mod=mod, causal=True, arch=arch)[0]
    variant = registry.lookup(registry.register(mod, None))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, mode="float64", variant=variant, causal=True)[0]
    qn, kn, vn = (t.detach().requires_grad_() for t in (q, k, v))
    nat = attention_ref(qn, kn, vn, mode="native", variant=variant, causal=True)[0]
    _check(out, ref, nat, "O")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, *learned), dout)
    grads64 = torch.autograd.grad(ref, (q64, k64, v64, *learned), dout.double())
    grads_nat = torch.autograd.grad(nat, (qn, kn, vn, *learned), dout)
    for name, g, r, n in zip(("dQ", "dK", "dV"), grads, grads64, grads_nat):
        _check(g.double(), r.double(), n.double(), name)
    # A learnable tensor's gradient sums dS over many elements, so an error in it is mostly
    # that of the row's Δ = rowsum(dO ∘ O) with O in bf16, which eager torch (its softmax
    # backward from bf16 P) does not share: FlexAttention's kernel does, and is the baseline.
    flex = _flex_learned_grads(q, k, v, mod, learned, dout)
    for i, (g, r, f) in enumerate(zip(grads[3:], grads64[3:], flex)):
        _check(g.double(), r.double(), f.double(), f"d(aux {i}) vs FlexAttention's error")
