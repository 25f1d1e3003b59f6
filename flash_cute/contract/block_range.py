"""Block ranges: which K/V blocks a query block visits, and which of those need a mask.

One formula serves the CPU model, the host side and every arch's kernel: it uses only ``+ - * //``
on non-negative operands (so floor and truncating division agree) and takes `imin`/`imax`, which
are Python's min/max on the host and `cutlass.min`/`cutlass.max` inside a kernel.

Masks follow `flash_cute.blocks.mask` (bottom-right aligned, ``off = seqlen_k - seqlen_q``). For
query block `m_block` with in-bounds rows ``[m_lo, m_hi)``:

* visited: ``[n_block_min, n_block_max)``, the tightest range holding every visible key;
* unmasked: ``[n_block_min_no_mask, n_block_max_no_mask)``, blocks whose every key lies inside
  seqlen_k and the window of every in-bounds row. Blocks visited outside it need the mask. Rows
  past seqlen_q are never stored, so they are not considered;
* runs (`block_runs`): the visited blocks after the first, walked right to left, as a masked,
  an unmasked and a masked run, so that a kernel can give each its own loop with no run-time
  mask test.

Packed GQA (``pack`` > 1): a tile's rows are ``pack`` query heads that share one K/V head,
interleaved (tile row r is query ``r // pack`` of head ``r % pack``), so a query block spans
``tile_m / pack`` queries; the ranges are those of the queries its rows hold.
"""

from typing import NamedTuple, Optional


class BlockRange(NamedTuple):
    n_block_min: object
    n_block_max: object
    n_block_min_no_mask: object
    n_block_max_no_mask: object


