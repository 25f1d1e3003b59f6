"""The content check of a KV cache's index tensors: page tables, `cache_seqlens`, appends,
`cache_batch_idx`, `cache_leftpad` and rotary positions.

With the check off, CUDA calls clamp these contents into the tensors (no access outside them)
and drop appended rows that do not fit (`flash_cute.runtime.status`); the check reads them to
the host in one transfer (one device sync) and raises ValueError naming the tensor, the entry
and its valid range, before anything is written. It runs on CPU tensors always (no sync to
save there), and on CUDA tensors with `flash_cute.check_inputs(True)`. docs/guide/reliability.md
lists what each bad content gives either way.

A page table's entries are checked where a sequence uses them: the first
``ceil(length / page_size)`` of its row (every entry when the call gives no length). Entries
past them are never read for a key, so a table padded with -1 (as serving schedulers often
leave it) passes.
"""

from __future__ import annotations

import torch


def host_copies(*tensors):
    """The tensors on the host as int64, in one transfer (None stays None)."""
    given = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not given:
        return list(tensors)
    flat = torch.cat([t.reshape(-1).long() for t in given]).cpu()
    out, at = [], 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            out.append(t)
            continue
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def _first(bad: torch.Tensor):
    """The index (a tuple) of the first True of `bad`, or None."""
    hits = bad.nonzero()
    return None if hits.shape[0] == 0 else tuple(int(i) for i in hits[0])


