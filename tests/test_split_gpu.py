"""Decode forwards: split-KV (`flash_cute.runtime.splits`, `block_range.split_range`, `lse_merge`) and
paged K/V (`arch/hopper/paged.py`, `flash_cute.runtime.paging`) against
float64 by the FlashAttention rule, on decode shapes: one or a few query rows against long,
ragged caches, GQA packed or not, causal, varlen with seqused; every split count the
heuristic or the caller picks; partials poisoned so that a row a split leaves unwritten
shows; `seqlen_k_per_split` bitwise independent of the batch; `flash_attn_combine` on the
kernel against the float model. Needs a GPU (the hopper pipeline on sm90, else ampere).
"""

import pytest
import torch
from attention_checks import check_forward

import flash_cute
from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.reference.block_models import lse_merge as lse_merge_model
from flash_cute.runtime import launch_fwd

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Final outputs and split partials start as NaN (partial LSEs stay -inf where the
    launch fills them for the merge kernel: rows no tile owns); records each launch's split
    count."""
    counts = []
    alloc, alloc_parts = launch_fwd.ForwardLaunch._alloc, launch_fwd.ForwardLaunch._alloc_parts

    def poisoned_alloc(self):
        out, lse = alloc(self)
        return out.fill_(float("nan")), lse.fill_(float("nan")) if self.splits else lse

    def poisoned_parts(self):
        o_parts, lse_parts, split_counts = alloc_parts(self)
        counts.append(self.splits.count)
        if not self.lse_neg_inf or split_counts is not None:
            lse_parts.fill_(float("nan"))
        return o_parts.fill_(float("nan")), lse_parts, split_counts

    monkeypatch.setattr(launch_fwd.ForwardLaunch, "_alloc", poisoned_alloc)
    monkeypatch.setattr(launch_fwd.ForwardLaunch, "_alloc_parts", poisoned_parts)
    return counts


def _decode(batch, sq, sk, heads, heads_kv, d=128, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, sk, heads_kv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, sk, heads_kv, d, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


ARCHS = [None, "ampere"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_splits", [0, 3, 5, 8, 13, 17])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("sq, causal", [(1, False), (4, True)])
def test_split_counts_match_float64(poisoned, arch, num_splits, group, sq, causal):
    q, k, v = _decode(2, sq, 3001, 4 * group, 4, seed=num_splits)
    out, lse = flash_attn_func(q, k, v, causal=causal, num_splits=num_splits, return_lse=True,
                               arch=arch)
    check_forward(out, lse, q, k, v, causal=causal)
    assert poisoned and all(c > 1 for c in poisoned), poisoned
    if num_splits:
        assert poisoned[-1] == num_splits


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("group", [1, 4])
def test_ragged_cache_lengths_with_seqused(poisoned, arch, group):
    """seqused_k ragged: 0 (no key: O = 0, LSE = -inf), 1, inside a block, a block edge and
    full, each split of a short sequence empty past its keys."""
    q, k, v = _decode(6, 1, 2048, 4 * group, 4, seed=7)
    used = torch.tensor([0, 1, 333, 1024, 2047, 2048], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(q, k, v, seqused_k=used, num_splits=9, return_lse=True,
                                      arch=arch)
    check_forward(out, lse, q, k, v, seqused_k=used)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -float("inf"))
    assert poisoned[-1] == 9


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_queries_and_seqused_k(poisoned, arch, causal):
    """Packed queries (1 and 4 per sequence) against a padded cache with seqused_k."""
    lens_q, lens_k = [1, 4, 4, 1], [700, 1, 4099, 2500]
    heads, heads_kv, d = 16, 2, 128
    cu_q = torch.tensor([0, 1, 5, 9, 10], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(sum(lens_q), heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(4, 4099, heads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    used = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, max_seqlen_q=4,
                                      seqused_k=used, causal=causal, num_splits=0,
                                      return_lse=True, arch=arch)
    for b in range(4):
        rows = slice(cu_q[b], cu_q[b + 1])
        qb, kb, vb = q[None, rows], k[b:b + 1, :lens_k[b]], v[b:b + 1, :lens_k[b]]
        check_forward(out[None, rows], lse[:, rows][None], qb, kb, vb, causal=causal)
    assert poisoned and poisoned[-1] > 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d", [64, 96, 192, 256])
def test_other_head_dims(poisoned, arch, d):
    q, k, v = _decode(1, 2, 1500, 8, 2, d=d, seed=d)
    out, lse = flash_attn_func(q, k, v, causal=True, num_splits=6, return_lse=True, arch=arch)
    check_forward(out, lse, q, k, v, causal=True)


def test_fp16_local_window_and_softcap(poisoned):
    q, k, v = _decode(2, 3, 2900, 8, 8, seed=11, dtype=torch.float16)
    kw = dict(window_size=(700, 0), softcap=20.0)
    out, lse = flash_attn_func(q, k, v, num_splits=7, return_lse=True, **kw)
    check_forward(out, lse, q, k, v, **kw)


def test_heuristic_splits_decode_and_leaves_prefill_alone(poisoned):
    q, k, v = _decode(1, 1, 8192, 32, 8)
    flash_attn_func(q, k, v, num_splits=0)
    assert poisoned and poisoned[-1] > 1
    poisoned.clear()
    q, k, v = _decode(4, 2048, 2048, 16, 16)
    flash_attn_func(q, k, v, num_splits=0)
    assert not poisoned


@pytest.mark.parametrize("arch", ARCHS)
def test_seqlen_k_per_split_is_bitwise_independent_of_the_batch(poisoned, arch):
    """One sequence's output is bitwise the same alone, beside longer and shorter ones, and
    with more splits than it needs (num_splits 1 would run unsplit, as in FA4)."""
    q, k, v = _decode(3, 1, 5000, 16, 4, seed=5)
    used = torch.tensor([3000, 5000, 17], dtype=torch.int32, device="cuda")
    kw = dict(seqused_k=used, seqlen_k_per_split=1024, return_lse=True, arch=arch)
    out, lse = flash_attn_varlen_func(q, k, v, num_splits=0, **kw)
    alone, alone_lse = flash_attn_varlen_func(q[:1], k[:1, :3000], v[:1, :3000], num_splits=0,
                                              seqlen_k_per_split=1024, return_lse=True, arch=arch)
    more, more_lse = flash_attn_varlen_func(q, k, v, num_splits=11, **kw)
    assert poisoned[-1] == 11 and min(poisoned) >= 5
    assert torch.equal(out[:1], alone) and torch.equal(lse[:1], alone_lse)
    assert torch.equal(out, more) and torch.equal(lse, more_lse)
    check_forward(out, lse, q, k, v, seqused_k=used)
    with pytest.raises(ValueError, match="num_splits >= 5"):
        flash_attn_varlen_func(q, k, v, num_splits=3, **kw)
    with pytest.raises(ValueError, match="multiple of"):
        flash_attn_varlen_func(q, k, v, seqused_k=used, num_splits=0, seqlen_k_per_split=1000,
                               arch=arch)


def test_the_in_kernel_merge_serves_two_streams_and_leaves_its_counts_at_zero(monkeypatch):
    """The hopper forward merges its own splits, counting each tile's finished splits: calls
    of one plan on two streams at once get counts (and partials) of their own, give the
    one-stream result bitwise, and every launch sets its counts back to 0."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the in-kernel merge is the hopper forward's (sm90)")
    seen = []
    get = launch_fwd.SplitScratch.get

    def recorded(self):
        seen.append(get(self)[2])
        return get(self)

    monkeypatch.setattr(launch_fwd.SplitScratch, "get", recorded)
    q, k, v = _decode(2, 1, 30001, 32, 8, seed=3)
    kw = dict(num_splits=13, return_lse=True)
    want, want_lse = flash_attn_func(q, k, v, **kw)
    check_forward(want, want_lse, q, k, v)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results = []
    torch.cuda.synchronize()
    for _ in range(20):
        for stream in streams:
            with torch.cuda.stream(stream):
                results.append(flash_attn_func(q, k, v, **kw))
    torch.cuda.synchronize()
    for out, lse in results:
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert len({t.data_ptr() for t in seen}) == 3
    assert all(int(t.abs().sum()) == 0 for t in seen)


