"""Score and mask mods in FlexAttention's form (CPU): tracing into the op graph, the op subset
and its refusals, the generated derivative against autograd, and attention with mods on the
CPU operators against torch's FlexAttention."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flash_cute
from flash_cute.reference.attention import tolerance_check
from flash_cute.variants import derivative, kernel_view, registry, tracer

H, K = 4, 45
SLOPES = torch.rand(H, dtype=torch.float64) + 0.1
BIAS = torch.randn(2 * K, dtype=torch.float64)
TABLE = torch.randn(2, H, dtype=torch.float64)


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * (q_idx - kv_idx).abs()


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[q_idx - kv_idx + K]


def softcap20(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def gated(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx % 3 == 0, score * torch.sigmoid(score), torch.maximum(score, -score / 2))


def smooth(score, b, h, q_idx, kv_idx):
    return torch.log(torch.exp(score / 4) + 1.0) * 4 + torch.sqrt(score * score + 1.0) / 8 \
        + TABLE[b, h] * score


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 7) | (q_idx >= kv_idx)


def sliding(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx >= 0) & (q_idx - kv_idx < 16)


SCORE_MODS = [alibi, relative_bias, softcap20, gated, smooth]


@pytest.mark.parametrize("fn", SCORE_MODS, ids=lambda f: f.__name__)
def test_traced_graph_equals_the_function_and_its_derivative_equals_autograd(fn):
    graph = tracer.trace(fn)
    grids = tracer.index_grids([0, 1], H, 9, 11)
    score = torch.randn(2, H, 9, 11, dtype=torch.float64, requires_grad=True)
    want = fn(score, *grids.values())
    got = tracer.evaluate(graph, {"score": score, **grids})
    torch.testing.assert_close(torch.broadcast_to(got, want.shape), want, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(want.sum(), score)
    deriv = tracer.evaluate(derivative.score_derivative(graph),
                               {"score": score.detach(), **grids})
    torch.testing.assert_close(torch.broadcast_to(deriv, grad.shape), grad, rtol=1e-10,
                               atol=1e-12)


def test_loads_clamp_their_indices_into_the_tensor():
    graph = tracer.trace(lambda score, b, h, q_idx, kv_idx: score + BIAS[q_idx - kv_idx])
    grids = tracer.index_grids(0, 1, 3, 200)
    out = tracer.evaluate(graph, {"score": torch.zeros(()), **grids})
    index = (grids["q_idx"] - grids["kv_idx"]).clamp(0, BIAS.numel() - 1)
    assert torch.equal(out, BIAS[index.long()])


def test_loads_made_many_times_per_tile_read_edge_values():
    """`graph_mods._frequent_loads` (D-MODS-EDGES): the hopper forward's fragment, 2 rows x 32
    columns, reads a key's document id by edge values, the ampere forward's 4 x 8 clamps it;
    a query's id, on the kept side, stays clamped; an element's bias-table load is made 32
    times in either and reads edge values."""
    from flash_cute.blocks import graph_mods
    from flash_cute.tools.kernel_config import example_spec

    def frequent(name, rows, cols):
        spec = example_spec(name)
        live = sorted(graph_mods.needed(spec.nodes, (spec.score, spec.mask)))
        level = graph_mods.levels(spec.nodes)
        loads = {i: level[i] for i in live if spec.nodes[i].op == "load"}
        picked = graph_mods._frequent_loads(live, level, frozenset({"row"}), rows, cols)
        return loads, [i for i in picked if i in loads]

    loads, picked = frequent("document", 2, 32)
    assert sorted(loads.values(), key=sorted) == [{"col"}, {"row"}]
    assert [loads[i] for i in picked] == [{"col"}]
    assert frequent("document", 4, 8)[1] == []
    loads, picked = frequent("relative_bias", 4, 8)
    assert [loads[i] for i in picked] == [{"row", "col"}]


@pytest.mark.parametrize("fn,match", [
    (lambda score, b, h, q, k: torch.sin(score), "'sin'"),
    (lambda score, b, h, q, k: score if score > 0 else -score, "could not be traced"),
    (lambda score, b, h, q, k: (score * 2)[0], "indexes a computed value"),
    (lambda score, b, h, q, k: score + BIAS, "captured tensors may only be indexed"),
    (lambda score, b, h, q, k: score + TABLE[h], "index every dimension"),
])
def test_unsupported_mods_are_refused_naming_why(fn, match):
    with pytest.raises(tracer.UnsupportedMod, match=match):
        tracer.trace(fn)


def _flex(q, k, v, score_mod=None, mask_mod=None):
    """torch's FlexAttention on [b, s, h, d] tensors (eager, CPU; no backward there)."""
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, q.shape[0], q.shape[2], q.shape[1], k.shape[1],
                                       device="cpu")
    with torch.no_grad():
        out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             score_mod=score_mod, block_mask=block_mask,
                             enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _dense(q, k, v, score_mod, mask_mod, mm_dtype):
    """Attention written out with the user's functions called on broadcast index grids (no
    tracing), matmuls in `mm_dtype` and the softmax in float32 or wider: the gradient truth
    (float64) and the bf16 baseline of the tolerance rule."""
    group = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(group, dim=2).to(mm_dtype) for t in (k, v))
    score = torch.einsum("bqhd,bkhd->bhqk", q.to(mm_dtype), kk)
    score = score.to(torch.promote_types(mm_dtype, torch.float32)) * q.shape[-1] ** -0.5
    grids = tracer.index_grids(list(range(q.shape[0])), q.shape[2], q.shape[1], k.shape[1])
    if score_mod is not None:
        score = score_mod(score, *grids.values())
    if mask_mod is not None:
        score = score.masked_fill(~mask_mod(*grids.values()), float("-inf"))
    p = torch.softmax(score, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p.to(mm_dtype), vv)


