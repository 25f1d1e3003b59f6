"""Index contents never lose data: every bad index raises on the CPU (before any write, the
cache bitwise unchanged), the check the CUDA path runs raises on the same contents, and an
append that does not fit drops its extra rows (never written over a cached row) and counts
them in the status word."""

import pytest
import torch

import flash_cute
from flash_cute.runtime import paging, plans, status
from flash_cute.runtime.cache_contents import check_cache_contents
from flash_cute.runtime.launch_fwd import AppendFirst

B, H, D, PAGE = 3, 2, 16, 4


def _dense(capacity=8, batch=B):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(batch, capacity, H, D, generator=g).bfloat16() for _ in range(2))


def _paged(num_pages=10):
    g = torch.Generator().manual_seed(2)
    return tuple(torch.randn(num_pages, PAGE, H, D, generator=g).bfloat16() for _ in range(2))


def _table(rows):
    return torch.tensor(rows, dtype=torch.int32)


def _new(n, batch=B):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(batch, 1, H, D, generator=g).bfloat16(),) + tuple(
        torch.randn(batch, n, H, D, generator=g).bfloat16() for _ in range(2))


def _seqlens(*values):
    return torch.tensor(values, dtype=torch.int32)


# (case, call kwargs builder, words the message must hold). Each builder returns the kwargs
# of one flash_attn_with_kvcache call whose contents are bad in exactly one way.
def _kvcache_cases():
    kc, vc = _dense()
    pk, pv = _paged()
    q, k, v = _new(2)
    good_table = _table([[0, 1], [2, 3], [4, 5]])
    cos = torch.randn(7, D // 4)
    return {
        "append past the dense cache": (
            dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=_seqlens(3, 7, 0)),
            ["cache_seqlens[1] = 7", "does not fit", "[0, 6]"]),
        "append past the pages": (
            dict(q=q, k_cache=pk, v_cache=pv, k=k, v=v, cache_seqlens=_seqlens(1, 7, 2),
                 block_table=good_table),
            ["cache_seqlens[1] = 7", "does not fit", "block_table"]),
        "int cache_seqlens past the cache": (
            dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=7),
            ["cache_seqlens[0] = 7", "does not fit"]),
        "read past the cache": (
            dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=_seqlens(3, 9, 0)),
            ["cache_seqlens[1] = 9", "[0, 8]"]),
        "negative cache_seqlens": (
            dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=_seqlens(3, -1, 0)),
            ["cache_seqlens[1] = -1", "negative"]),
        "block_table entry past the pages": (
            dict(q=q, k_cache=pk, v_cache=pv, k=k, v=v, cache_seqlens=_seqlens(1, 3, 2),
                 block_table=_table([[0, 1], [2, 10], [4, 5]])),
            ["block_table[1, 1] = 10", "[0, 10)"]),
        "negative block_table entry": (
            dict(q=q, k_cache=pk, v_cache=pv, cache_seqlens=_seqlens(1, 2, 5),
                 block_table=_table([[0, 1], [2, 3], [4, -1]])),
            ["block_table[2, 1] = -1", "[0, 10)"]),
        "two sequences append to one page": (
            dict(q=q, k_cache=pk, v_cache=pv, k=k, v=v, cache_seqlens=_seqlens(1, 1, 2),
                 block_table=_table([[0, 1], [0, 3], [4, 5]])),
            ["both page 0", "distinct"]),
        "cache_batch_idx past the cache": (
            dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=_seqlens(1, 1, 1),
                 cache_batch_idx=_seqlens(0, 3, 1)),
            ["cache_batch_idx[1] = 3", "[0, 3)"]),
        "repeated cache_batch_idx with an append": (
            dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=_seqlens(1, 1, 1),
                 cache_batch_idx=_seqlens(2, 0, 2)),
            ["cache_batch_idx[0] and cache_batch_idx[2]", "both 2"]),
        "cache_leftpad past cache_seqlens": (
            dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=_seqlens(3, 2, 4),
                 cache_leftpad=_seqlens(0, 3, 0)),
            ["cache_leftpad[1] = 3", "cache_seqlens[1] = 2"]),
        "rotary positions past the tables": (
            dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=_seqlens(3, 6, 0),
                 rotary_cos=cos, rotary_sin=cos.clone(), causal=True),
            ["rotary_cos / rotary_sin have 7 positions", "sequence 1", "position 7"]),
    }


