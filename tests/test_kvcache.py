"""`flash_attn_with_kvcache` (CPU operators): in-place append (dense, batch-indexed and
paged caches), rotary on q and the appended k, left padding, causal and local, GQA, against
a written-out float64 reference."""

import pytest
import torch

import flash_cute
from flash_cute.reference.attention import attention_ref, tolerance_check
from flash_cute.runtime import launch_fwd

BF16 = torch.bfloat16


def _rotary_ref(x, cos, sin, positions, interleaved):
    """Rotary by complex multiplication, pairs (2j, 2j+1) or (j, j + half), float64."""
    half = cos.shape[1]
    angle = torch.atan2(sin.double(), cos.double())[positions.long()][:, :, None, :]
    rot = x[..., :2 * half].double()
    if interleaved:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2]) * torch.polar(torch.ones_like(angle), angle)
        out = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        z = torch.complex(rot[..., :half], rot[..., half:]) * torch.polar(torch.ones_like(angle), angle)
        out = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out, x[..., 2 * half:].double()), dim=-1)


def _case(paged, batch_idx, leftpad, rotary, interleaved, causal, new, window=(-1, -1), seed=0):
    torch.manual_seed(seed)
    b, sq, h, hk, d, s_cache = 3, (4 if causal else 3), 4, 2, 64, 96
    q = torch.randn(b, sq, h, d, dtype=BF16)
    b_cache = b + 2 if batch_idx else b
    k_dense = torch.randn(b_cache, s_cache, hk, d, dtype=BF16)
    v_dense = torch.randn(b_cache, s_cache, hk, d, dtype=BF16)
    k_new = torch.randn(b, new, hk, d, dtype=BF16) if new else None
    v_new = torch.randn(b, new, hk, d, dtype=BF16) if new else None
    seqlens = torch.tensor([5, 60, 0], dtype=torch.int32)
    pad = torch.tensor([2, 30, 0], dtype=torch.int32) if leftpad else None
    idx = torch.tensor([4, 0, 2], dtype=torch.int32) if batch_idx else None
    cos = sin = None
    if rotary:
        angle = torch.rand(s_cache + 8, 16) * 6.28
        cos, sin = torch.cos(angle).to(BF16), torch.sin(angle).to(BF16)
    # The reference: the cache after the append, then attention per sequence in float64.
    entries = list(range(b)) if idx is None else idx.tolist()
    k_ref, v_ref = k_dense.clone().double(), v_dense.clone().double()
    q_ref = q.double()
    if rotary:
        local = causal or window != (-1, -1)
        offs = torch.arange(sq) if local else torch.zeros(sq, dtype=torch.long)
        q_ref = _rotary_ref(q, cos, sin, seqlens[:, None].long() + offs, interleaved)
    if new:
        pos = seqlens[:, None].long() + torch.arange(new)
        k_rot = _rotary_ref(k_new, cos, sin, pos, interleaved) if rotary else k_new.double()
        for i, e in enumerate(entries):
            k_ref[e, seqlens[i]:seqlens[i] + new] = k_rot[i]
            v_ref[e, seqlens[i]:seqlens[i] + new] = v_new[i].double()
    # The call's cache (paged: the dense rows scattered over a shuffled set of pages).
    if paged:
        page = 16
        pages_per = s_cache // page
        perm = torch.randperm(b_cache * pages_per)
        table = perm.view(b_cache, pages_per).to(torch.int32)
        k_cache = torch.empty(b_cache * pages_per, page, hk, d, dtype=BF16)
        v_cache = torch.empty_like(k_cache)
        k_cache[perm] = k_dense.view(b_cache * pages_per, page, hk, d)
        v_cache[perm] = v_dense.view(b_cache * pages_per, page, hk, d)
        table = table[:b]
    else:
        k_cache, v_cache, table = k_dense.clone(), v_dense.clone(), None
    out, lse = flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, idx, pad, table, causal=causal,
        window_size=window, rotary_interleaved=interleaved, return_softmax_lse=True)
    if paged:
        k_after = k_cache[perm].view(b_cache, s_cache, hk, d)
        v_after = v_cache[perm].view(b_cache, s_cache, hk, d)
    else:
        k_after, v_after = k_cache, v_cache
    return q_ref, k_ref, v_ref, entries, seqlens, pad, new, (out, lse), (k_after, v_after), \
        dict(causal=causal, window_size=tuple(None if w < 0 else w for w in window))


