"""Tile scheduler: which (query tile, head, batch) a CTA works on, and in which order.

A forward kernel's work is ``num_m_blocks x heads x batch`` query tiles. They get numbers 0, 1,
... (`TileOrder.coords` maps a number to coordinates) and CTA i of a grid of G takes numbers
i, i + G, i + 2 G, ... The formulas use only ``+ - * //`` on non-negative operands and
`imin`/`imax`, so one formula serves the CPU model (`flash_cute.reference.block_models.tile_order`),
the host and every arch's kernel (``imin=cutlass.min``), like `flash_cute.contract.block_range`.
Nothing here is arch-specific, and this module imports no CuTe DSL.

Order:

* Without a causal mask or right window every tile has the same work: m_block fastest, so the
  CTAs in flight share one head's K/V.
* Causal or a right window, one CTA per tile (G = tiles): longest processing time first (FA3
  and FA4's "LPT with L2 swizzle"). A tile's work grows with m_block, so the heaviest start
  first and the light ones fill the tail: the hardware starts CTAs about in index order and
  gives each next one to whichever SM frees first, which makes this LPT scheduling. The
  (head, batch) pairs, batch-major, are cut into sections of `section` pairs whose K/V
  (seqlen_k * (hdim + hdim_v) * 2 bytes per pair) fit in half the L2 (`L2_KV_BYTES`); within
  a section m_block runs descending with the pair fastest, so the CTAs in flight read one
  section's K/V, which stays in L2, instead of streaming every head's K/V from HBM once per
  m_block.
* The same, persistent (G = min(tiles, SMs)): a static round robin over the LPT order gives CTA
  i the i-th heaviest tile of every wave, 25-80 % over the greedy makespan
  (`flash_cute.reference.block_models.schedule_makespan`, hdim 128-256). So when CTAs take more than
  one tile, the tiles are folded: unit u of a pair is its query tiles M-1-u and u (work ~ M+1 blocks
  for every u), the units run in the section order above (u ascending, pair fastest), and CTA i
  does the heavy then the light tile of units i, i + G, ... (numbers t with
  ``(t // G) % 2`` the half). Numbers past the last unit, and the light half of the middle
  unit of an odd M, are empty: they get m_block = num_m_blocks, past every sequence, and a
  kernel skips them as it skips varlen tiles past their sequence.

The SM count comes from the host (`work_loop.num_sms`). Varlen: `num_m_blocks` comes from
max_seqlen_q.
"""

from typing import NamedTuple

# H100 and H200 have 50 MB of L2; a section's K/V may take half of it, the rest holds Q, O and
# whatever K/V of the previous section is still being read.
L2_BYTES = 50 * 1024 * 1024
L2_KV_BYTES = L2_BYTES // 2
# SMs of an H100 SXM or H200, for compiling without a GPU (`work_loop.num_sms`).
DEFAULT_NUM_SMS = 132


def floor_pow2(n):
    """The largest power of two <= n, for 1 <= n < 2**31 (Python int or DSL Int32)."""
    for shift in (1, 2, 4, 8, 16):
        n = n | (n >> shift)
    return n - (n >> 1)