@pytest.mark.parametrize("score_mod,mask_mod", [
    (alibi, None), (relative_bias, causal), (softcap20, prefix_lm), (smooth, sliding),
    (None, prefix_lm), (gated, None)], ids=lambda f: getattr(f, "__name__", "none"))
def test_attention_with_mods_meets_the_flashattention_rule(score_mod, mask_mod):
    """flash_attn_func with the very functions FlexAttention takes (CPU operators): the
    forward against FlexAttention in float64, the gradients against the written-out float64
    attention calling the same functions, each within twice the bf16 baseline's error."""
    torch.manual_seed(0)
    q = torch.randn(2, 37, H, 32, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, K, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, K, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    out, _ = flash_cute.flash_attn_func(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _dense(q64, k64, v64, score_mod, mask_mod, torch.float64)
    torch.testing.assert_close(ref.detach(), _flex(q64.detach(), k64.detach(), v64.detach(),
                                                   score_mod, mask_mod),
                               rtol=1e-10, atol=1e-10)
    qb, kb, vb = (t.detach().requires_grad_() for t in (q, k, v))
    nat = _dense(qb, kb, vb, score_mod, mask_mod, torch.bfloat16)
    assert tolerance_check(out, ref, nat).ok
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    grads64 = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    grads_nat = torch.autograd.grad(nat, (qb, kb, vb), dout)
    for name, g, r, n in zip("qkv", grads, grads64, grads_nat):
        assert tolerance_check(g, r, n).ok, f"d{name}"


def test_varlen_mods_see_the_sequence_and_positions_inside_it():
    """Packed layout: b is the sequence and q_idx / kv_idx count from its start, so each
    sequence's result is that of the padded call of its own."""
    torch.manual_seed(1)
    lens = [20, 33]
    cu = torch.tensor([0, 20, 53], dtype=torch.int32)
    q, k, v = (torch.randn(53, H, 32, dtype=torch.bfloat16) for _ in range(3))

    def per_batch(score, b, h, q_idx, kv_idx):
        return score + TABLE[b, h] - SLOPES[h] * (q_idx - kv_idx).abs()

    out, _ = flash_cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                               max_seqlen_q=33, max_seqlen_k=33,
                                               score_mod=per_batch, mask_mod=causal)
    for b, (start, n) in enumerate(zip((0, 20), lens)):
        rows = slice(start, start + n)
        padded = [torch.zeros(2, n, H, 32, dtype=torch.bfloat16) for _ in range(3)]
        for p, t in zip(padded, (q, k, v)):
            p[b] = t[rows]
        want, _ = flash_cute.flash_attn_func(*padded, score_mod=per_batch, mask_mod=causal)
        torch.testing.assert_close(out[rows], want[b], rtol=0, atol=0)


def test_softcap_goes_inside_the_mod_and_the_key_stays():
    key = registry.register(alibi, None)
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="softcap inside the mod"):
        flash_cute.flash_attn_func(q, q, q, score_mod=alibi, softcap=5.0)
    assert registry.register(alibi, None) == key   # the same function keeps its key