@pytest.mark.parametrize("case", list(_kvcache_cases()))
def test_each_bad_kvcache_content_raises_on_the_cpu_before_any_write(case):
    kwargs, words = _kvcache_cases()[case]
    before = {name: kwargs[name].clone() for name in ("k_cache", "v_cache")}
    with pytest.raises(ValueError) as err:
        flash_cute.flash_attn_with_kvcache(**kwargs)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    for name, t in before.items():
        assert torch.equal(kwargs[name], t), f"{name} changed by a refused call"
    assert status.check_status(raise_error=False) == 0


@pytest.mark.parametrize("case", list(_kvcache_cases()))
def test_the_cuda_paths_check_raises_on_the_same_cpu_contents(case):
    """`check_cache_contents` is what a CUDA call runs with `check_inputs(True)`."""
    kwargs, words = _kvcache_cases()[case]
    kc, q, k = kwargs["k_cache"], kwargs["q"], kwargs.get("k")
    table = kwargs.get("block_table")
    capacity = kc.shape[1] * (1 if table is None else table.shape[1])
    cos = kwargs.get("rotary_cos")
    with pytest.raises(ValueError) as err:
        check_cache_contents(
            kwargs["cache_seqlens"], 0 if k is None else k.shape[1], capacity, batch=B,
            seqlen_q=q.shape[1], local=kwargs.get("causal", False), block_table=table,
            num_pages=kc.shape[0], page_size=kc.shape[1],
            batch_idx=kwargs.get("cache_batch_idx"), cache_batch=kc.shape[0],
            leftpad=kwargs.get("cache_leftpad"),
            rotary_rows=None if cos is None else cos.shape[0])
    assert words[0] in str(err.value)


def test_good_contents_pass_both_checks_and_padding_entries_are_not_read():
    """A table padded with -1 past the pages a sequence uses is valid (never read)."""
    pk, pv = _paged()
    q, k, v = _new(2)
    table = _table([[0, 1, -1], [2, -1, -1], [4, 5, 6]])
    seqlens = _seqlens(3, 1, 9)
    check_cache_contents(seqlens, 2, 12, batch=B, seqlen_q=1, local=False, block_table=table,
                         num_pages=10, page_size=PAGE)
    out = flash_cute.flash_attn_with_kvcache(q, pk, pv, k, v, cache_seqlens=seqlens,
                                             block_table=table)
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("entry", [10, -1])
def test_page_table_entries_raise_on_the_cpu_and_in_the_cuda_check(entry):
    pk, pv = _paged()
    q = torch.randn(B, 3, H, D).bfloat16()
    table = _table([[0, 1], [2, entry], [4, 5]])
    with pytest.raises(ValueError, match=rf"page_table\[1, 1\] = {entry} .*\[0, 10\)"):
        flash_cute.flash_attn_func(q, pk, pv, page_table=table)
    used = _seqlens(8, 5, 8)
    with pytest.raises(ValueError, match=r"page_table\[1, 1\]"):
        flash_cute.flash_attn_varlen_func(q, pk, pv, page_table=table, seqused_k=used)
    # The entry is past what sequence 1 uses: not read, so not an error.
    flash_cute.flash_attn_varlen_func(q, pk, pv, page_table=table, seqused_k=_seqlens(8, 4, 8))
    # The CUDA path's check (`plans._check_contents`), on the same CPU tensors.
    problem = plans.call.validate_call(q, pk, pv, (None, None, None, used),
                                       (None, None, None, False, None, None, 0.0, None),
                                       require_cuda=False, page_table=table)
    with pytest.raises(ValueError, match=r"page_table\[1, 1\]"):
        plans._check_contents(q, pk, pv, (None, None, None, used), problem, table)
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 9|seqused_k\[0\]=9"):
        plans._check_contents(q, pk, pv, (None, None, None, _seqlens(9, 1, 1)), problem,
                              _table([[0, 1], [2, 3], [4, 5]]))


def _written_out(kc, seqlens, k):
    """What the cache must hold after an append of k at seqlens with the rows that do not
    fit dropped: built row by row here, not with `paging`."""
    want = kc.clone()
    for b in range(k.shape[0]):
        for i in range(k.shape[1]):
            pos = int(seqlens[b]) + i
            if 0 <= pos < kc.shape[1]:
                want[b, pos] = k[b, i]
    return want


