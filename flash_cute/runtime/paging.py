"""Paged KV caches on the host: their checks, the logical K/V they stand for, and the gather
that turns them into dense K/V where a kernel cannot read pages.

A paged cache is k / v [num_pages, page_size, heads_kv, d] with a page table int32
[batch, max_pages]: sequence b's key j is row ``j % page_size`` of page
``page_table[b, j // page_size]``, so its keys are the max_pages * page_size rows of its
pages in order (seqused_k[b] of them used). Page indices are clamped into the cache here and
in the kernels: whatever the table holds, nothing outside the cache is read, and an append
writes no row through an entry that is not a page of the cache (`append_fits`).
"""

import torch


def check_paged(k_cache, v_cache, page_table, batch: int) -> None:
    """Shapes and dtypes of a paged call's cache and table (ValueError naming the argument)."""
    if not (isinstance(page_table, torch.Tensor) and page_table.dtype == torch.int32
            and page_table.dim() == 2 and page_table.shape[0] == batch):
        got = (f"{page_table.dtype} {tuple(page_table.shape)}"
               if isinstance(page_table, torch.Tensor) else type(page_table).__name__)
        raise ValueError(f"page_table must be int32 [batch={batch}, max_pages], got {got}")
    for name, t in (("k", k_cache), ("v", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[:3] != k_cache.shape[:3]:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"with page_table, {name} must be a paged cache [num_pages, "
                             f"page_size, heads_kv, d] like k, got {got}")
    if page_table.device != k_cache.device:
        raise ValueError(f"page_table is on {page_table.device}, the cache on "
                         f"{k_cache.device}")


def page_rows(page_table: torch.Tensor, num_pages: int, page_size: int) -> torch.Tensor:
    """[batch, max_pages * page_size]: the row of cache.flatten(0, 1) holding each
    sequence's position, page indices clamped into the cache."""
    pages = page_table.long().clamp(0, num_pages - 1)
    return (pages[:, :, None] * page_size
            + torch.arange(page_size, device=pages.device)).flatten(1)


def gather(k_cache, v_cache, page_table):
    """The padded [batch, max_pages * page_size, heads_kv, d] keys and values a page table
    names (differentiable into the pages)."""
    batch = page_table.shape[0]
    rows = page_rows(page_table, *k_cache.shape[:2]).flatten()
    return tuple(t.flatten(0, 1)[rows].view(batch, -1, *t.shape[2:]) for t in (k_cache, v_cache))


def logical(k_cache, v_cache, page_table, varlen: bool):
    """Meta tensors shaped as the K and V the table stands for (for validation): padded
    [batch, rows, heads_kv, d], or packed [batch * rows, heads_kv, d] with its uniform
    cu_seqlens_k (CPU) when q is packed."""
    batch, rows = page_table.shape[0], page_table.shape[1] * k_cache.shape[1]
    lead = (batch * rows,) if varlen else (batch, rows)
    k, v = (torch.empty(lead + tuple(t.shape[2:]), dtype=t.dtype, device="meta")
            for t in (k_cache, v_cache))
    cu = torch.arange(0, (batch + 1) * rows, rows, dtype=torch.int32) if varlen else None
    return k, v, cu


def check_append(k_cache, v_cache, k_new, v_new, batch: int, seqused_k) -> None:
    """Shapes, dtypes and devices of the rows an attention call appends to its cache
    (ValueError naming the argument): k_new [batch, s_new, heads_kv, d] and v_new like it
    with v's head dim, the cache's dtype and device, contiguous; seqused_k (the lengths after
    the append) given."""
    want = (batch, None, k_cache.shape[2])
    for name, new, cache in (("k_new", k_new, k_cache), ("v_new", v_new, v_cache)):
        if not (isinstance(new, torch.Tensor) and new.dim() == 4 and new.shape[0] == batch
                and new.shape[1] == k_new.shape[1] >= 1 and new.shape[2:] == cache.shape[2:]):
            got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
            raise ValueError(f"{name} must be [batch={batch}, s_new >= 1, heads_kv={want[2]}, "
                             f"{cache.shape[3]}] (the rows appended to the cache), got {got}")
        if new.dtype != cache.dtype or new.device != cache.device or not new.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {cache.dtype} tensor on "
                             f"{cache.device}, like the cache, got {new.dtype} on {new.device}")
    if seqused_k is None:
        raise ValueError("an append needs seqused_k: each sequence's length after it")


def cache_rows(k_cache, page_table, batch: int) -> torch.Tensor:
    """[batch, capacity]: the row of cache.flatten(0, 1) of each sequence's position, in a
    dense [batch, capacity, heads_kv, d] cache or through a page table."""
    if page_table is not None:
        return page_rows(page_table, *k_cache.shape[:2])
    capacity = k_cache.shape[1]
    return (torch.arange(batch, device=k_cache.device)[:, None] * capacity
            + torch.arange(capacity, device=k_cache.device))


def append_fits(start, new: int, capacity: int, page_table=None, num_pages: int = 0,
                page_size: int = 0, entry_ok=None) -> torch.Tensor:
    """bool [batch, new]: whether each row of an append at positions ``start[b] + i`` is
    written: its position lies in [0, capacity) and, paged, its page entry is a page of the
    cache (`entry_ok` [batch]: the dense cache entry it goes to exists). No sync."""
    start = start.long()[:, None]
    pos = start + torch.arange(new, device=start.device)
    fits = (pos >= 0) & (pos < capacity)
    if page_table is not None:
        slot = (pos.clamp(0, max(capacity - 1, 0)) // page_size).clamp(
            max=page_table.shape[1] - 1)
        page = page_table.long().gather(1, slot)
        fits &= (page >= 0) & (page < num_pages)
    if entry_ok is not None:
        fits &= entry_ok[:, None]
    return fits


def write_rows(k_cache, v_cache, k_new, v_new, rows, start, fits) -> None:
    """k_new / v_new [batch, s_new, ..] into the caches at positions ``start[b] + i`` of each
    sequence (rows: `cache_rows`, [batch, capacity]), in place, where `fits`
    (`append_fits`) says so. The other rows are dropped without a sync: each is sent to
    the call's first written row, carrying the value that row gets (or, when no row is
    written, to a row with its own value), so repeated targets receive identical bytes and
    no cached row changes."""
    batch, new = k_new.shape[:2]
    capacity = rows.shape[1]
    if new == 0 or capacity == 0:
        return
    slot = (start.long()[:, None] + torch.arange(new, device=rows.device)).clamp(
        0, capacity - 1)
    target = rows.gather(1, slot).flatten()
    fits = fits.flatten()
    # The first written row (0 if none), as a 1-element index: no host read, also traced.
    first = fits.int().argmax().view(1)
    first_fits = fits.index_select(0, first)
    target = torch.where(fits, target, target.index_select(0, first))
    for cache, fresh in ((k_cache, k_new), (v_cache, v_new)):
        flat = cache.flatten(0, 1)
        value = fresh.flatten(0, 1).to(cache.dtype)
        lead = (-1,) + (1,) * (flat.dim() - 1)
        anchor = torch.where(first_fits.view(lead), value.index_select(0, first),
                             flat.index_select(0, target.index_select(0, first)))
        flat.index_copy_(0, target, torch.where(fits.view(lead), value, anchor))