def check_page_entries(name: str, table: torch.Tensor, num_pages: int, page_size: int,
                       lengths: torch.Tensor | None = None,
                       lengths_name: str | None = None) -> None:
    """The entries of `table` (host int64 [batch, max_pages]) that the sequences use (the
    first ceil(lengths[b] / page_size) of row b; all without lengths) lie in [0, num_pages).
    `lengths_name`: the lengths are the caller's (seqused_k), checked first to lie in
    [0, max_pages * page_size]."""
    pages = table.shape[1]
    if lengths_name is not None and lengths is not None:
        where = _first((lengths < 0) | (lengths > pages * page_size))
        if where is not None:
            b = where[0]
            raise ValueError(f"{lengths_name}[{b}] = {int(lengths[b])} must be in [0, "
                             f"{pages * page_size}] (the rows of sequence {b}'s {pages} "
                             f"{name} entries of {page_size}-row pages)")
    if lengths is None:
        used = torch.full((table.shape[0],), pages, dtype=torch.long)
    else:
        used = ((lengths.clamp(min=0) + page_size - 1) // page_size).clamp(max=pages)
    in_use = torch.arange(pages)[None, :] < used[:, None]
    where = _first(in_use & ((table < 0) | (table >= num_pages)))
    if where is not None:
        b, i = where
        raise ValueError(f"{name}[{b}, {i}] = {int(table[b, i])} is not a page of the cache: "
                         f"entries must be in [0, {num_pages}) (sequence {b} uses the first "
                         f"{int(used[b])} of its {pages} entries)")


def check_cache_contents(seqlens, new: int, capacity: int, *, batch: int, seqlen_q: int,
                         local: bool, block_table=None, num_pages: int = 0,
                         page_size: int = 0, batch_idx=None, cache_batch: int = 0,
                         leftpad=None, rotary_rows: int | None = None) -> None:
    """The contents of one `flash_attn_with_kvcache` call: `seqlens` (cache_seqlens, an int
    or a tensor [batch]) in [0, capacity - new] (`new`: the appended rows), cache_leftpad in
    [0, cache_seqlens], cache_batch_idx in [0, cache_batch) and, where rows are written,
    without repeats; block_table's used entries pages of the cache, and no cache row written
    by two appended rows; rotary positions inside the rotary tables (`rotary_rows`; queries
    rotate at cache_seqlens[b] + i when `local`, at cache_seqlens[b] otherwise)."""
    tensor = seqlens if isinstance(seqlens, torch.Tensor) else None
    seq, table, entries, pad = host_copies(tensor, block_table, batch_idx, leftpad)
    if seq is None:
        seq = torch.full((batch,), int(seqlens), dtype=torch.long)
    _check_lengths(seq, new, capacity, block_table, page_size)
    if pad is not None:
        _check_leftpad(pad, seq)
    if entries is not None:
        _check_batch_idx(entries, cache_batch, writes=new > 0)
    if table is not None:
        check_page_entries("block_table", table, num_pages, page_size, seq + new)
        if new > 0:
            _check_distinct_targets(table, seq, new, page_size)
    if rotary_rows is not None:
        _check_rotary(seq, new, seqlen_q if local else 1, rotary_rows)


def _check_lengths(seq, new, capacity, block_table, page_size) -> None:
    where = _first(seq < 0)
    if where is not None:
        b = where[0]
        raise ValueError(f"cache_seqlens[{b}] = {int(seq[b])} is negative: each entry must be "
                         f"in [0, {capacity - new}]")
    where = _first(seq + new > capacity)
    if where is None:
        return
    b = where[0]
    rows = (f"{capacity} rows per sequence" if block_table is None else
            f"{capacity} rows per sequence ({block_table.shape[1]} block_table entries of "
            f"{page_size}-row pages)")
    if new:
        raise ValueError(f"cache_seqlens[{b}] = {int(seq[b])} plus the {new} appended "
                         f"row(s) is {int(seq[b]) + new}, past the cache's {rows}: the append "
                         f"does not fit (cache_seqlens must be in [0, {capacity - new}])")
    raise ValueError(f"cache_seqlens[{b}] = {int(seq[b])} is past the cache's {rows}: it "
                     f"must be in [0, {capacity}]")


def _check_leftpad(pad, seq) -> None:
    where = _first((pad < 0) | (pad > seq))
    if where is not None:
        b = where[0]
        raise ValueError(f"cache_leftpad[{b}] = {int(pad[b])} must be in [0, "
                         f"cache_seqlens[{b}] = {int(seq[b])}] (the padding before the "
                         f"sequence's first cached row)")


def _check_batch_idx(entries, cache_batch: int, writes: bool) -> None:
    where = _first((entries < 0) | (entries >= cache_batch))
    if where is not None:
        b = where[0]
        raise ValueError(f"cache_batch_idx[{b}] = {int(entries[b])} is not an entry of the "
                         f"cache: it must be in [0, {cache_batch})")
    if not writes:
        return
    first_at: dict[int, int] = {}
    for b, e in enumerate(entries.tolist()):
        if e in first_at:
            raise ValueError(f"cache_batch_idx[{first_at[e]}] and cache_batch_idx[{b}] are "
                             f"both {e}: the two sequences would append to the same cache "
                             f"entry (repeats are allowed only when k / v are not given)")
        first_at[e] = b


def _check_distinct_targets(table, seq, new: int, page_size: int) -> None:
    """No cache row is the target of two appended rows (two sequences, or one sequence's
    table naming a page twice, among the pages it appends to)."""
    positions = seq[:, None] + torch.arange(new)                     # [b, new]
    slots = positions // page_size
    pages = table.gather(1, slots)
    targets = (pages * page_size + positions % page_size).flatten().tolist()
    seen: dict[int, int] = {}
    for n, target in enumerate(targets):
        if target in seen:
            (b0, i0), (b1, i1) = divmod(seen[target], new), divmod(n, new)
            raise ValueError(
                f"block_table[{b0}, {int(slots[b0, i0])}] and block_table[{b1}, "
                f"{int(slots[b1, i1])}] are both page {target // page_size}, and the append "
                f"writes its row {target % page_size} for sequence {b0} (row {i0} of k) and "
                f"sequence {b1} (row {i1} of k): pages that take appended rows must be "
                f"distinct")
        seen[target] = n


def _check_rotary(seq, new: int, q_span: int, rotary_rows: int) -> None:
    last = seq + max(new, q_span) - 1
    where = _first(last >= rotary_rows)
    if where is not None:
        b = where[0]
        raise ValueError(f"rotary_cos / rotary_sin have {rotary_rows} positions, but sequence "
                         f"{b} rotates up to position {int(last[b])} (cache_seqlens[{b}] = "
                         f"{int(seq[b])}, {new} appended row(s), {q_span} query position(s)): "
                         f"positions must be in [0, {rotary_rows})")
