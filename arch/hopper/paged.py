"""Paged K/V for the Hopper forward: each K/V block gathered from a page table by TMA.

A paged cache holds K and V as [num_pages, page_size, heads_kv, d]; sequence b's key j lives
in page ``page_table[b, j // page_size]`` at row ``j % page_size``. A K/V block of tile_n keys
is loaded as tile_n / c boxes of c = gcd(tile_n, page_size) rows, each from its own page
(one box per block where a page holds whole blocks), all completing the stage's one
transaction barrier. A box must cover whole 128-byte swizzle atoms (8 rows), so c >= 8:
smaller pages are gathered before the kernel (`flash_cute.api.interface`).

Page indices are clamped into the table and the cache, so whatever the table holds the
TMA reads rows of the cache; keys past a sequence are masked, and V rows past it zeroed
(`HopperFwd.clear_v_tail`).
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from flash_cute.arch.sm90plus.tma import COLS_FIRST, ROWS_FIRST, permute, tma_partition
from flash_cute.blocks.dsl_state import DslState

from .config import MIN_PAGE_ROWS


def page_chunk(tile_n: int, page_size: int) -> int:
    """Rows per TMA box of a K/V block over pages of `page_size` rows."""
    chunk = math.gcd(tile_n, page_size)
    if page_size & (page_size - 1) or chunk < MIN_PAGE_ROWS:
        raise ValueError(f"paged K/V in the hopper forward needs a power-of-two page size "
                         f">= {MIN_PAGE_ROWS}, got {page_size}")
    return chunk


def paged_tma_atoms(cfg, mK: cute.Tensor, mV: cute.Tensor, sK_layout, sV_layout):
    """TMA atoms of one box of K ((chunk, hdim)) and V ((hdim_v, chunk), head dim first)
    over the whole paged caches, and their coordinate tensors as (pages, page_size, heads_kv,
    d)."""
    chunk = cfg.page_chunk
    rows_first, back_rows = ROWS_FIRST[False]
    cols_first, back_cols = COLS_FIRST[False]
    # The box is the first `chunk` rows (K) or key columns (V) of one stage of the tile.
    k_box = cute.composition(cute.slice_(sK_layout, (None, None, 0)),
                             cute.make_layout((chunk, cfg.hdim), stride=(1, cfg.tile_n)))
    v_box = cute.composition(cute.slice_(sV_layout, (None, None, 0)),
                             cute.make_layout((cfg.hdim_v, chunk)))
    op = cpasync.CopyBulkTensorTileG2SOp()
    tma_k, tK = cpasync.make_tiled_tma_atom(op, permute(mK, rows_first), k_box,
                                            (chunk, cfg.hdim))
    tma_v, tV = cpasync.make_tiled_tma_atom(op, permute(mV, cols_first), v_box,
                                            (cfg.hdim_v, chunk))
    return tma_k, permute(tK, back_rows), tma_v, permute(tV, back_cols)


class PagedBlocks(DslState):
    """The producer's loads of one tile's K/V blocks from pages (see the module docstring)."""

    def __init__(self, cfg, tma_k, tK, tma_v, tV, sK, sV, page_table: cute.Tensor,
                 batch: Int32, head_kv: Int32):
        self.cfg = cfg
        self.tma_k, self.tK, self.tma_v, self.tV = tma_k, tK, tma_v, tV
        self.sK, self.sV = sK, sV
        self.page_table, self.batch, self.head_kv = page_table, batch, head_kv

    @cute.jit
    def fetch(self, n_block: Int32, pages: cute.Tensor):
        """Into `pages` (an rmem vector, one per box): the page of each box of block
        `n_block`, clamped (a block past the table reads its last page)."""
        cfg = self.cfg
        boxes = cfg.tile_n // cfg.page_chunk
        last_page = self.page_table.shape[1] - 1
        last_cache_page = self.tK.shape[0] - 1
        for i in cutlass.range_constexpr(boxes):
            box = cutlass.max(n_block, Int32(0)) * boxes + i
            page = self.page_table[self.batch, cutlass.min(box // self.boxes_per_page,
                                                           last_page)]
            pages[i] = cutlass.min(cutlass.max(page, Int32(0)), last_cache_page)

    @property
    def boxes_per_page(self) -> int:
        return self.cfg.page_size // self.cfg.page_chunk

    def box_in_page(self, n_block, i: int):
        """Box i of block `n_block`'s index within its page."""
        box = n_block * (self.cfg.tile_n // self.cfg.page_chunk) + i
        return box - (box // self.boxes_per_page) * self.boxes_per_page

    @cute.jit
    def load_all(self, pipe_k, pipe_v, kv, rng):
        """The tile's blocks, right to left. The next block's page indices are read as soon
        as this block's TMAs are issued, so their latency hides behind the next wait for a
        free stage (one vector of them: the producer runs on 24 registers)."""
        pages = cute.make_rmem_tensor(self.cfg.tile_n // self.cfg.page_chunk, Int32)
        self.fetch(rng.n_block_max - 1, pages)
        for i in cutlass.range(rng.n_block_max - rng.n_block_min, unroll=1):
            n_block = rng.n_block_max - 1 - i
            self.load(pipe_k, pipe_v, kv, n_block, pages)
            self.fetch(n_block - 1, pages)
            kv.advance()
        return kv

    @cute.jit
    def load(self, pipe_k, pipe_v, kv, n_block: Int32, pages: cute.Tensor):
        """K[n_block] then V[n_block] into stage kv.index, box by box (`fetch`'s pages)."""
        cfg = self.cfg
        chunk = cfg.page_chunk
        pipe_k.producer_acquire(kv)
        for i in cutlass.range_constexpr(cfg.tile_n // chunk):
            page, box = pages[i], self.box_in_page(n_block, i)
            gK = cute.local_tile(self.tK[page, None, self.head_kv, None], (chunk, cfg.hdim),
                                 (None, 0))
            sK = cute.local_tile(self.sK[None, None, kv.index], (chunk, cfg.hdim), (i, 0))
            t_s, t_g = tma_partition(self.tma_k, sK, gK)
            cute.copy(self.tma_k, t_g[None, box], t_s,
                      tma_bar_ptr=pipe_k.producer_get_barrier(kv))
        pipe_v.producer_acquire(kv)
        for i in cutlass.range_constexpr(cfg.tile_n // chunk):
            page, box = pages[i], self.box_in_page(n_block, i)
            gV = cute.local_tile(permute(self.tV[page, None, self.head_kv, None], (1, 0)),
                                 (cfg.hdim_v, chunk), (0, None))
            sV = cute.local_tile(self.sV[None, None, kv.index], (cfg.hdim_v, chunk), (0, i))
            t_s, t_g = tma_partition(self.tma_v, sV, gV)
            cute.copy(self.tma_v, t_g[None, box], t_s,
                      tma_bar_ptr=pipe_v.producer_get_barrier(kv))