@pytest.mark.parametrize("paged,batch_idx,leftpad,rotary,interleaved,causal,new", [
    (False, False, False, False, False, True, 1),
    (False, True, True, True, True, True, 3),
    (False, False, True, True, False, False, 2),
    (True, False, False, True, True, True, 1),
    (True, False, True, True, False, True, 4),
    (False, False, False, False, False, False, 0),
])
def test_with_kvcache_matches_the_written_out_reference(paged, batch_idx, leftpad, rotary,
                                                        interleaved, causal, new):
    q, k_ref, v_ref, entries, seqlens, pad, new, (out, lse), (k_after, v_after), kw = _case(
        paged, batch_idx, leftpad, rotary, interleaved, causal, new)
    # The append happened in place, rotated.
    for i, e in enumerate(entries):
        rows = slice(int(seqlens[i]), int(seqlens[i]) + new)
        torch.testing.assert_close(k_after[e, rows].double(), k_ref[e, rows], rtol=0.02, atol=0.02)
        assert torch.equal(v_after[e, rows].double(), v_ref[e, rows])
    for i, e in enumerate(entries):
        first = 0 if pad is None else int(pad[i])
        last = int(seqlens[i]) + new
        keys, values = k_ref[e, first:last][None], v_ref[e, first:last][None]
        ref, ref_lse = attention_ref(q[i:i + 1], keys, values, mode="float64", **kw)
        nat, _ = attention_ref(q[i:i + 1].to(BF16), keys.to(BF16), values.to(BF16),
                               mode="native", **kw)
        assert tolerance_check(out[i:i + 1], ref, nat).ok, f"sequence {i}"
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse[i:i + 1]), finite)
        if finite.any():
            assert (lse[i:i + 1][finite] - ref_lse[finite]).abs().max() <= 0.05


def test_with_kvcache_local_window_and_int_seqlens():
    q, k_ref, v_ref, entries, seqlens, pad, new, (out, _), _, kw = _case(
        False, False, False, False, False, False, 2, window=(8, -1))
    for i in range(3):
        keys, values = k_ref[i, :int(seqlens[i]) + new][None], v_ref[i, :int(seqlens[i]) + new][None]
        ref, _ = attention_ref(q[i:i + 1], keys, values, mode="float64", **kw)
        nat, _ = attention_ref(q[i:i + 1].to(BF16), keys.to(BF16), values.to(BF16),
                               mode="native", **kw)
        assert tolerance_check(out[i:i + 1], ref, nat).ok
    q = torch.randn(2, 1, 4, 64, dtype=BF16)
    cache = torch.randn(2, 50, 2, 64, dtype=BF16)
    got = flash_cute.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=20)
    want, _ = flash_cute.flash_attn_func(q, cache[:, :20], cache[:, :20].clone())
    assert torch.equal(got, want)