def pairs_per_section(seqlen_k, kv_bytes_per_key: int, *, imax=max):
    """(head, batch) pairs of one L2 section: as many as have K/V (`seqlen_k` keys of
    `kv_bytes_per_key` bytes) that fit in `L2_KV_BYTES`, rounded down to a power of two (FA4
    found that faster; it also keeps sections aligned to power-of-two head counts), >= 1.

    Divides the byte budget by the bytes per key first, so a long sequence cannot overflow
    an Int32 product."""
    return floor_pow2(imax((L2_KV_BYTES // kv_bytes_per_key) // imax(seqlen_k, 1), 1))


class TileOrder(NamedTuple):
    """The tile numbering of one launch (see the module docstring). `lpt` and `persistent`
    are compile-time; the rest may be run-time values."""
    num_m_blocks: object
    num_heads: object
    num_batches: object
    section: object
    lpt: bool
    persistent: bool = False

    @property
    def num_tiles(self):
        return self.num_m_blocks * self.num_heads * self.num_batches

    def _folds(self) -> bool:
        return self.lpt and self.persistent

    def folding(self, grid, *, imin=min, imax=max):
        """1 when the tiles are folded (persistent LPT, more tiles than CTAs), else 0."""
        return imin(imax(self.num_tiles - grid, 0), 1)

    def num_numbers(self, grid, *, imin=min, imax=max):
        """How many tile numbers the `grid` CTAs walk: the tiles, or, folded, two numbers per
        unit slot of whole waves of units."""
        if not self._folds():
            return self.num_tiles
        units = (self.num_m_blocks + 1) // 2 * self.num_heads * self.num_batches
        folded = 2 * grid * ((units + grid - 1) // grid)
        fold = self.folding(grid, imin=imin, imax=imax)
        return fold * folded + (1 - fold) * self.num_tiles

    def coords(self, t, grid=1, *, imin=min, imax=max):
        """(m_block, head, batch) of tile number `t` (0 <= t < `num_numbers(grid)`); an empty
        number has m_block = num_m_blocks."""
        if not self.lpt:
            pair = t // self.num_m_blocks
            return self._split(t - pair * self.num_m_blocks, pair)
        if not self._folds():
            m_rev, pair = self._section_coords(t, self.num_m_blocks, imin)
            return self._split(self.num_m_blocks - 1 - m_rev, pair)
        # Both orders are computed and one is kept (the choice is a run-time value); a
        # folded number may lie past the tiles, so it is clamped for the unfolded one.
        m_rev, pair = self._section_coords(imin(t, self.num_tiles - 1), self.num_m_blocks, imin)
        m_block = self.num_m_blocks - 1 - m_rev
        f_m_block, f_pair = self._folded(t, grid, imin, imax)
        fold = self.folding(grid, imin=imin, imax=imax)
        return self._split(fold * f_m_block + (1 - fold) * m_block,
                           fold * f_pair + (1 - fold) * pair)

    def _section_coords(self, n, per_pair, imin):
        """(index within its pair, pair) of item n of a sequence that runs section by section,
        `per_pair` items per pair, with the pair fastest within a section."""
        pairs = self.num_heads * self.num_batches
        first = (n // (self.section * per_pair)) * self.section
        # The last section may hold fewer pairs; it has per_pair x that many items.
        size = imin(self.section, pairs - first)
        within = n - first * per_pair
        index = within // size
        return index, first + within - index * size

    def _folded(self, t, grid, imin, imax):
        """(m_block, pair) of number t in the folded order (empty: (num_m_blocks, 0))."""
        m_blocks = self.num_m_blocks
        units_per_pair = (m_blocks + 1) // 2
        wave, slot = t // (2 * grid), t % grid
        half = (t // grid) % 2
        unit = wave * grid + slot
        units = units_per_pair * self.num_heads * self.num_batches
        u, pair = self._section_coords(imin(unit, units - 1), units_per_pair, imin)
        # u <= (m_blocks - 1) / 2, so m_blocks - 1 - 2u >= 0, and 0 only for the middle unit
        # of an odd m_blocks, whose one tile is its heavy half.
        lone = 1 - imin(m_blocks - 1 - 2 * u, 1)
        valid = imax(imin(units - unit, 1), 0) * (1 - half * lone)
        m_block = m_blocks - 1 - u - half * (m_blocks - 1 - 2 * u)
        return valid * m_block + (1 - valid) * m_blocks, valid * pair

    def _split(self, m_block, pair):
        batch = pair // self.num_heads
        return m_block, pair - batch * self.num_heads, batch


def launch_grid(num_tiles, persistent: bool, num_sms: int, *, imin=min):
    """CTAs to launch: one per tile, or for a persistent kernel at most one per SM."""
    return imin(num_tiles, num_sms) if persistent else num_tiles