def block_range(
    m_block,
    tile_m: int,
    tile_n: int,
    seqlen_q,
    seqlen_k,
    causal: bool = False,
    window_left: Optional[object] = None,
    window_right: Optional[object] = None,
    pack: int = 1,
    *,
    imin=min,
    imax=max,
) -> BlockRange:
    """K/V block range of query block `m_block` (see the module docstring).

    `causal` is window_right = 0; a window side that is None is unbounded (windows are >= 0).
    The visited range is empty (``n_block_max <= n_block_min``) when no row sees a key; the
    unmasked range lies inside it and may be empty (``min_no_mask == max_no_mask``).
    `pack`: rows per query (packed GQA; see the module docstring). Precondition:
    ``m_block * tile_m < seqlen_q * pack``.
    """
    if causal:
        window_right = 0
    offset = seqlen_k - seqlen_q
    row_first = m_block * tile_m // pack
    row_last = (imin(m_block * tile_m + tile_m, seqlen_q * pack) - 1) // pack
    n_blocks = (seqlen_k + tile_n - 1) // tile_n
    # Row i sees keys [lo(i), hi(i)]; both ends grow with i. Unbounded sides are clamped to
    # the key range straight away.
    lo_first = 0 if window_left is None else row_first + offset - window_left
    lo_last = 0 if window_left is None else row_last + offset - window_left
    hi_first = seqlen_k - 1 if window_right is None else row_first + offset + window_right
    hi_last = seqlen_k - 1 if window_right is None else row_last + offset + window_right

    key_first = imax(lo_first, 0)
    key_end = imin(hi_last + 1, seqlen_k)
    n_min = imin(key_first // tile_n, n_blocks)
    # lo(i) <= i + offset <= seqlen_k - 1 for non-negative windows, so the range is empty
    # only when hi(row_last) < 0.
    n_max = (imax(key_end, 0) + tile_n - 1) // tile_n

    # Unmasked: keys within [lo_last, hi_first] (seen by every row) and all < seqlen_k.
    nm_min = (imax(lo_last, 0) + tile_n - 1) // tile_n
    nm_max = imin(imax(hi_first + 1, 0) // tile_n, seqlen_k // tile_n)
    n_min_no_mask = imin(imax(nm_min, n_min), n_max)
    n_max_no_mask = imax(imin(nm_max, n_max), n_min_no_mask)
    return BlockRange(n_min, n_max, n_min_no_mask, n_max_no_mask)


class BlockRuns(NamedTuple):
    """The visited blocks after the first (``n_block_max - 1``, which a kernel visits first
    and may always mask), split into three runs that a right-to-left walk meets in turn:
    ``[unmasked_end, end)`` masked (the right side of a window), ``[unmasked_begin,
    unmasked_end)`` unmasked, ``[n_block_min, unmasked_begin)`` masked (the left side). Any
    run may be empty; without a window both masked runs are."""
    end: object
    unmasked_end: object
    unmasked_begin: object


def block_runs(rng: BlockRange, *, imin=min) -> BlockRuns:
    """`BlockRuns` of a non-empty visited range (`imin` as in `block_range`)."""
    end = rng.n_block_max - 1
    return BlockRuns(end, imin(rng.n_block_max_no_mask, end), imin(rng.n_block_min_no_mask, end))


def needs_mask(n_block, rng: BlockRange):
    """Whether a visited block is outside the unmasked range (works for ints and DSL Int32)."""
    return (n_block >= rng.n_block_max_no_mask) | (n_block < rng.n_block_min_no_mask)


def m_block_range(
    n_block,
    tile_m: int,
    tile_n: int,
    seqlen_q,
    seqlen_k,
    causal: bool = False,
    window_left: Optional[object] = None,
    window_right: Optional[object] = None,
    *,
    imin=min,
    imax=max,
):
    """Query blocks ``[m_block_min, m_block_max)`` that see some key of K/V block `n_block`.

    The backward's outer loop runs over K/V blocks and visits these query blocks. Key j is
    visible to rows ``j - off - right <= i <= j - off + left``; the range is tight and empty
    (``max <= min``) when no row sees the block. Precondition: ``n_block * tile_n < seqlen_k``.
    """
    if causal:
        window_right = 0
    offset = seqlen_k - seqlen_q
    key_first = n_block * tile_n
    key_last = imin(key_first + tile_n, seqlen_k) - 1
    m_blocks = (seqlen_q + tile_m - 1) // tile_m
    row_first = 0 if window_right is None else imax(key_first - offset - window_right, 0)
    row_end = seqlen_q if window_left is None else imax(
        imin(key_last - offset + window_left + 1, seqlen_q), 0)
    m_min = imin(row_first // tile_m, m_blocks)
    m_max = (row_end + tile_m - 1) // tile_m
    return m_min, m_max


def split_range(rng: BlockRange, split, num_splits, blocks_per_split=0, *, imin=min,
                imax=max) -> BlockRange:
    """The part of a query block's visited range that split `split` of `num_splits` visits
    (split-KV: each split reduces its own keys, `flash_cute.blocks.lse_merge` merges them).

    ``blocks_per_split`` 0: the visited blocks are cut into `num_splits` runs of
    ``ceil(visited / num_splits)`` blocks, from n_block_min. > 0 (from FA4's
    ``seqlen_k_per_split``): split s covers the absolute blocks ``[s * bps, (s + 1) * bps)``,
    so where a key's split boundaries lie depends on nothing but the key index (bitwise
    reproducible whatever the batch or the split count). A split past the visited blocks gets
    an empty range; the unmasked range is clamped into the split's. Branch-free (a run-time
    `blocks_per_split`), with the operand rules of `block_range`.
    """
    fixed = imin(blocks_per_split, 1)
    even = (imax(rng.n_block_max - rng.n_block_min, 0) + num_splits - 1) // num_splits
    per_split = fixed * blocks_per_split + (1 - fixed) * even
    base = (1 - fixed) * rng.n_block_min
    lo = imin(imax(base + split * per_split, rng.n_block_min), rng.n_block_max)
    hi = imax(imin(base + (split + 1) * per_split, rng.n_block_max), lo)
    nm_lo = imin(imax(rng.n_block_min_no_mask, lo), hi)
    nm_hi = imax(imin(rng.n_block_max_no_mask, hi), nm_lo)
    return BlockRange(lo, hi, nm_lo, nm_hi)


def narrow(rng: BlockRange, start, end, full_start=None, full_end=None, *, imin=min,
           imax=max) -> BlockRange:
    """`rng` cut to the blocks ``[start, end)`` (a block mask's non-empty tiles,
    `flash_cute.variants.block_mask.kernel_tiles`), the unmasked range clamped into it as
    `split_range` does, and, given a run ``[full_start, full_end)`` of the mask's full tiles,
    into that run too: blocks outside the unmasked range then take the mask's state, those
    inside neither its state nor its rule. Branch-free, with the operand rules of
    `block_range`."""
    lo, hi = narrow_pair(rng.n_block_min, rng.n_block_max, start, end, imin=imin, imax=imax)
    nm_lo, nm_hi = rng.n_block_min_no_mask, rng.n_block_max_no_mask
    if full_start is not None:
        nm_lo, nm_hi = imax(nm_lo, full_start), imin(nm_hi, full_end)
    nm_lo = imin(imax(nm_lo, lo), hi)
    nm_hi = imax(imin(nm_hi, hi), nm_lo)
    return BlockRange(lo, hi, nm_lo, nm_hi)


def narrow_pair(lo, hi, start, end, *, imin=min, imax=max) -> tuple:
    """``[lo, hi)`` cut to ``[start, end)``, empty (lo' == hi') where they do not meet (the
    backward's query-block range under a block mask; `narrow`)."""
    new_lo = imin(imax(lo, start), hi)
    return new_lo, imax(imin(hi, end), new_lo)


def tiles_nest(block_size: tuple, tile_m: int, tile_n: int, pack: int = 1) -> bool:
    """Whether every (tile_m, tile_n) kernel tile lies inside one block of a block mask of
    `block_size` (rows, cols), so that a tile's state is its elements' (`block_mask.reblock`).
    Packed GQA (`pack` heads a tile, a mask the heads share): a tile's rows are tile_m / pack
    queries."""
    rows, cols = block_size
    return rows % (tile_m // pack) == 0 and cols % tile_n == 0
