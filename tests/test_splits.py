"""Split-KV host logic: `block_range.split_range` cuts a visited range into disjoint, ordered
parts (even or fixed-size), and `splits.plan_splits` / `num_splits_heuristic` pick counts
from FA4's arguments and the cost model."""

import random
from types import SimpleNamespace

import pytest

from flash_cute.contract.block_range import BlockRange, block_range, split_range
from flash_cute.runtime.splits import (
    MAX_SPLITS,
    Splits,
    num_splits_heuristic,
    plan_splits,
    visited_blocks,
)


def _random_range(rnd):
    sq, sk = rnd.randint(1, 300), rnd.randint(1, 5000)
    left = rnd.choice([None, rnd.randint(0, 800)])
    return block_range(0, 64, 128, sq, sk, causal=rnd.random() < 0.5, window_left=left)


@pytest.mark.parametrize("fixed", [0, 1, 3, 8])
def test_splits_partition_the_visited_blocks(fixed):
    """Whatever the range and the count, the splits' blocks are the visited blocks, each in
    exactly one split, in split order; each unmasked range lies in its split and together
    they are the unmasked blocks."""
    rnd = random.Random(fixed)
    for _ in range(300):
        rng = _random_range(rnd)
        count = rnd.randint(1, 40)
        if fixed:
            count = max(count, -(-rng.n_block_max // fixed))
        parts = [split_range(rng, s, count, fixed) for s in range(count)]
        blocks = [b for p in parts for b in range(p.n_block_min, p.n_block_max)]
        assert blocks == list(range(rng.n_block_min, rng.n_block_max)), (rng, count)
        unmasked = [b for p in parts for b in range(p.n_block_min_no_mask, p.n_block_max_no_mask)]
        assert unmasked == list(range(rng.n_block_min_no_mask, rng.n_block_max_no_mask))
        for p in parts:
            assert p.n_block_min <= p.n_block_min_no_mask <= p.n_block_max_no_mask <= max(
                p.n_block_max, p.n_block_min)
        if fixed:   # absolute boundaries: split s starts at block s * fixed (or is empty)
            for s, p in enumerate(parts):
                if p.n_block_max > p.n_block_min:
                    assert p.n_block_min == max(s * fixed, rng.n_block_min)
                    assert p.n_block_max == min((s + 1) * fixed, rng.n_block_max)


def test_an_empty_range_gives_empty_splits():
    rng = BlockRange(5, 5, 5, 5)
    assert all(split_range(rng, s, 4).n_block_max <= split_range(rng, s, 4).n_block_min
               for s in range(4))


def test_heuristic_fills_the_sms_only_where_tiles_are_few():
    # b 1, 8 K/V heads packed, 64 blocks: 16 splits make 128 CTAs, one wave of 4 blocks.
    assert num_splits_heuristic(8, 64, 132) == 16
    # Enough tiles for the SMs: no split.
    assert num_splits_heuristic(256, 64, 132) == 1
    assert num_splits_heuristic(132, 1024, 132) == 1
    # 8 x 32k: two splits of 128 blocks fill 128 of 132 SMs.
    assert num_splits_heuristic(64, 256, 132) == 2
    # One block per tile, or no tiles: nothing to split.
    assert num_splits_heuristic(4, 1, 132) == 1 and num_splits_heuristic(0, 100, 132) == 1
    assert 1 <= num_splits_heuristic(1, 10 ** 6, 132) <= MAX_SPLITS


def _problem(**kw):
    base = dict(batch=1, max_seqlen_q=1, max_seqlen_k=8192, nheads=32, hdim=128, causal=False,
                window_left=None, window_right=None, num_splits=0, seqlen_k_per_split=None)
    return SimpleNamespace(**{**base, **kw})


def test_plan_splits_follows_fa4s_arguments():
    assert plan_splits(_problem(num_splits=1), 128, 128, 4, 132) is None
    assert plan_splits(_problem(), 128, 128, 4, 132) == Splits(16, 0)
    assert plan_splits(_problem(num_splits=5), 128, 128, 4, 132) == Splits(5, 0)
    # A prompt fills the GPU with query tiles: the heuristic leaves it whole.
    assert plan_splits(_problem(batch=8, max_seqlen_q=4096), 128, 128, 1, 132) is None
    # Fixed split lengths: at least as many splits as the longest sequence needs.
    assert plan_splits(_problem(seqlen_k_per_split=4096), 128, 128, 4, 132) == Splits(16, 32)
    assert plan_splits(_problem(batch=64, seqlen_k_per_split=2048), 128, 128, 4, 132) \
        == Splits(4, 16)
    with pytest.raises(ValueError, match="num_splits >= 4"):
        plan_splits(_problem(num_splits=3, seqlen_k_per_split=2048), 128, 128, 4, 132)
    with pytest.raises(ValueError, match="tile_n=128"):
        plan_splits(_problem(seqlen_k_per_split=1000), 128, 128, 4, 132)


def test_visited_blocks_of_a_window():
    assert visited_blocks(_problem(), 128, 128, 4) == 64
    assert visited_blocks(_problem(window_left=1000, window_right=0), 128, 128, 4) == 8