@pytest.mark.parametrize("seqlens", [(6, 2, 0), (8, 7, 5), (-2, -5, 9), (3, 3, 3)])
def test_write_rows_drops_what_does_not_fit_and_never_touches_a_cached_row(seqlens):
    kc, vc = _dense()
    _, k, v = _new(3)
    start = _seqlens(*seqlens)
    want_k, want_v = _written_out(kc, start, k), _written_out(vc, start, v)
    fits = paging.append_fits(start, 3, kc.shape[1])
    paging.write_rows(kc, vc, k, v, paging.cache_rows(kc, None, B), start, fits)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_write_rows_drops_rows_through_a_page_entry_outside_the_cache():
    """A bad entry's rows are not written into the page its clamped index names (another
    sequence's), and no other row changes."""
    pk, pv = _paged()
    _, k, v = _new(3)
    table = _table([[0, 1], [2, 12], [9, -4]])      # 12 and -4 are no pages of 10
    start = _seqlens(2, 3, 2)
    fits = paging.append_fits(start, 3, 8, table, 10, PAGE)
    assert fits.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    before = pk.clone()
    paging.write_rows(pk, pv, k, v, paging.cache_rows(pk, table, B), start, fits)
    want = before.clone()
    want[0, 2:4], want[1, 0] = k[0, :2], k[0, 2]
    want[2, 3] = k[1, 0]
    want[9, 2:4] = k[2, :2]
    assert torch.equal(pk, want)


def test_append_first_drops_rows_past_a_paged_cache():
    """`AppendFirst` (the runtime's append for pipelines whose kernel writes none), on CPU
    tensors with a stand-in launch: seqused_k is the append's unclamped end."""
    pk, pv = _paged()
    _, k, v = _new(3)
    table = _table([[0, 1], [2, 3], [4, 5]])
    before = pk.clone()
    seen = []
    launch = AppendFirst(lambda *a, **kw: seen.append(a[6]))
    launch(None, pk, pv, seqused_k=_seqlens(9, 4, 11), page_table=table, append=(k, v))
    logical = paging.gather(pk, pv, table)[0]
    want = _written_out(paging.gather(before, before, table)[0], _seqlens(6, 1, 8), k)
    assert torch.equal(logical, want)
    assert seen and seen[0].tolist() == [9, 4, 11]
    untouched = [p for p in range(10) if p not in (0, 1, 2, 3, 4, 5)]
    assert torch.equal(pk[untouched], before[untouched])


def test_an_append_past_the_cache_under_torch_compile_drops_and_counts():
    """Under torch.compile the contents are not read (no graph break): the torch path drops
    the rows that do not fit, every cached row stays bitwise, and the status word counts."""
    status.check_status(raise_error=False)
    kc, vc = _dense()
    q, k, v = _new(3)
    seqlens = _seqlens(6, 2, 8)
    want_k, want_v = _written_out(kc, seqlens, k), _written_out(vc, seqlens, v)
    compiled = torch.compile(flash_cute.flash_attn_with_kvcache, backend="aot_eager",
                             fullgraph=True)
    out = compiled(q, kc, vc, k, v, cache_seqlens=seqlens)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    ref = flash_cute.attention_ref(q.double(), kc.double(), vc.double(),
                                   seqused_k=(seqlens + 3).clamp(max=8))[0]
    assert (out.double() - ref).abs().max() < 2e-2
    with pytest.raises(status.CacheOverflowError, match="4 appended K/V row"):
        flash_cute.check_status()
    assert flash_cute.check_status() == 0   # read and cleared


def test_status_counts_rows_outside_both_ends():
    fits = paging.append_fits(torch.tensor([-2, 5, 0, 7]), 3, 8)
    assert (~fits).sum(1).tolist() == [2, 0, 0, 2]
    status.check_status(raise_error=False)
    status.count_dropped(fits)
    status.count_dropped(fits[:, :0])
    assert status.check_status(raise_error=False) == 4