def test_a_split_decode_captured_in_a_cuda_graph_replays_on_another_stream():
    """A split decode call captured into a CUDA graph gets scratch of its own (counts zeroed
    inside the graph): replayed on a side stream while eager calls run on the default stream,
    on inputs refilled after the capture, it gives the eager result bitwise, and the eager
    calls give theirs."""
    q, k, v = _decode(2, 1, 20001, 32, 8, seed=9)
    used = torch.tensor([20001, 7777], dtype=torch.int32, device="cuda")

    def call():
        return flash_attn_varlen_func(q, k, v, seqused_k=used, num_splits=11, return_lse=True)

    call()  # plan and compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured = call()
    with torch.no_grad():
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
    torch.cuda.synchronize()
    want, want_lse = call()
    torch.cuda.synchronize()
    eager = []
    for _ in range(5):
        with torch.cuda.stream(side):
            graph.replay()
        eager.append(call())
    torch.cuda.synchronize()
    assert torch.equal(captured[0], want) and torch.equal(captured[1], want_lse)
    for out, lse in eager:
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    check_forward(want, want_lse, q, k, v, seqused_k=used)


def test_backward_after_a_split_forward():
    """Gradients run from the merged O and LSE (the backward does not split)."""
    q, k, v = _decode(2, 4, 1200, 8, 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = flash_attn_func(q, k, v, causal=True, num_splits=5)
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref, _ = flash_attn_func(q, k, v, causal=True)
    ref.float().square().sum().backward()
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_flash_attn_combine_kernel_matches_the_model(varlen, out_dtype):
    """The kernel path of `flash_attn_combine` (FA4's layouts) against the float model, with
    a split that saw no key for some rows (-inf LSE, NaN partial)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    splits, b, s, h, d = 7, 3, 5, 6, 128
    o = torch.randn(splits, b, s, h, d, device="cuda", generator=gen)
    lse = torch.randn(splits, b, s, h, device="cuda", generator=gen) * 3
    lse[2, :, :2] = -float("inf")
    o[2, :, :2] = float("nan")
    lse[:, 1, 4] = -float("inf")   # a row no split saw
    if varlen:
        o, lse = o.flatten(1, 2), lse.flatten(1, 2)
    out, out_lse = flash_cute.flash_attn_combine(o, lse, out_dtype=out_dtype)
    want, want_lse = lse_merge_model(o.double(), lse.double())
    assert out.dtype == out_dtype and out_lse.shape == lse.shape[1:]
    torch.testing.assert_close(out.double(), want.to(out_dtype).double(), atol=1e-2 if
                               out_dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    torch.testing.assert_close(out_lse.double(), want_lse, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- paged KV


def _paged_cache(batch, pages_per, page, heads_kv, d, seed, spare=3):
    """A shuffled paged cache with `spare` pages no sequence uses, and its table."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num = batch * pages_per + spare
    k = torch.randn(num, page, heads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(num, page, heads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    order = torch.randperm(num, device="cuda", generator=gen)[:batch * pages_per]
    return k, v, order.view(batch, pages_per).to(torch.int32)


@pytest.mark.parametrize("page", [1, 8, 16, 64, 256])
@pytest.mark.parametrize("num_splits, sq, causal", [(1, 1, False), (0, 4, True), (5, 1, False)])
def test_paged_cache_matches_float64(poisoned, page, num_splits, sq, causal):
    """Pages of every size (8 and up read by the hopper kernel itself, 1 gathered first),
    ragged lengths from 0 to full, GQA 4, split or not: against float64 on the keys the
    table names."""
    from flash_cute.runtime.paging import gather

    batch, heads_kv, d = 4, 2, 128
    pages_per = -(-1100 // page)
    k, v, table = _paged_cache(batch, pages_per, page, heads_kv, d, seed=page)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, sq, 4 * heads_kv, d, device="cuda", dtype=torch.bfloat16,
                    generator=gen)
    full = pages_per * page
    used = torch.tensor([0, 1, 777, full], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(q, k, v, page_table=table, seqused_k=used,
                                      causal=causal, num_splits=num_splits, return_lse=True)
    kg, vg = gather(k, v, table)
    check_forward(out, lse, q, kg, vg, causal=causal, seqused_k=used)


@pytest.fixture
def decode_pair(monkeypatch):
    """The hopper forward planned with `config.DECODE_PAIR` (64-row tiles, one consumer
    warpgroup, two CTAs per SM), as `bench/decode_ablation.py`'s `cta2` plans it; plans built
    before and after stay apart."""
    from flash_cute.arch.hopper import planner as api
    from flash_cute.arch.hopper.config import DECODE_PAIR
    from flash_cute.runtime import plans

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the hopper forward needs an sm90 GPU")
    monkeypatch.setattr(api, "fwd_schedule", lambda *a, **kw: DECODE_PAIR)
    plans.clear_plans()
    yield
    plans.clear_plans()


@pytest.mark.parametrize("page", [None, 16, 64])
@pytest.mark.parametrize("num_splits, sq, causal", [(0, 1, False), (5, 4, True)])
def test_the_two_cta_decode_schedule_matches_float64(poisoned, decode_pair, page, num_splits,
                                                     sq, causal):
    """`DECODE_PAIR` on ragged caches (0, 1, inside a block, full), dense or paged, split by
    the heuristic (which counts two CTAs per SM) or in 5, against float64."""
    from flash_cute.runtime.paging import gather

    batch, heads_kv, d, sk = 4, 2, 128, 1100
    if page is None:
        _, k, v = _decode(batch, 1, sk, heads_kv, heads_kv, seed=7)
        kg, vg, table, full = k, v, None, sk
    else:
        pages_per = -(-sk // page)
        k, v, table = _paged_cache(batch, pages_per, page, heads_kv, d, seed=page)
        kg, vg = gather(k, v, table)
        full = pages_per * page
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(batch, sq, 4 * heads_kv, d, device="cuda", dtype=torch.bfloat16,
                    generator=gen)
    used = torch.tensor([0, 1, 777, full], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(q, k, v, page_table=table, seqused_k=used,
                                      causal=causal, num_splits=num_splits, return_lse=True)
    check_forward(out, lse, q, kg, vg, causal=causal, seqused_k=used)
    assert poisoned and all(c > 1 for c in poisoned), poisoned


@pytest.mark.parametrize("page", [16, 128])
def test_paged_cache_with_packed_queries(poisoned, page):
    from flash_cute.runtime.paging import gather

    k, v, table = _paged_cache(3, -(-2000 // page), page, 2, 128, seed=9)
    cu_q = torch.tensor([0, 1, 5, 9], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(9, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    used = torch.tensor([1999, 4, 1234], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, max_seqlen_q=4,
                                      page_table=table, seqused_k=used, causal=True,
                                      num_splits=0, return_lse=True)
    kg, vg = gather(k, v, table)
    for b in range(3):
        rows = slice(cu_q[b], cu_q[b + 1])
        n = int(used[b])
        check_forward(out[None, rows], lse[:, rows][None], q[None, rows], kg[b:b + 1, :n],
                      vg[b:b + 1, :n], causal=True)


def test_garbage_page_indices_stay_inside_the_cache():
    """Out-of-range and negative page indices read clamped pages (what `paging.gather`
    reads), never memory outside the cache (compute-sanitizer runs this in
    bench/sanitize_cases.py)."""
    from flash_cute.runtime.paging import gather

    k, v, table = _paged_cache(2, 20, 64, 2, 128, seed=4)
    table[0, 3], table[0, 7], table[1, 0] = 10 ** 6, -5, 2 ** 31 - 1
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_varlen_func(q, k, v, page_table=table, num_splits=0, return_lse=True)
    kg, vg = gather(k, v, table)
    check_forward(out, lse, q, kg, vg)


@pytest.mark.parametrize("page", [16, 256])
def test_kvcache_reads_pages_in_place(page):
    """flash_attn_with_kvcache with a block_table: the pages are read where they are, with
    and without appended tokens."""
    from flash_cute.api.kvcache import flash_attn_with_kvcache
    from flash_cute.runtime.paging import gather

    k, v, table = _paged_cache(2, -(-600 // page), page, 2, 128, seed=page)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([300, 511], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table)
    kg, vg = gather(k, v, table)
    check_forward(out, None, q, kg, vg, seqused_k=lens)
    new_k = torch.randn(2, 1, 2, 128, device="cuda", dtype=torch.bfloat16)
    out = flash_attn_with_kvcache(q, k, v, new_k, new_k.clone(), cache_seqlens=lens,
                                  block_table=table, causal=True)
    kg, vg = gather(k, v, table)
    assert torch.equal(kg[0, 300], new_k[0, 0]) and torch.equal(kg[1, 511], new_k[1, 0])
    check_forward(out, None, q, kg, vg, seqused_k=lens + 1, causal=True)


# ---------------------------------------------------------------- in-kernel append


@pytest.mark.parametrize("page", [None, 1, 16, 64, 256])
@pytest.mark.parametrize("num_splits, new, group", [(1, 1, 4), (0, 4, 1), (5, 1, 8),
                                                   (0, 1, 4), (3, 4, 4)])
def test_kernel_append_equals_the_torch_append(monkeypatch, page, num_splits, new, group):
    """flash_attn_with_kvcache with k / v appended by the attention kernel (`kv_append`)
    against the same call appending with torch operations first: the caches bitwise equal
    afterwards, the outputs against float64 on the appended cache; lengths ragged (0, inside a
    page, at a split's edge), rotary on, causal."""
    from flash_cute.api import kvcache
    from flash_cute.runtime.paging import gather

    hk, d, capacity = 2, 128, 1024
    gen = torch.Generator(device="cuda").manual_seed(page or 0)
    shape = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.tensor([0, 5, 511, 1019 - new], dtype=torch.int32, device="cuda")
    b = lens.shape[0]
    q = torch.randn(b, new, hk * group, d, **shape)
    k_new, v_new = torch.randn(b, new, hk, d, **shape), torch.randn(b, new, hk, d, **shape)
    angle = torch.rand(capacity, 32, device="cuda", generator=gen) * 6.28
    cos, sin = torch.cos(angle).bfloat16(), torch.sin(angle).bfloat16()
    if page is None:
        k_cache, v_cache = torch.randn(b, capacity, hk, d, **shape), None
        v_cache, table = torch.randn_like(k_cache), None
    else:
        k_cache, v_cache, table = _paged_cache(b, capacity // page, page, hk, d, seed=page)
    results = []
    for in_kernel in (True, False):
        monkeypatch.setattr(kvcache, "APPEND_IN_KERNEL", in_kernel)
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = flash_cute.flash_attn_with_kvcache(
            q, kc, vc, k_new, v_new, cos, sin, cache_seqlens=lens, block_table=table,
            causal=True, num_splits=num_splits, rotary_interleaved=False,
            return_softmax_lse=True)
        results.append((out, lse, kc, vc))
    (out, lse, kc, vc), (_, _, kc_torch, vc_torch) = results
    assert torch.equal(kc, kc_torch) and torch.equal(vc, vc_torch)
    kg, vg = (kc, vc) if table is None else gather(kc, vc, table)
    qr = _rotate_like_kvcache(q, cos, sin, lens)
    check_forward(out, lse, qr, kg, vg, seqused_k=lens + new, causal=True)


def _rotate_like_kvcache(q, cos, sin, lens):
    """q rotated as flash_attn_with_kvcache does for a causal call (GPT-NeoX halves)."""
    from flash_cute.api.kvcache import _rotate

    positions = lens[:, None].long() + torch.arange(q.shape[1], device=q.device)
    return _rotate(q, cos, sin, positions, False)


def test_kernel_append_with_garbage_lengths_stays_inside_the_cache():
    """cache_seqlens past the cache and negative: the kernel's writes and reads stay inside
    the cache (compute-sanitizer runs this family in bench/sanitize_cases.py)."""
    k_cache = torch.randn(3, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    guard = k_cache.clone()
    q = torch.randn(3, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    new = torch.randn(3, 2, 2, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([-40, 255, 10 ** 6], dtype=torch.int32, device="cuda")
    out = flash_cute.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=lens,
                                             causal=True)
    assert torch.isfinite(out[1:]).all()
    assert torch.equal(k_cache[0], guard[0])   # every row of sequence 0 lies before row 0
