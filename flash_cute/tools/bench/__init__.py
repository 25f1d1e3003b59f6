"""`python -m flash_cute bench`: attention throughput against peer implementations.

One module per role, so the CPU-only test suite can cover most of it:

* pure parts (no GPU, no triton, no matplotlib at import time): `grid` (the benchmark grid
  and its filters), `measure` (the FLOP formula, TFLOP/s, the timers and the interleaved
  rounds of the A/B scripts), `records` (result records, the WRONG tolerance) and `report`
  (the text table, the JSON report, the plot of a results list, the environment header, the
  A/B tables);
* device parts: `providers` (our kernels, flash-attn-4, two SDPA backends, SDPA with our
  kernels), `cells` (input creation, the per-cell sanity check and timing) and `cli` (the
  options and `run()`). They take the device and the timer as arguments, so they also run
  (slowly, with a fake timer) on the CPU.

A result is a flat dict (see `records.make_record`); one is produced per (cell, provider).

This package re-exports the names the rest of the repository reads as `bench.X` (the CLI,
the tests, the scripts in bench/); code of the package and new code import a name from the
module that defines it.
"""

from flash_cute.tools.bench.cells import (
                                          make_inputs,
                                          math_reference,
                                          max_abs_diff,
                                          reference_output,
                                          run_cell,
)
from flash_cute.tools.bench.cli import _run_on_gpu as _run_on_gpu  # the tests drive it on the CPU
from flash_cute.tools.bench.cli import add_arguments, run, selected_configs
from flash_cute.tools.bench.grid import MODEL_DIM, SIZES, BenchConfig, filter_grid, make_grid
from flash_cute.tools.bench.measure import (
                                          ablation_rows,
                                          attention_flops,
                                          interleaved_times,
                                          make_timer,
                                          spread_pct,
                                          tflops_per_s,
)
from flash_cute.tools.bench.providers import (
                                          PROVIDERS,
                                          Provider,
                                          Unavailable,
                                          classify_error,
                                          load_provider,
)
from flash_cute.tools.bench.records import is_wrong, make_record
from flash_cute.tools.bench.report import (
                                          RATIO_COLUMN,
                                          ablation_table,
                                          build_report,
                                          environment_info,
                                          flash_cute_ratio,
                                          format_table,
                                          markdown_table,
                                          plot_results,
                                          tree_ab_table,
                                          write_json,
)

__all__ = [
    "BenchConfig", "MODEL_DIM", "PROVIDERS", "Provider", "RATIO_COLUMN", "SIZES", "Unavailable",
    "ablation_rows", "ablation_table", "add_arguments", "attention_flops", "build_report",
    "classify_error", "environment_info", "filter_grid", "flash_cute_ratio", "format_table",
    "interleaved_times", "is_wrong", "load_provider", "make_grid", "make_inputs", "make_record",
    "make_timer", "markdown_table", "math_reference", "max_abs_diff", "plot_results",
    "reference_output", "run", "run_cell", "selected_configs", "spread_pct", "tflops_per_s",
    "tree_ab_table", "write_json",
]