def _gpu():
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@_gpu()
@pytest.mark.parametrize("paged,splits", [(False, 0), (True, 0), (False, 3), (True, 1)])
def test_the_kernel_append_drops_rows_past_the_cache_and_counts_them(paged, splits):
    """The kernel path (`attend_and_append`, check off): rows past the capacity are dropped,
    every cached row is bitwise unchanged, the rows that fit are written, the status word
    counts each dropped row once (the kernel counts, one tile per sequence, whatever the
    splits and heads), and the output is attention over the first min(end, capacity) rows."""
    from flash_cute.api import kvcache

    dev = "cuda"
    batch, heads, d, capacity = 4, 8, 128, 256
    g = torch.Generator(device=dev).manual_seed(5)
    if paged:
        pages = capacity // 64 * batch
        kc, vc = (torch.randn(pages, 64, 2, d, device=dev, generator=g).bfloat16()
                  for _ in range(2))
        table = torch.randperm(pages, device=dev).view(batch, -1).int()
    else:
        kc, vc = (torch.randn(batch, capacity, 2, d, device=dev, generator=g).bfloat16()
                  for _ in range(2))
        table = None
    q = torch.randn(batch, 1, heads, d, device=dev, generator=g).bfloat16()
    k, v = (torch.randn(batch, 4, 2, d, device=dev, generator=g).bfloat16() for _ in range(2))
    seqlens = torch.tensor([254, 100, 256, 252], dtype=torch.int32, device=dev)
    status.check_status(dev, raise_error=False)
    logical = (lambda t: paging.gather(t, t, table)[0]) if paged else (lambda t: t)
    want_k = _written_out(logical(kc).cpu(), seqlens.cpu(), k.cpu())
    want_v = _written_out(logical(vc).cpu(), seqlens.cpu(), v.cpu())
    assert kvcache.APPEND_IN_KERNEL and kvcache._kernel_appends(q, kc, vc, k, v, (-1, -1), None)
    out = flash_cute.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                             block_table=table, causal=True,
                                             num_splits=splits)
    torch.cuda.synchronize()
    assert torch.equal(logical(kc).cpu(), want_k) and torch.equal(logical(vc).cpu(), want_v)
    assert status.check_status(dev, raise_error=False) == 2 + 4 + 0
    used = (seqlens + 4).clamp(max=capacity)
    ref = flash_cute.attention_ref(q.double(), want_k.double().to(dev),
                                   want_v.double().to(dev), seqused_k=used, causal=True)[0]
    assert (out.double() - ref).abs().max() < 2e-2


@pytest.mark.gpu
@_gpu()
def test_the_content_check_on_cuda_raises_before_the_kernel_writes():
    kc, vc = (t.cuda() for t in _dense())
    q, k, v = (t.cuda() for t in _new(3))
    before = kc.clone()
    previous = flash_cute.check_inputs(True)
    try:
        with pytest.raises(ValueError, match="does not fit"):
            flash_cute.flash_attn_with_kvcache(q, kc, vc, k, v,
                                               cache_seqlens=_seqlens(6, 2, 0).cuda())
    finally:
        flash_cute.check_inputs(previous)
    assert torch.equal(kc, before)


@pytest.mark.gpu
@_gpu()
def test_the_kernel_append_drops_rows_through_a_page_entry_outside_the_cache():
    """A written page's table entry past the cache: its rows are dropped and counted, no
    page changes but the valid rows' (the clamped index would name the last page)."""
    dev = "cuda"
    pages, page, d = 8, 64, 128
    g = torch.Generator(device=dev).manual_seed(6)
    kc, vc = (torch.randn(pages, page, 2, d, device=dev, generator=g).bfloat16()
              for _ in range(2))
    table = torch.tensor([[0, 1], [2, pages + 3]], dtype=torch.int32, device=dev)
    q = torch.randn(2, 1, 8, d, device=dev, generator=g).bfloat16()
    k, v = (torch.randn(2, 3, 2, d, device=dev, generator=g).bfloat16() for _ in range(2))
    seqlens = torch.tensor([10, 63], dtype=torch.int32, device=dev)   # seq 1: rows 63, 64, 65
    before_k, before_v = kc.clone(), vc.clone()
    status.check_status(dev, raise_error=False)
    flash_cute.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                       block_table=table, causal=True)
    torch.cuda.synchronize()
    for cache, before, new in ((kc, before_k, k), (vc, before_v, v)):
        want = before.clone()
        want[0, 10:13] = new[0]
        want[2, 63] = new[1, 0]
        assert torch.equal(cache, want)
    assert status.check_status(dev, raise_error=False) == 2


@pytest.mark.gpu
@_gpu()
def test_a_kernel_that_does_not_append_has_its_torch_append_counted():
    """`attend_and_append` on a pipeline whose kernel writes no rows (ampere): the torch write
    first (`AppendFirst`) drops and counts the rows past the cache."""
    from flash_cute.api.interface import attend_and_append

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(7)
    kc, vc = (torch.randn(2, 64, 2, 64, device=dev, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(2, 1, 4, 64, device=dev, generator=g).bfloat16()
    k, v = (torch.randn(2, 3, 2, 64, device=dev, generator=g).bfloat16() for _ in range(2))
    end = torch.tensor([66, 10], dtype=torch.int32, device=dev)   # seq 0: rows 63, 64, 65
    before = kc.clone()
    status.check_status(dev, raise_error=False)
    attend_and_append(q, kc, vc, k, v, end, causal=True, arch="ampere")
    torch.cuda.synchronize()
    want = before.clone()
    want[0, 63] = k[0, 0]
    want[1, 7:10] = k[1]
    assert torch.equal(kc, want)
    assert status.check_status(dev, raise_error=False) == 2
