"""The ring's sequence layouts and its cost model (no process group needed)."""

import itertools

import pytest
import torch

from flash_cute.parallel import (
    LAYOUTS,
    causal_work,
    min_block_tokens,
    positions,
    unshard_parts,
)
from flash_cute.parallel.layouts import shard


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_the_shards_partition_the_sequence_and_unshard_inverts_shard(layout, world):
    seqlen = 2 * world * 5
    held = torch.cat([positions(seqlen, layout, world, r) for r in range(world)])
    assert sorted(held.tolist()) == list(range(seqlen))
    x = torch.randn(2, seqlen, 3, 4)
    parts = [shard(x, layout, world, r) for r in range(world)]
    assert all(p.shape == (2, seqlen // world, 3, 4) for p in parts)
    assert torch.equal(unshard_parts(parts, layout), x)


def test_the_layouts_place_tokens_as_documented():
    assert positions(8, "contiguous", 2, 1).tolist() == [4, 5, 6, 7]
    assert positions(8, "striped", 2, 1).tolist() == [1, 3, 5, 7]
    assert positions(8, "zigzag", 2, 0).tolist() == [0, 1, 6, 7]
    assert positions(8, "zigzag", 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("layout,seqlen,world,multiple", [
    ("contiguous", 10, 4, 4), ("striped", 9, 2, 2), ("zigzag", 12, 4, 8)])
def test_a_length_that_does_not_shard_names_the_multiple(layout, seqlen, world, multiple):
    with pytest.raises(ValueError, match=f"multiple of {multiple}"):
        positions(seqlen, layout, world, 0)


@pytest.mark.parametrize("world", [2, 3, 4, 8, 16])
def test_causal_work_per_rank(world):
    """Contiguous: max / min = 2w − 1 exactly (the diagonal counted half); zigzag: equal;
    striped: max − min within one local block's work (B² for B = L / w tokens, when
    B ≥ w − 1)."""
    seqlen = 2 * world * 16
    block = seqlen // world
    work = causal_work(seqlen, "contiguous", world)
    assert max(work) / min(work) == 2 * world - 1
    for layout in ("zigzag", "striped"):
        work = causal_work(seqlen, layout, world)
        assert max(work) - min(work) <= block * block, layout
    assert max(causal_work(seqlen, "zigzag", world)) == min(causal_work(seqlen, "zigzag",
                                                                        world))
    assert sum(causal_work(seqlen, "striped", world)) == seqlen * seqlen / 2


def test_min_block_tokens_is_the_documented_bound():
    """L ≥ F·H_kv·bytes / (2·H_q·BW): the H100's NVLink (450 GB/s a direction) at 700
    TFLOP/s with 8 query heads per K/V head needs about 194 tokens per shard."""
    fwd = min_block_tokens(450, 700, 64, 8)
    assert fwd == pytest.approx(700e12 * 8 * 2 / (2 * 64 * 450e9))
    assert round(fwd) == 194
    assert min_block_tokens(450, 700, 64, 8, causal=True) == pytest.approx(2 * fwd)
    assert min_block_tokens(450, 700, 64, 8, direction="bwd") > fwd
    assert min_block_tokens(50, 700, 64, 8) == pytest.approx(9 * fwd)
    with pytest.raises(ValueError, match="direction"):
        min_block_tokens(450, 700, 64, 8, direction="up")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_band_calls_cover_exactly_the_band_of_every_ring_step(layout, world):
    """`local.band_calls`: the operator windows of a ring step (after trimming) mark exactly
    the (query, key) pairs the band leaves visible in global positions, for every pair of
    ranks, padded and packed, causal, windows of several widths and no mask; no pair twice."""
    from flash_cute.parallel.local import Spec, band_calls
    from flash_cute.parallel.ring import Shards

    bands = [(None, None), (None, 0), (0, 0), (3, 0), (2, 5), (None, 4), (7, None)]
    for shards in (Shards(layout, world, 8 * world),
                   Shards(layout, world, cu_seqlens=[0, 2 * world, 8 * world, 12 * world])):
        for left, right in bands:
            spec = Spec(1.0, left, right)
            for r, s in itertools.product(range(world), repeat=2):
                qr, kr = shards.rows(r), shards.rows(s)
                diff = kr.pos[None, :] - qr.pos[:, None]
                want = torch.ones(diff.shape, dtype=torch.bool)
                if left is not None:
                    want &= diff >= -left
                if right is not None:
                    want &= diff <= right
                if qr.doc is not None:
                    want &= qr.doc[:, None] == kr.doc[None, :]
                got = torch.zeros(diff.shape, dtype=torch.int64)
                for c in band_calls(qr, kr, spec):
                    n, m = c.q1 - c.q0, c.k1 - c.k0
                    i = torch.arange(n)[:, None]
                    j = torch.arange(m)[None, :]
                    window = torch.ones(n, m, dtype=torch.bool)
                    if c.left is not None:
                        window &= j >= i + m - n - c.left
                    if c.right is not None:
                        window &= j <= i + m - n + c.right
                    got[c.q0:c.q1, c.k0:c.k1] += window.long()
                assert got.max() <= 1, (layout, world, left, right, r, s)
                assert torch.equal(got.bool(), want), (layout, world, left, right, r, s)


def _runs_row_by_row(pos, doc):
    """The greedy walk `local.runs_of` makes, one row at a time (the reference)."""
    from flash_cute.parallel.local import Run

    values = pos.tolist()
    docs = [-1] * len(values) if doc is None else doc.tolist()
    runs, start = [], 0
    while start < len(values):
        end = start + 1
        stride = values[end] - values[start] if end < len(values) and docs[end] == docs[start] \
            else 1
        while end < len(values) and docs[end] == docs[start] and \
                values[end] - values[end - 1] == stride:
            end += 1
        runs.append(Run(start, end - start, values[start], stride, docs[start]))
        start = end
    return runs


def test_runs_of_walks_the_rows_as_the_row_by_row_greedy_walk_does():
    """On the layouts' positions (padded and packed) and on random rows (repeated steps,
    documents changing anywhere, single rows): the same runs."""
    import random

    from flash_cute.parallel.local import Rows, runs_of

    rng = random.Random(3)
    cases = []
    for layout in ("contiguous", "striped", "zigzag"):
        for world in (1, 2, 3, 4):
            for rank in range(world):
                cases.append((positions(96 * world, layout, world, rank), None))
    for _ in range(300):
        n = rng.randint(0, 40)
        steps = [rng.choice([1, 1, 1, 2, 3, -1, 0, 5]) for _ in range(n)]
        pos = torch.tensor([sum(steps[:i]) for i in range(n)], dtype=torch.int64)
        doc = None
        if rng.random() < 0.5:
            doc = torch.tensor(sorted(rng.choice([0, 1, 2]) for _ in range(n)),
                               dtype=torch.int64)
        cases.append((pos, doc))
    for pos, doc in cases:
        assert runs_of(Rows(pos, doc)) == _runs_row_by_row(pos, doc), (pos, doc)
