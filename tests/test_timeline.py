"""The timeline reader and renderer on a synthetic trace whose overlaps are known
(`flash_cute.tools.timeline`); the instrumented kernels are checked in tests/test_inspect.py."""

from flash_cute.contract.timeline import EVENT, SLOTS
from flash_cute.tools import timeline


def _warp(*records):
    rows = [[EVENT[e], b, t] for e, b, t in records]
    return rows + [[-1, -1, 0]] * (SLOTS - len(rows))


def _trace():
    """One CTA: warp 0 the producer, warps 4 and 8 two consumers (ping-pong).

    A load's latency runs from its issue to its first use (the end of the first wait for
    it: only a consumer sees it land). Block 0's load is issued at t=100, first used at 200;
    warp 4 waits for it from 150 to 200 (half exposed); warp 8 waits from 190 to 200 (inside
    warp 4's wait). Block 1's is issued at 120 and first used at 500 with no wait: hidden.
    Warp 4's softmax runs 300..400 while warp 8's QK GEMM runs 350..450: half covered.
    Warp 8's softmax runs 500..600 while warp 4's PV GEMM runs 400..500: not covered."""
    producer = _warp(("load_issued", 0, 100), ("load_issued", 1, 120))
    w4 = _warp(("wait_start", 0, 150), ("wait_end", 0, 200), ("qk_issued", 0, 200),
               ("qk_done", 0, 300), ("softmax_start", 0, 300), ("softmax_end", 0, 400),
               ("pv_issued", 0, 400), ("pv_done", 0, 500), ("wait_start", 1, 500),
               ("wait_end", 1, 500))
    w8 = _warp(("wait_start", 0, 190), ("wait_end", 0, 200), ("qk_issued", 0, 350),
               ("qk_done", 0, 450), ("softmax_start", 0, 500), ("softmax_end", 0, 600),
               ("epilogue_start", -1, 600), ("epilogue_end", -1, 650))
    idle = _warp()
    return [[producer, idle, idle, idle, w4, idle, idle, idle, w8]]


def test_the_reader_finds_every_phase_and_the_overlaps_it_was_built_with():
    trace = _trace()
    spans = timeline.intervals(trace)
    assert sorted((w, phase, t0, t1) for _, w, _, phase, _, t0, t1 in spans) == sorted([
        (4, "waiting", 150, 200), (4, "scores GEMM", 200, 300), (4, "softmax", 300, 400),
        (4, "output GEMM", 400, 500), (4, "waiting", 500, 500),
        (8, "waiting", 190, 200), (8, "scores GEMM", 350, 450), (8, "softmax", 500, 600),
        (8, "epilogue", 600, 650)])
    assert timeline.load_latencies(trace) == {(0, 0): (100, 200), (0, 1): (120, 500)}
    numbers = timeline.overlap(trace)
    # Softmax: 50 of warp 4's 100 covered by warp 8's GEMM, 0 of warp 8's 100 (warp 4's PV
    # ends at 500 as warp 8's softmax starts): 50 / 200.
    assert numbers["tensor_core_during_softmax"] == 50 / 200
    # Load 0: latency 100, waited 150..200 (50); load 1: latency 380 (landing is the first
    # wait's end, 500), waited 0: hidden = 1 - 50 / 480.
    assert numbers["load_latency_hidden"] == 1 - 50 / 480


def test_the_gantt_chart_is_drawn(tmp_path):
    path = tmp_path / "gantt.png"
    roles = {0: "producer", 4: "consumer 1", 8: "consumer 2"}
    assert timeline.render(_trace(), path, roles, "synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