def test_with_kvcache_refuses_bad_shapes_before_touching_the_cache():
    q = torch.randn(2, 1, 4, 64, dtype=BF16)
    cache = torch.randn(2, 50, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match="k / v must be"):
        flash_cute.flash_attn_with_kvcache(q, cache, cache.clone(), torch.zeros(2, 1, 2, 32),
                                           torch.zeros(2, 1, 2, 32), cache_seqlens=3)
    with pytest.raises(ValueError, match="block_table must be int32"):
        flash_cute.flash_attn_with_kvcache(q, cache, cache.clone(),
                                           block_table=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="mergeable"):
        flash_cute.flash_attn_with_kvcache(q, cache.transpose(0, 1), cache.transpose(0, 1))
    with pytest.raises(ValueError, match="alibi_slopes must be fp32"):
        flash_cute.flash_attn_with_kvcache(q, cache, cache.clone(), alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="cache_seqlens must be"):
        flash_cute.flash_attn_with_kvcache(q, cache, cache.clone(),
                                           cache_seqlens=torch.tensor([1, 2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_with_kvcache_on_the_gpu_equals_the_cpu_operators(paged):
    """The same call on CUDA tensors (kernels) and on CPU ones (the reference operators):
    caches updated alike, outputs within the FlashAttention rule's reach."""
    torch.manual_seed(3)
    b, h, hk, d = 3, 8, 2, 128
    q = torch.randn(b, 2, h, d, dtype=BF16)
    k_new, v_new = (torch.randn(b, 2, hk, d, dtype=BF16) for _ in range(2))
    angle = torch.rand(300, 32) * 6.28
    cos, sin = torch.cos(angle).to(BF16), torch.sin(angle).to(BF16)
    seqlens = torch.tensor([7, 200, 0], dtype=torch.int32)
    if paged:
        k_cache, v_cache = (torch.randn(40, 16, hk, d, dtype=BF16) for _ in range(2))
        table = torch.randperm(39)[:b * 13].view(b, 13).to(torch.int32)
    else:
        k_cache, v_cache = (torch.randn(b, 256, hk, d, dtype=BF16) for _ in range(2))
        table = None
    results = []
    for device in ("cpu", "cuda"):
        kc, vc = k_cache.clone().to(device), v_cache.clone().to(device)
        args = [t if t is None else t.to(device) for t in (q, k_new, v_new, cos, sin, seqlens)]
        out = flash_cute.flash_attn_with_kvcache(
            args[0], kc, vc, args[1], args[2], args[3], args[4], args[5],
            block_table=None if table is None else table.to(device), causal=True)
        results.append((out.cpu(), kc.cpu(), vc.cpu()))
    (out_cpu, kc_cpu, vc_cpu), (out_gpu, kc_gpu, vc_gpu) = results
    # v is copied as it is; k is rotated in float32 (an FMA may round differently).
    assert torch.equal(vc_cpu, vc_gpu)
    torch.testing.assert_close(kc_gpu, kc_cpu, rtol=0.02, atol=0.02)
    assert (out_gpu.float() - out_cpu.float()).abs().max() <= 0.02


def test_page_table_on_the_varlen_function_reads_the_pages_in_order():
    """page_table (FA4's name): each sequence's keys are its pages in order, seqused_k of
    them; the result equals the call on those keys laid out densely, packed q or padded, and
    gradients flow back into the pages."""
    torch.manual_seed(5)
    b, page, pages_per, hk, d = 3, 8, 5, 2, 64
    dense_k = torch.randn(b, page * pages_per, hk, d, dtype=BF16)
    dense_v = torch.randn(b, page * pages_per, hk, d, dtype=BF16)
    perm = torch.randperm(b * pages_per + 3)[:b * pages_per]
    k_pages = torch.zeros(b * pages_per + 3, page, hk, d, dtype=BF16)
    v_pages = torch.zeros_like(k_pages)
    k_pages[perm] = dense_k.view(-1, page, hk, d)
    v_pages[perm] = dense_v.view(-1, page, hk, d)
    table = perm.view(b, pages_per).to(torch.int32)
    used = torch.tensor([3, 40, 17], dtype=torch.int32)
    q = torch.randn(b, 4, 4, d, dtype=BF16)
    want, _ = flash_cute.flash_attn_varlen_func(q, dense_k, dense_v, seqused_k=used, causal=True)
    k_in = k_pages.clone().requires_grad_()
    got, _ = flash_cute.flash_attn_varlen_func(q, k_in, v_pages, seqused_k=used,
                                               page_table=table, causal=True)
    assert torch.equal(got, want)
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    packed, _ = flash_cute.flash_attn_varlen_func(q.flatten(0, 1), k_pages, v_pages,
                                                  cu_seqlens_q=cu, max_seqlen_q=4,
                                                  seqused_k=used, page_table=table, causal=True)
    assert torch.equal(packed, want.flatten(0, 1))
    (dk,) = torch.autograd.grad(got.float().sum(), k_in)
    assert dk[perm].abs().sum() > 0 and (dk[[i for i in range(b * pages_per + 3)
                                             if i not in perm.tolist()]] == 0).all()
    full, _ = flash_cute.flash_attn_func(q, k_pages, v_pages, page_table=table, causal=True)
    want_full, _ = flash_cute.flash_attn_func(q, dense_k, dense_v, causal=True)
    assert torch.equal(full, want_full)
    with pytest.raises(ValueError, match="page_table must be int32"):
        flash_cute.flash_attn_varlen_func(q, k_pages, v_pages, page_table=table.long())


def test_append_checks_and_the_torch_append_of_a_launch():
    """`paging.check_append` names each bad argument; `launch_fwd.AppendFirst` (the append of a
    pipeline whose kernel writes none) puts row i of k_new at seqused_k[b] - s_new + i of a
    dense or paged cache, clamped into it, before running the launch."""
    from flash_cute.runtime import paging

    cache = torch.zeros(2, 8, 1, 8)
    new = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 1, 8) + 1
    used = torch.tensor([5, 2], dtype=torch.int32)
    paging.check_append(cache, cache, new, new, 2, used)
    for bad, match in ((new[:1], "k_new must be"), (new.double(), "contiguous"),
                       (new.transpose(1, 3).contiguous().transpose(1, 3), "contiguous")):
        with pytest.raises(ValueError, match=match):
            paging.check_append(cache, cache, bad, new, 2, used)
    with pytest.raises(ValueError, match="needs seqused_k"):
        paging.check_append(cache, cache, new, new, 2, None)

    ran = []
    run = launch_fwd.AppendFirst(lambda *a, **kw: ran.append(kw))
    k, v = cache.clone(), cache.clone()
    run(None, k, v, seqused_k=used, append=(new, new * 2))
    assert ran == [{"rng_seed": None}]
    assert torch.equal(k[0, 2:5], new[0]) and torch.equal(v[0, 2:5], 2 * new[0])
    assert torch.equal(k[1, 0], new[1, 1]) and torch.equal(k[1, 1], new[1, 2])
    assert not k[0, :2].any() and not k[0, 5:].any() and not k[1, 2:].any()

    pages = torch.zeros(4, 4, 1, 8)
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    run(None, pages, pages.clone(), seqused_k=used, append=(new, new), page_table=table)
    assert torch.equal(pages[3, 2:4], new[0, :2]) and torch.equal(pages[1, 0], new[0, 2])
    assert torch.equal(pages[0, 0:2], new[1, 1:3])


def test_kernel_append_is_for_eager_cuda_calls_only():
    from flash_cute.api.interface import attend_and_append
    from flash_cute.api.kvcache import _kernel_appends

    q = torch.randn(1, 1, 2, 8)
    cache = torch.randn(1, 8, 1, 8)
    assert not _kernel_appends(q, cache, cache, cache[:, :1], cache[:, :1], (-1, -1), None)
    with pytest.raises(ValueError, match="eager CUDA calls only"):
        attend_and_append(q, cache, cache, cache[:, :1], cache[:, :1],
                          torch.tensor([3], dtype=torch.int32))
