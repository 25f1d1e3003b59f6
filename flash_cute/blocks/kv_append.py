"""Block: the decode step's in-place append, inside the attention kernel.

Sequence b's new keys and values (k_new / v_new [b, s_new, hk, d]) go to positions
``end - s_new .. end - 1`` of the cache (dense [b, capacity, hk, d], or paged
[pages, page_size, hk, d] through the page table), where ``end`` is seqused_k[b] as the
caller passed it: the kernel reads the first min(end, capacity) rows, and a new row whose
position lies outside [0, capacity) is dropped, never written over a cached row. One tile
per sequence counts the dropped rows into the device's counter (`count_dropped`,
`flash_cute.runtime.status`), so the host adds no operation per call. A tile that is about
to read K/V keys [lo, hi) first writes the new rows inside that range itself, so no other
CTA's write has to be waited for: CTAs that read the same rows (other query tiles or heads of
one K/V head) each write the same bytes, and each reads only after its own write. Writes go
through the generic proxy and TMA reads through the async proxy, hence the
``fence.proxy.async.global`` between them.

Every index is bounded: rows before 0 or past the capacity are skipped, a row whose page
table entry is not a page of the cache is skipped, and page indices are clamped into the
table and the cache for the reads, so no content of seqused_k or the page table writes
outside the tensors or over another sequence's rows.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

# Elements per copy: 16 bytes of a 16-bit dtype.
CHUNK = 8


@cute.jit
def append_rows(cache_k: cute.Tensor, cache_v: cute.Tensor, k_new: cute.Tensor,
                v_new: cute.Tensor, page_table, page_size: cutlass.Constexpr, batch: Int32,
                head_kv: Int32, end: Int32, capacity: Int32, key_lo: Int32, key_hi: Int32,
                thread: Int32, threads: cutlass.Constexpr):
    """Write the new rows of sequence `batch`, K/V head `head_kv`, that fall in keys
    [key_lo, key_hi) and in the cache's `capacity` rows, by `threads` threads (this one is
    `thread`), 16 bytes per copy; then fence them for TMA reads. `end`: the position after
    the last new row, unclamped. `page_size` 0: the cache is dense [b, capacity, hk, d]."""
    start = end - k_new.shape[1]
    lo = cutlass.max(cutlass.max(start, key_lo), Int32(0))
    hi = cutlass.min(cutlass.min(end, key_hi), capacity)
    rows = cutlass.max(hi - lo, Int32(0))
    _copy_rows(cache_k, k_new, page_table, page_size, batch, head_kv, start, lo, rows, thread,
               threads)
    _copy_rows(cache_v, v_new, page_table, page_size, batch, head_kv, start, lo, rows, thread,
               threads)
    cute.arch.fence_proxy("async.global")


@cute.jit
def count_dropped(dropped: cute.Tensor, s_new: Int32, page_table, page_size: cutlass.Constexpr,
                  num_pages: Int32, batch: Int32, end: Int32, capacity: Int32, thread: Int32,
                  threads: cutlass.Constexpr):
    """Add to `dropped` (int64 [1]) the new rows of sequence `batch` that `append_rows` drops:
    positions outside [0, capacity) and, paged, rows whose page entry is not a page of the
    cache. Called by one tile per sequence (every tile drops the same rows); one relaxed
    atomic per dropped row, none when all fit."""
    start = end - s_new
    for i in cutlass.range(thread, s_new, threads, unroll=1):
        row = start + i
        outside = Int32(0)
        if row < Int32(0):
            outside = Int32(1)
        if row >= capacity:
            outside = Int32(1)
        if cutlass.const_expr(page_size > 0):
            slot = cutlass.min(cutlass.max(row, Int32(0)) // page_size, page_table.shape[1] - 1)
            page = page_table[batch, slot]
            if page < Int32(0):
                outside = Int32(1)
            if page >= num_pages:
                outside = Int32(1)
        if outside == Int32(1):
            cute.arch.red(dropped.iterator, cutlass.Int64(1), op="add", dtype=cutlass.Uint64,
                          sem="relaxed", scope="gpu")


@cute.jit
def _copy_rows(cache: cute.Tensor, new: cute.Tensor, page_table, page_size: cutlass.Constexpr,
               batch: Int32, head_kv: Int32, start: Int32, lo: Int32, rows: Int32,
               thread: Int32, threads: cutlass.Constexpr):
    """Rows lo .. lo + rows - 1 of the sequence from `new` (its row r - start) into the cache,
    16 bytes per copy, the copies dealt round the threads."""
    chunks = cute.size(new, mode=[3]) // CHUNK
    for c in cutlass.range(thread, rows * chunks, threads, unroll=1):
        row = lo + c // chunks
        col = c - (c // chunks) * chunks
        src = cute.local_tile(new[batch, row - start, head_kv, None], (CHUNK,), (col,))
        dst = cute.local_tile(_cache_row(cache, page_table, page_size, batch, row, head_kv),
                              (CHUNK,), (col,))
        if cutlass.const_expr(page_size > 0):
            # A row whose table entry is not a page of the cache is dropped, not written
            # into the page its clamped index names (another sequence's).
            page = page_table[batch, cutlass.min(row // page_size, page_table.shape[1] - 1)]
            if page >= Int32(0):
                if page < cache.shape[0]:
                    dst.store(src.load())
        else:
            dst.store(src.load())


@cute.jit
def _cache_row(cache: cute.Tensor, page_table, page_size: cutlass.Constexpr, batch: Int32,
               row: Int32, head_kv: Int32) -> cute.Tensor:
    """Row `row` of sequence `batch` in the cache, for one K/V head: (d,)."""
    if cutlass.const_expr(page_size > 0):
        slot = cutlass.min(row // page_size, page_table.shape[1] - 1)
        page = cutlass.min(cutlass.max(page_table[batch, slot], Int32(0)), cache.shape[0] - 1)
        return cache[page, row - (row // page_size) * page_size, head_kv, None]
    return cache[batch, row, head_kv, None]
