"""Result records: one flat dict per (cell, provider) (`make_record`), and the sanity-check
tolerance that flags a WRONG result (`WRONG_TOL`, `is_wrong`). Pure Python."""

from __future__ import annotations

from dataclasses import asdict

from flash_cute.tools.bench.grid import BenchConfig
from flash_cute.tools.bench.measure import attention_flops, tflops_per_s

# A bf16 attention output is O(1); errors above this mean a wrong kernel, not rounding.
WRONG_TOL = 5e-2
# FP8 inputs (checked against the dequantized inputs' bf16 reference): P's e4m3 rounding
# alone reaches a few 1e-2 (docs/perf.md), so a wrong kernel shows above this.
FP8_WRONG_TOL = 2e-1


def make_record(
    cell: BenchConfig,
    provider: str,
    status: str,
    ms: float | None = None,
    max_abs_diff: float | None = None,
    reason: str | None = None,
    grad_rel_diff: float | None = None,
    wrong_tol: float = WRONG_TOL,
) -> dict:
    """One result: config fields + provider, status ("ok", "unavailable", "error"),
    time, TFLOP/s, sanity-check diffs (forward output; for bwd cells also the gradients,
    relative to their largest entry), WRONG flag and the reason when not ok."""
    flops = attention_flops(cell.batch, cell.nheads, cell.seqlen, cell.seqlen, cell.hdim,
                            causal=cell.causal, direction=cell.direction)
    record = asdict(cell)
    record.update(
        provider=provider,
        status=status,
        ms=ms,
        flops=flops,
        tflops=tflops_per_s(flops, ms) if ms else None,
        max_abs_diff=max_abs_diff,
        grad_rel_diff=grad_rel_diff,
        wrong=is_wrong(max_abs_diff, wrong_tol) or is_wrong(grad_rel_diff),
        reason=reason,
    )
    return record


def is_wrong(max_abs_diff: float | None, tol: float = WRONG_TOL) -> bool:
    """True when a sanity-check diff exceeds `tol`; NaN counts as wrong."""
    if max_abs_diff is None:
        return False
    return not max_abs_diff <= tol
