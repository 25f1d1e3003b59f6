"""CPU tests of flash_cute.contract.tile_order: the tile numbering every forward kernel walks."""

import random

import pytest

from flash_cute.blocks.work_loop import num_sms
from flash_cute.contract.block_range import block_range
from flash_cute.contract.tile_order import (
    DEFAULT_NUM_SMS,
    L2_KV_BYTES,
    TileOrder,
    floor_pow2,
    launch_grid,
    pairs_per_section,
)
from flash_cute.reference.block_models import schedule_makespan, tile_order


class Runtime:
    """An integer that, like a DSL Int32, cannot steer a Python branch: the formulas must
    use arithmetic and imin/imax only."""

    def __init__(self, v):
        self.v = v

    def __bool__(self):
        raise TypeError("a run-time value in a Python branch")


def _binary(name):
    def op(self, other):
        return Runtime(getattr(self.v, name)(getattr(other, "v", other)))
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__floordiv__", "__rfloordiv__", "__mod__", "__or__", "__rshift__"):
    setattr(Runtime, _name, _binary(_name))


def _imin(a, b):
    return Runtime(min(getattr(a, "v", a), getattr(b, "v", b)))


def _imax(a, b):
    return Runtime(max(getattr(a, "v", a), getattr(b, "v", b)))