def test_alibi_slopes_with_softcap_is_refused_as_a_score_mod_is():
    """ALiBi runs as a score mod, which the kernels take instead of their softcap."""
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="softcap with alibi_slopes"):
        flash_cute.flash_attn_func(q, q, q, alibi_slopes=torch.rand(2), softcap=5.0)


def _kernel_spec(score_mod=None, mask_mod=None):
    return kernel_view.kernel_mods(registry.lookup(registry.register(score_mod, mask_mod)))


def test_kernel_mods_join_graphs_and_tell_a_bias_from_a_derivative():
    """The kernels' view: one node list, shared captured tensors once, the derivative kept
    only where it is not 1 (a bias needs no fragment in the backward), a hashable key that
    tells mods apart and not calls."""
    table = torch.randn(H, 9)
    ids = torch.zeros(2, 40, dtype=torch.int32)

    def biased(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 4] - table[h, 0]

    def same_doc(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (table[h, 1] > -100.0)

    spec, aux = _kernel_spec(biased, same_doc)
    assert aux == (table, ids) and spec.aux == (("fp32", 2), ("i32", 2))
    assert spec.score_grad is None and spec.mask is not None
    assert spec.nodes[spec.mask].op == "and"
    assert _kernel_spec(softcap20)[0].score_grad is not None
    assert _kernel_spec(biased, same_doc)[0].key() == spec.key()
    assert _kernel_spec(softcap20)[0].key() != _kernel_spec(gated)[0].key()
    assert hash(spec) == hash(_kernel_spec(biased, same_doc)[0])


def test_kernel_mods_refuse_what_the_kernels_cannot_read():
    many = [torch.ones(3) for _ in range(kernel_view.MAX_AUX + 1)]
    wide = torch.ones(H, dtype=torch.float64)

    def five_tables(score, b, h, q_idx, kv_idx):
        return score + many[0][h] + many[1][h] + many[2][h] + many[3][h] + many[4][h]

    def wide_bias(score, b, h, q_idx, kv_idx):
        return score + wide[h]

    def power(score, b, h, q_idx, kv_idx):
        return score * 2 ** (q_idx - kv_idx)

    for fn, match in ((five_tables, "at most"), (wide_bias, "float64"),
                      (power, "constant powers")):
        with pytest.raises(tracer.UnsupportedMod, match=match):
            _kernel_spec(fn)


def test_captured_tensors_and_block_masks_must_be_on_the_inputs_device():
    """A captured table or a block mask on another device is refused before launch (the
    kernels would read a host pointer)."""
    from types import SimpleNamespace

    from flash_cute.runtime.launch import CapturedTensors

    slopes = SLOPES.float()

    def alibi32(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    block = create_block_mask(causal, 1, 2, 128, 128, device="cpu")
    for key in (registry.register(alibi32, None), registry.register(None, None, block)):
        problem = SimpleNamespace(mods=registry.lookup(key))
        assert len(CapturedTensors(problem, torch.device("cpu")).tensors) == 1
        with pytest.raises(ValueError, match="on the inputs' device 'meta'"):
            CapturedTensors(problem, torch.device("meta"))


def test_gpu_pipelines_need_the_mods_and_block_sparse_capabilities():
    """Dispatch: the mods are a capability and a block mask's sparsity another; hopper and
    ampere have both."""
    import dataclasses

    from flash_cute.contract.descriptor import BLOCK_SPARSE, MODS, required_capabilities
    from flash_cute.runtime.dispatch import PIPELINES
    from flash_cute.runtime.problem import validate_attention_inputs

    q = torch.randn(1, 128, 2, 64, dtype=torch.bfloat16)
    problem = validate_attention_inputs(q, q, q, require_cuda=False)
    key = registry.register(alibi, None)
    with_mods = dataclasses.replace(problem, mods=registry.lookup(key))
    assert MODS in required_capabilities(with_mods) and MODS not in required_capabilities(problem)
    block = create_block_mask(causal, 1, 2, 128, 128, device="cpu")
    sparse = dataclasses.replace(problem, mods=registry.lookup(
        registry.register(None, None, block)))
    assert BLOCK_SPARSE in required_capabilities(sparse)
    names = {p.name: p for p in PIPELINES}
    for name in ("hopper", "ampere"):
        assert names[name].missing(required_capabilities(with_mods)) is None
        assert names[name].missing(required_capabilities(sparse)) is None


def test_the_backward_finds_its_entry_when_the_block_mask_is_gone():
    """A block mask built inline in the call is collected before the backward runs; the
    autograd context keeps the registry entry (it had raised "variant N is not registered")."""
    import gc

    def doc(b, h, q_idx, kv_idx):
        return (q_idx // 50) == (kv_idx // 50)

    q, k, v = (torch.randn(1, 150, 2, 32, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flash_cute.flash_attn_func(q, k, v, block_mask=create_block_mask(
        doc, 1, 1, 150, 150, device="cpu", BLOCK_SIZE=64))[0]
    gc.collect()
    out.sum().backward()
    expect = flex_attention(*(t.detach().float().transpose(1, 2) for t in (q, k, v)),
                            block_mask=create_block_mask(doc, 1, 1, 150, 150, device="cpu",
                                                         BLOCK_SIZE=64))
    assert torch.allclose(out.float(), expect.transpose(1, 2), atol=2e-2)
    assert q.grad.isfinite().all() and k.grad.abs().sum() > 0


def _over_lengths_compiled(attend, check):
    """`check(compiled, q, k, v)` at three lengths, `attend` under torch.compile(fullgraph,
    dynamic, aot_eager): no recompile after the first length."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, backend=counter, fullgraph=True, dynamic=True)
    frames = None
    for seqlen in (33, 57, 80):
        q, k, v = (torch.randn(1, seqlen, H, 32, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        check(compiled, q, k, v)
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames


def test_mods_under_compile_fullgraph_dynamic():
    """Registered mods trace with the block (no break, no recompile across lengths); mods
    never registered are refused with how to register them (a trace cannot run the tracer)."""
    def attend(q, k, v):
        return flash_cute.flash_attn_func(q, k, v, score_mod=alibi, mask_mod=causal)[0]

    def check(compiled, q, k, v):
        got, want = compiled(q, k, v), attend(q, k, v)
        assert torch.equal(got, want)
        for a, b in zip(torch.autograd.grad(got.float().sum(), (q, k, v)),
                        torch.autograd.grad(want.float().sum(), (q, k, v))):
            assert torch.equal(a, b)

    registry.register(alibi, causal)
    _over_lengths_compiled(attend, check)

    def fresh(score, b, h, q_idx, kv_idx):
        return score * 0.5

    q = torch.randn(1, 16, H, 32, dtype=torch.bfloat16)
    with pytest.raises(Exception, match="register them first"):
        torch.compile(lambda q: flash_cute.flash_attn_func(q, q.clone(), q.clone(),
                                                           score_mod=fresh)[0],
                      backend="aot_eager", fullgraph=True)(q)
    torch._dynamo.reset()


def test_block_masks_follow_flex_attentions_meaning():
    """A BlockMask from create_block_mask, and one built by hand listing every visited block as
    partial: FlexAttention's result. One whose blocks disagree with its mask mod (a full block
    where the mod says no; a skipped block where it says yes) follows the blocks, as
    FlexAttention's kernels do (its eager CPU path applies the mask mod everywhere instead):
    checked against the rule written out element by element."""
    from torch.nn.attention.flex_attention import BlockMask

    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 300, H, 32, dtype=torch.float64) for _ in range(3))

    def blocks(kv_num, kv_idx, full_num, full_idx):
        return BlockMask.from_kv_blocks(
            torch.tensor(kv_num, dtype=torch.int32).view(1, 1, 3),
            torch.tensor(kv_idx, dtype=torch.int32).view(1, 1, 3, 3),
            torch.tensor(full_num, dtype=torch.int32).view(1, 1, 3),
            torch.tensor(full_idx, dtype=torch.int32).view(1, 1, 3, 3),
            mask_mod=causal, seq_lengths=(300, 300))

    made = flash_cute.create_block_mask(causal, 2, None, 300, 300, device="cpu")
    all_partial = blocks([1, 2, 3], [[0, 0, 0], [0, 1, 0], [0, 1, 2]], [0, 0, 0],
                         [[0, 0, 0]] * 3)
    for block_mask in (made, all_partial):
        with torch.no_grad():
            want = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  block_mask=block_mask).transpose(1, 2)
            nat = flex_attention(*(t.bfloat16().transpose(1, 2) for t in (q, k, v)),
                                 block_mask=block_mask).transpose(1, 2)
        got, _ = flash_cute.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                            block_mask=block_mask)
        assert tolerance_check(got, want, nat).ok
    # Block (0, 1) full although the mod masks it; block (2, 1) skipped although it sees.
    odd = blocks([1, 1, 2], [[0, 0, 0], [1, 0, 0], [0, 2, 0]], [1, 1, 0],
                 [[1, 0, 0], [0, 0, 0], [0, 0, 0]])
    visible = torch.zeros(300, 300, dtype=torch.bool)
    rows, cols = torch.arange(300).view(-1, 1), torch.arange(300).view(1, -1)
    for m, n, kind in ((0, 0, "partial"), (0, 1, "full"), (1, 1, "partial"), (1, 0, "full"),
                       (2, 0, "partial"), (2, 2, "partial")):
        r, c = slice(128 * m, 128 * (m + 1)), slice(128 * n, 128 * (n + 1))
        visible[r, c] = True if kind == "full" else (rows >= cols)[r, c]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 32 ** -0.5
    want = torch.einsum("bhqk,bkhd->bqhd",
                        torch.softmax(scores.masked_fill(~visible, float("-inf")), -1), v)
    nat = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(
        (torch.einsum("bqhd,bkhd->bhqk", q.bfloat16(), k.bfloat16()).float() * 32 ** -0.5)
        .masked_fill(~visible, float("-inf")), -1).bfloat16(), v.bfloat16())
    got, _ = flash_cute.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                        block_mask=odd)
    assert tolerance_check(got, want, nat).ok
    with pytest.raises(ValueError, match="block_mask covers"):
        flash_cute.flash_attn_func(q[:, :200].bfloat16(), k.bfloat16(), v.bfloat16(),
                                   block_mask=made)


def test_reblocking_to_kernel_tiles_is_conservative_and_exact_where_it_can_be():
    from flash_cute.variants import block_mask as bm

    made = flash_cute.create_block_mask(causal, 1, 1, 1000, 1000, device="cpu")
    states = bm.block_states(made)
    for tile in ((128, 128), (192, 128), (64, 176), (80, 48)):
        tiles = bm.reblock(states, (128, 128), tile, 1000, 1000)
        rows = torch.arange(1000).view(-1, 1)
        visible = rows >= torch.arange(1000).view(1, -1)
        for m in range(tiles.shape[2]):
            for n in range(tiles.shape[3]):
                part = visible[m * tile[0]:(m + 1) * tile[0], n * tile[1]:(n + 1) * tile[1]]
                state = int(tiles[0, 0, m, n])
                if state == bm.EMPTY:
                    assert not part.any()
                if state == bm.FULL:
                    assert part.all()
        assert tiles.shape[2:] == (-(-1000 // tile[0]), -(-1000 // tile[1]))
    assert torch.equal(bm.reblock(states, (128, 128), (128, 128), 1000, 1000), states)


def test_kernel_tiles_and_narrowed_ranges_cover_exactly_the_non_empty_tiles():
    """A block mask as a kernel's tiles read it (`block_mask.kernel_tiles`): the ranges are
    the tightest holding every non-empty tile, per query tile and per key tile, and
    `block_range.narrow` / `narrow_pair` cut a kernel's range to them (empty where none)."""
    from flash_cute.contract.block_range import block_range, narrow, narrow_pair, needs_mask
    from flash_cute.variants.block_mask import EMPTY, FULL, block_states, kernel_tiles

    torch.manual_seed(5)
    keep = torch.rand(9, 9) < 0.3

    def scattered(b, h, q_idx, kv_idx):
        return keep[q_idx // 128, kv_idx // 128] & (kv_idx <= q_idx + 700)

    mask = create_block_mask(scattered, 1, 1, 1100, 1100, device="cpu")
    for tile in ((128, 128), (128, 64), (64, 128), (192, 128), (80, 128)):
        states, fwd, bwd = kernel_tiles(block_states(mask), (128, 128), tile, 2, 3, 1100, 1100)
        assert states.shape[:2] == (2, 3) and torch.equal(states[0, 0], states[1, 2])
        for ranges, grid in ((fwd, states[0, 0]), (bwd, states[0, 0].T)):
            for i, row in enumerate(grid):
                hit = (row != EMPTY).nonzero().flatten().tolist()
                want = (hit[0], hit[-1] + 1) if hit else (0, 0)
                assert tuple(ranges[0, 0, i, :2].tolist()) == want
        for i, row in enumerate(states[0, 0].tolist()):
            # The forward's longest run of full tiles, by a plain scan.
            best, run = (0, 0), 0
            for j, state in enumerate(row + [EMPTY]):
                if state == FULL:
                    run += 1
                    continue
                if run > best[1] - best[0]:
                    best = (j - run, j)
                run = 0
            assert tuple(fwd[0, 0, i, 2:].tolist()) == best
        for m in range(states.shape[2]):
            rng = block_range(m, tile[0], tile[1], 1100, 1100, causal=True)
            start, end, full_start, full_end = fwd[1, 1, m].tolist()
            for cut in (narrow(rng, start, end), narrow(rng, start, end, full_start, full_end)):
                assert cut.n_block_min >= max(rng.n_block_min, start) or cut.n_block_max == cut.n_block_min
                assert cut.n_block_max <= min(rng.n_block_max, max(end, cut.n_block_min))
                assert cut.n_block_min <= cut.n_block_min_no_mask <= cut.n_block_max_no_mask <= cut.n_block_max
            # Blocks the kernel runs without the mask's state: full tiles the causal mask
            # leaves whole.
            for n in range(cut.n_block_min_no_mask, cut.n_block_max_no_mask):
                assert states[1, 1, m, n] == FULL and not needs_mask(n, rng)
    assert narrow_pair(2, 9, 4, 6) == (4, 6) and narrow_pair(2, 9, 10, 12) == (9, 9)
    assert narrow_pair(2, 9, 0, 1) == (2, 2)


def _learnable_mod(slopes, table, span):
    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs() + table[h, q_idx - kv_idx + span]
    return mod


@pytest.mark.parametrize("varlen", [False, True])
def test_gradients_reach_learnable_captured_tensors(varlen):
    """A score mod's learnable tensors (ALiBi slopes, a relative-bias table) get gradients
    through the CPU operators, against FlexAttention's in float64 on the same function; only
    the learnable one of two captured tensors gets one, and with q, k, v frozen too."""
    torch.manual_seed(5)
    slopes = (torch.rand(H) + 0.1).requires_grad_()
    table = torch.randn(H, 2 * 53 + 1)           # not learnable: no gradient, no slot
    lens = (21, 32) if varlen else (53, 53)
    # fp16: the backward takes Δ = rowsum(dO ∘ O) from the saved 16-bit O, as the kernels do,
    # and a slope's gradient sums that rounding over every score; bf16's would pass 1e-3.
    q, k, v = (torch.randn(1, sum(lens) if varlen else 53, H, 32, dtype=torch.float16)
               for _ in range(3))
    dout = torch.randn_like(q)
    for frozen in (False, True):
        slopes.grad = None
        qkv = [t.clone().requires_grad_(not frozen) for t in (q, k, v)]
        mod = _learnable_mod(slopes, table, 53)
        if varlen:
            cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
            out = flash_cute.flash_attn_varlen_func(
                *(t[0] for t in qkv), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                max_seqlen_k=max(lens), score_mod=mod, causal=True)[0][None]
        else:
            out = flash_cute.flash_attn_func(*qkv, score_mod=mod, causal=True)[0]
        out.backward(dout)
        got = slopes.grad.clone()
        s64 = slopes.detach().double().requires_grad_()
        mod64 = _learnable_mod(s64, table.double(), 53)
        starts = [0, lens[0]] if varlen else [0]
        for start, n in zip(starts, lens if varlen else (53,)):
            part = slice(start, start + n)
            qd, kd, vd = (t[:, part].double().transpose(1, 2) for t in (q, k, v))
            ref = flex_attention(qd, kd, vd, score_mod=mod64, block_mask=create_block_mask(
                causal, None, None, n, n, device="cpu"))
            ref.backward(dout[:, part].double().transpose(1, 2))
        assert table.grad is None
        assert torch.allclose(got.double(), s64.grad, rtol=1e-3, atol=1e-3 * s64.grad.abs().max())


def test_a_learnable_tensor_whose_derivative_reads_the_score_is_refused():
    """The backward accumulates a captured tensor's gradient after dS, when the score is gone:
    a learnable factor of the score is refused naming the way out; detached, it runs."""
    w = torch.rand(H).requires_grad_()

    def scaled(score, b, h, q_idx, kv_idx):
        return score * w[h]

    variant = registry.lookup(registry.register(scaled, None))
    with pytest.raises(tracer.UnsupportedMod, match="depends on the score"):
        kernel_view.kernel_mods(variant, grads=True)
    assert kernel_view.kernel_mods(variant)[0].aux_grads == ()


def test_the_backward_operator_returns_the_learnable_gradients_and_passes_opcheck():
    """flash_cute::bwd with mod_grads: its fake and CPU implementations agree (opcheck), and
    it returns one gradient per learnable tensor, none without mod_grads."""
    slopes = (torch.rand(H) + 0.1).requires_grad_()
    key = registry.register(_learnable_mod(slopes, torch.zeros(H, 61), 30), None)
    q, k, v = (torch.randn(1, 29, H, 32, dtype=torch.bfloat16) for _ in range(3))
    opts = (None, None, None, True, None, None, 0.0, None, False, None)
    out, lse = torch.ops.flash_cute.fwd(q, k, v, None, None, None, None, *opts, True, key)
    args = (torch.randn_like(out), None, q, k, v, out, lse, None, None, None, None, *opts, key,
            0.0, None)
    torch.library.opcheck(torch.ops.flash_cute.bwd.default, args + (True,))
    assert len(torch.ops.flash_cute.bwd(*args, True)[3]) == 1
    assert torch.ops.flash_cute.bwd(*args)[3] == []


_PLAN_LEARNABLE = """
import torch
from flash_cute.runtime import call
from flash_cute.variants import kernel_view, registry, tracer
from flash_cute.runtime.dispatch import pipeline_named
from flash_cute.runtime.jit import compile_only
from flash_cute.runtime.problem import validate_attention_inputs

slopes = torch.rand(4, device="meta").requires_grad_()
table = torch.rand(4, 101, device="meta").requires_grad_()
ids = torch.zeros(90, dtype=torch.int32, device="meta")


def mod(score, b, h, q_idx, kv_idx):
    return score - slopes[h] * (q_idx - kv_idx).abs() + table[h, q_idx - kv_idx + 50]


def with_ids(score, b, h, q_idx, kv_idx):
    return mod(score, b, h, q_idx, kv_idx) + ids[kv_idx]


try:   # three tensors and two gradients: five slots of four
    kernel_view.kernel_mods(registry.lookup(registry.register(with_ids, None)), True)
except tracer.UnsupportedMod as e:
    assert "at most 4 in all" in str(e), e
else:
    raise AssertionError("five aux slots accepted")
key = registry.register(mod, None)
q = torch.empty(2, 77, 4, 128, dtype=torch.bfloat16, device="meta")
k = torch.empty(2, 90, 2, 128, dtype=torch.bfloat16, device="meta")
base = validate_attention_inputs(q, k, k, causal=True, require_cuda=False)
fwd_problem = call.with_mods(base, key, q)
problem = call.with_mods(base, key, q, True)
assert problem.mod_grads and not fwd_problem.mod_grads
for name in ("hopper", "ampere"):
    pipe = pipeline_named(name)
    with compile_only():
        out, lse = pipe.forward(q, k, k, fwd_problem, None, None, None, None)
        plain = pipe.plan_backward(out, None, q, k, k, out, lse, fwd_problem, None, None, None,
                                   None, False)
        launch = pipe.plan_backward(out, None, q, k, k, out, lse, problem, None, None, None,
                                    None, False)
        grads = []
        launch(out, None, q, k, k, out, lse, mod_grads=grads)
    assert plain.main.key != launch.main.key
    assert [(tuple(g.shape), g.dtype) for g in grads] == \\
        [((4,), torch.float32), ((4, 101), torch.float32)]
    assert launch.aux.learned[0] is slopes and launch.aux.learned[1] is table
print("planned")
"""


def test_learnable_tensors_plan_and_compile_in_both_backwards(tmp_path):
    """The GPU path's host side and kernels, compiled for sm_90a against meta tensors (nothing
    launched): the backward with gradients of two learnable captured tensors (their buffers in
    the aux slots after them; a third tensor would need five slots, refused) has its own
    compile key, and returns one fp32-accumulated gradient per learnable tensor."""
    import os
    import subprocess
    import sys

    script = tmp_path / "plan_learnable.py"
    script.write_text(_PLAN_LEARNABLE)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"}, timeout=600)
    assert proc.returncode == 0 and "planned" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_learnable_parameters_under_compile_fullgraph_dynamic():
    """An nn.Parameter captured by a mod (torch.fx alone refuses one outside a module) gets
    the same gradient under torch.compile(fullgraph=True, dynamic=True) as eagerly, with no
    recompile across lengths."""
    slopes = torch.nn.Parameter(torch.rand(H) + 0.1)

    def learned_alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def attend(q, k, v):
        return flash_cute.flash_attn_func(q, k, v, score_mod=learned_alibi, causal=True)[0]

    def check(compiled, q, k, v):
        grads = []
        for fn in (compiled, attend):
            slopes.grad = None
            fn(q, k, v).float().sum().backward()
            grads.append(slopes.grad.clone())
        assert grads[0].abs().max() > 0 and torch.equal(grads[0], grads[1])

    registry.register(learned_alibi, None)
    _over_lengths_compiled(attend, check)
    torch._dynamo.reset()


def test_a_learnable_tensor_indexed_by_the_score_is_refused():
    """A gradient at an index computed from the score has no place the kernels can accumulate
    it: refused with the way out (the CPU reference could compute it; the GPU would not)."""
    table = torch.rand(H, 2).requires_grad_()

    def by_sign(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.where(score > 0, 1, 0)]

    variant = registry.lookup(registry.register(by_sign, None))
    with pytest.raises(tracer.UnsupportedMod, match="indexed by a value of the score"):
        kernel_view.kernel_mods(variant, grads=True)


def test_learnable_gradients_refuse_a_second_differentiation():
    """A learnable tensor's gradient, like dQ, raises when differentiated again
    (create_graph=True): the backward has no derivative of its own."""
    slopes = (torch.rand(H) + 0.1).requires_grad_()
    q, k, v = (torch.randn(1, 20, H, 32, dtype=torch.bfloat16) for _ in range(3))
    out = flash_cute.flash_attn_func(q, k, v, score_mod=_learnable_mod(slopes, torch.zeros(
        H, 41), 20))[0]
    (grad,) = torch.autograd.grad(out.float().sum(), slopes, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        grad.sum().backward()


def test_a_paged_call_with_a_block_mask_reads_gathered_pages(monkeypatch):
    """A block mask covers the logical keys: with pages the kernels would read themselves (as
    on CUDA without gradients), the call gathers them instead of checking the mask against the
    cache's page size (which raised)."""
    from flash_cute.api import interface
    from flash_cute.runtime import paging

    monkeypatch.setattr(interface, "_pages_in_kernel", lambda *args: True)
    q = torch.randn(2, 40, H, 32, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(7, 16, H, 32, dtype=torch.bfloat16) for _ in range(2))
    page_table = torch.tensor([[3, 0, 5], [6, 1, 2]], dtype=torch.int32)
    k, v = paging.gather(k_cache, v_cache, page_table)
    block_mask = create_block_mask(causal, 1, 1, 40, 48, device="cpu")
    out = flash_cute.flash_attn_func(q, k_cache, v_cache, page_table=page_table,
                                     block_mask=block_mask)[0]
    assert torch.equal(out, flash_cute.flash_attn_func(q, k, v, block_mask=block_mask)[0])
