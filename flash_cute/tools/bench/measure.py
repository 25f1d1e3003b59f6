"""Measuring: the FLOP formula and TFLOP/s, the timers (`make_timer`: triton's do_bench) and
the interleaved rounds the ablation scripts in bench/ time their A/Bs with (`interleaved_times`,
`spread_pct`, `ablation_rows`). Nothing here imports torch or triton at import time."""

from __future__ import annotations

from typing import Callable, Sequence

from flash_cute.tools.bench.grid import DIRECTIONS

# -------------------------------------------------------------------------- flops

def attention_flops(
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    hdim: int,
    hdim_v: int | None = None,
    causal: bool = False,
    direction: str = "fwd",
) -> float:
    """Nominal FLOPs of one attention pass, the convention of the FlashAttention papers.

    Forward: two matmuls (QK^T and PV) of 2·sq·sk·d each, i.e. 2·b·h·sq·sk·(d + d_v),
    which is 4·b·h·sq·sk·d when d_v == d. Causal halves it; this standard halving is
    applied even when sq != sk (then it is only an approximation of the unmasked work).
    Backward counts 2.5x the forward (five matmuls instead of two).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    hdim_v = hdim if hdim_v is None else hdim_v
    flops = 2.0 * batch * nheads * seqlen_q * seqlen_k * (hdim + hdim_v)
    if causal:
        flops /= 2
    if direction == "bwd":
        flops *= 2.5
    return flops


def tflops_per_s(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s of `flops` done in `ms` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------- timers

def make_timer(warmup: int, rep: int) -> Callable[[Callable], float]:
    """triton's do_bench (CUDA events, L2 flush between runs), median of the runs in ms."""
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def interleaved_times(fns: dict, rounds: int, timer: Callable[[Callable], float]) -> dict:
    """{name: (median, min, max)} of `timer(fn)` (ms) over `rounds` rounds that each time
    every callable once, in turn: a slow drift of the clocks or the host then reaches every
    entry alike instead of whichever ran last, and min/max show what one round can move
    (the ablation scripts in bench/ print it next to each A/B)."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timer(fn))
    return {name: _median_min_max(t) for name, t in times.items()}


def spread_pct(stats: tuple) -> str:
    """(median, min, max) as the spread of the rounds, in % of the median."""
    median, lo, hi = stats
    return f"{100 * (hi - lo) / median:.1f}%"


def ablation_rows(cell: tuple, fns: dict, errs: dict, flops: float, rounds: int,
                  timer: Callable[[Callable], float]) -> list:
    """One cell of an ablation script (bench/): each entry of `fns` (None: skipped) timed in
    interleaved rounds, as rows (*cell, name, TFLOP/s of the median, spread, error note),
    printed as they come."""
    stats = interleaved_times({n: f for n, f in fns.items() if f is not None}, rounds, timer)
    rows = []
    for name, st in stats.items():
        rows.append((*cell, name, flops / st[0] / 1e9, spread_pct(st), errs.get(name, "")))
        print(rows[-1], flush=True)
    return rows


def _median_min_max(times: Sequence[float]) -> tuple:
    t = sorted(times)
    return t[len(t) // 2], t[0], t[-1]