def _shapes(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        yield (rng.randint(1, 13), rng.randint(1, 9), rng.randint(1, 5),
               1 << rng.randint(0, 4), rng.randint(1, 50))


def _grid(order, persistent, sms):
    return launch_grid(order.num_tiles, persistent, sms)


@pytest.mark.parametrize("lpt", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_numbers_cover_every_tile_once(lpt, persistent):
    for m_blocks, heads, batches, section, sms in _shapes(400, seed=lpt + 2 * persistent):
        order = TileOrder(m_blocks, heads, batches, section, lpt, persistent)
        grid = _grid(order, persistent, sms)
        coords = [order.coords(t, grid) for t in range(order.num_numbers(grid))]
        tiles = [c for c in coords if c[0] < m_blocks]
        assert sorted(tiles) == sorted((m, h, b) for m in range(m_blocks)
                                       for h in range(heads) for b in range(batches))
        # Empty numbers (folded order only) lie past every sequence, with valid head/batch.
        assert all(c == (m_blocks, 0, 0) for c in coords if c[0] >= m_blocks)
        if not (lpt and persistent):
            assert len(coords) == order.num_tiles


@pytest.mark.parametrize("lpt", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_formula_takes_run_time_values(lpt, persistent):
    """The kernel evaluates the same formula on Int32: no Python branch on a value."""
    for m_blocks, heads, batches, section, sms in _shapes(40, seed=7):
        order = TileOrder(m_blocks, heads, batches, section, lpt, persistent)
        grid = _grid(order, persistent, sms)
        n = order.num_numbers(grid)
        dyn = TileOrder(Runtime(m_blocks), Runtime(heads), Runtime(batches), Runtime(section),
                        lpt, persistent)
        assert dyn.num_numbers(Runtime(grid), imin=_imin, imax=_imax).v == n
        for t in range(n):
            got = dyn.coords(Runtime(t), Runtime(grid), imin=_imin, imax=_imax)
            assert tuple(x.v for x in got) == order.coords(t, grid)
    assert pairs_per_section(Runtime(4096), 512, imax=_imax).v == pairs_per_section(4096, 512)


def test_plain_order_has_m_block_fastest():
    order = TileOrder(3, 2, 2, 1, lpt=False)
    assert [order.coords(t) for t in range(7)] == [
        (0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 0), (1, 1, 0), (2, 1, 0), (0, 0, 1)]


def _work(m_block, tile_m, tile_n, seqlen_q, seqlen_k, **kw):
    rng = block_range(m_block, tile_m, tile_n, seqlen_q, seqlen_k, **kw)
    return max(rng.n_block_max - rng.n_block_min, 0)


@pytest.mark.parametrize("seqlen_q,seqlen_k,kw", [
    (1000, 1000, {"causal": True}), (700, 1900, {"causal": True}),
    (1900, 700, {"causal": True}), (1000, 1000, {"causal": True, "window_left": 300})])
def test_lpt_is_heaviest_first_within_each_section(seqlen_q, seqlen_k, kw):
    """Causal work grows with m_block. (A window right of the diagonal gets the same order,
    as a heuristic: its tiles are near-equal but for the clipped ones at either end.)"""
    tile_m, tile_n, heads, batches = 128, 128, 6, 3
    m_blocks = -(-seqlen_q // tile_m)
    for section in (1, 2, 4, 8, 32):
        order = tile_order(m_blocks, heads, batches, lpt=True, section=section)
        pairs_seen, work = [], []
        for m, h, b in order:
            work.append(_work(m, tile_m, tile_n, seqlen_q, seqlen_k, **kw))
            pairs_seen.append(b * heads + h)
        per_section = section * m_blocks
        for start in range(0, len(order), per_section):
            chunk = work[start:start + per_section]
            assert chunk == sorted(chunk, reverse=True)
            # A section holds `section` pairs (fewer in the last), each all its m_blocks.
            pairs = set(pairs_seen[start:start + per_section])
            assert len(pairs) == min(section, heads * batches - start // m_blocks)


@pytest.mark.parametrize("kv_bytes_per_key", [2 * 64 * 2, 2 * 128 * 2, 2 * 256 * 2, 320 * 2])
def test_sections_fit_half_the_l2(kv_bytes_per_key):
    for seqlen_k in [1, 100, 1000, 4096, 8192, 30000, 131072, 1 << 20, (1 << 31) - 1]:
        pairs = pairs_per_section(seqlen_k, kv_bytes_per_key)
        assert pairs >= 1 and pairs & (pairs - 1) == 0
        per_pair = seqlen_k * kv_bytes_per_key
        if pairs > 1 or per_pair <= L2_KV_BYTES:
            assert pairs * per_pair <= L2_KV_BYTES
            assert 2 * pairs * per_pair > L2_KV_BYTES  # the largest power of two that fits
        # The kernel's Int32 arithmetic: budget / bytes per key first, no large product.
        assert L2_KV_BYTES // kv_bytes_per_key < 2 ** 31


def test_floor_pow2():
    for n in list(range(1, 70)) + [2 ** 30, 2 ** 31 - 1]:
        p = floor_pow2(n)
        assert p & (p - 1) == 0 and p <= n < 2 * p


def test_grid_is_one_cta_per_tile_or_at_most_one_per_sm():
    assert launch_grid(1000, False, 132) == 1000
    assert launch_grid(1000, True, 132) == 132
    assert launch_grid(20, True, 132) == 20


def test_sm_count_without_a_gpu_is_the_h100_h200_one():
    assert num_sms() > 0
    assert DEFAULT_NUM_SMS == 132


def _causal_work(order, m_blocks, tile_n, seqlen):
    return [0 if m >= m_blocks else _work(m, 128, tile_n, seqlen, seqlen, causal=True)
            for m, _, _ in order]


@pytest.mark.parametrize("hdim,tile_n", [(64, 128), (128, 128), (256, 80)])
@pytest.mark.parametrize("seqlen", [512, 2048, 8192])
def test_folded_persistent_order_is_balanced(hdim, tile_n, seqlen):
    """A static round robin over the LPT order gives CTA i the i-th heaviest tile of every
    wave; the folded (heavy, light) pairs keep the makespan near the hardware's greedy one."""
    batch, heads, sms = 16384 // seqlen, 2048 // hdim, 132
    m_blocks = seqlen // 128
    section = pairs_per_section(seqlen, 2 * hdim * 2)
    lpt = _causal_work(tile_order(m_blocks, heads, batch, lpt=True, section=section),
                       m_blocks, tile_n, seqlen)
    grid = launch_grid(m_blocks * heads * batch, True, sms)
    folded = _causal_work(tile_order(m_blocks, heads, batch, lpt=True, section=section,
                                     persistent=True, grid=grid), m_blocks, tile_n, seqlen)
    ideal = sum(lpt) / sms
    greedy = schedule_makespan(lpt, sms, persistent=False)
    assert schedule_makespan(folded, sms, persistent=True) <= 1.09 * max(greedy, ideal)
    # Each CTA takes the heavy tile of a unit first.
    for t in range(len(folded) - grid):
        if (t // grid) % 2 == 0 and folded[t + grid]:
            assert folded[t] >= folded[t + grid]


def test_folded_order_falls_back_to_one_tile_per_cta():
    """With no more tiles than CTAs there is nothing to fold: one tile each, heaviest first."""
    order = TileOrder(4, 3, 1, 2, lpt=True, persistent=True)
    grid = launch_grid(order.num_tiles, True, 132)
    assert order.num_numbers(grid) == order.num_tiles == grid
    assert [order.coords(t, grid) for t in range(grid)] == [
        order._replace(persistent=False).coords(t) for t in range(grid)]


def test_schedule_makespan():
    assert schedule_makespan([4, 3, 3, 2], 2, persistent=False) == 6
    assert schedule_makespan([4, 3, 3, 2], 2, persistent=True) == 7
    assert schedule_makespan([5, 1], 4, persistent=True) == 5
