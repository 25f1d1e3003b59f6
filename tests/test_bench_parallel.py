"""`bench parallel`'s harness on the CPU: its local-work split against the layouts' own
positions, its overlap arithmetic, the refusal outside torchrun, and (slow) a torchrun of two
gloo ranks through the correctness check and the throughput cells."""

import json
import os
import subprocess
import sys

import pytest

from flash_cute.parallel import causal_work, positions
from flash_cute.tools import bench_parallel


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_the_local_work_is_each_ranks_zigzag_queries_against_the_keys_before_them(world):
    tokens = 1024 * world
    work = causal_work(tokens, "zigzag", world)
    for rank in range(world):
        calls = bench_parallel.local_work("ring", tokens, world, rank)
        rows = [p for first, n, _, _ in calls for p in range(first, first + n)]
        assert rows == positions(tokens, "zigzag", world, rank).tolist()
        # Bottom-right causal: each call's queries end where its keys end.
        assert all(first + n == keys for first, n, keys, _ in calls)
        # The score elements the calls compute are the rank's causal work.
        assert sum(n * keys - n * (n - 1) / 2 - n / 2 for _, n, keys, _ in calls) \
            == pytest.approx(work[rank])
    assert bench_parallel.local_work("ulysses", tokens, world, 0) == [(0, tokens, tokens,
                                                                       world)]


def test_the_overlap_share_is_the_covered_part_of_the_transfers():
    share = bench_parallel.overlap_share
    assert share([(0, 10)], [(0, 10)]) == 1.0
    assert share([(0, 10)], []) == 0.0
    assert share([(0, 10), (20, 30)], [(5, 25)]) == pytest.approx(0.5)
    # Overlapping compute intervals count once.
    assert share([(0, 10)], [(0, 6), (4, 8)]) == pytest.approx(0.8)
    assert share([], [(0, 1)]) == 1.0


def test_outside_torchrun_it_says_how_to_launch(monkeypatch, capsys):
    from flash_cute.__main__ import _parser

    monkeypatch.delenv("RANK", raising=False)
    assert bench_parallel.run(_parser().parse_args(["bench", "parallel"])) == 2
    assert "torchrun" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("what", [["--check"], ["--tokens", "512", "--reps", "2", "--overlap"]])
def test_two_gloo_ranks_run_the_check_and_the_cells(what, tmp_path):
    """torchrun, two CPU ranks, float64 local attention: every check passes and every cell
    has a time, in the JSON rank 0 writes."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "-m", "flash_cute", "bench", "parallel", "--device", "cpu",
           "--out", str(tmp_path), *what]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    records = json.loads((tmp_path / "parallel.json").read_text())["records"]
    if "--check" in what:
        assert [r["check"] for r in records] == ["ring contiguous", "ring striped",
                                                 "ring zigzag", "ulysses zigzag"]
        assert all(r["ok"] and r["world"] == 2 for r in records)
    else:
        cells = [r for r in records if "kind" in r]
        assert {(r["kind"], r["direction"]) for r in cells} == {
            (k, d) for k in ("ring", "ulysses") for d in ("fwd", "bwd")}
        assert all(r["ms"] > 0 and "error" not in r for r in cells)
        assert any("overlap" in r for r in records)
