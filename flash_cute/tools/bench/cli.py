"""`python -m flash_cute bench`: attention throughput against peer implementations.

The command line: the `bench` options (`add_arguments`, with those of `bench latency` and
`bench decode`), the selected cells, and `run`, the measuring loop that writes the JSON, the
table and the plot as it goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from flash_cute.tools.bench.cells import cuda_healthy, run_cell
from flash_cute.tools.bench.grid import (
    HDIMS,
    QUICK_HDIMS,
    QUICK_SIZES,
    SIZES,
    BenchConfig,
    filter_grid,
    make_grid,
)
from flash_cute.tools.bench.measure import make_timer
from flash_cute.tools.bench.providers import PROVIDERS, load_provider
from flash_cute.tools.bench.report import (
    build_report,
    environment_info,
    format_cell,
    format_header,
    format_table,
    plot_results,
    write_json,
)

ARCHS = ("auto", "ampere", "hopper", "blackwell")
DTYPES = ("bf16", "fp16", "e4m3")

CUDA_MESSAGE = "bench needs a CUDA GPU; use `python -m flash_cute inspect` on a CPU-only machine"


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _provider_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown provider(s) {unknown or text!r}; choose from {','.join(PROVIDERS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `bench` options to `parser` (the `bench` subparser of the CLI), with those of
    `bench latency` (`flash_cute.tools.bench_latency`, which `flash_cute.__main__` runs)."""
    parser.add_argument("what", nargs="?",
                        choices=("throughput", "latency", "decode", "fp8", "parallel"),
                        default="throughput",
                        help="throughput: TFLOP/s over the grid (default); latency: host time "
                             "per call of a tiny problem (flash_cute.tools.bench_latency); decode: "
                             "GB/s of KV-cache decode (flash_cute.tools.bench_decode); fp8: the "
                             "FP8 forward beside bf16 and the FP8 ceiling "
                             "(flash_cute.tools.bench_fp8); parallel: context parallelism "
                             "under torchrun (flash_cute.tools.bench_parallel)")
    parser.add_argument("--quick", action="store_true",
                        help=f"small grid: hdim {QUICK_HDIMS}, (batch, seqlen) {QUICK_SIZES}")
    parser.add_argument("--hdim", type=_int_list, default=None,
                        help="only these head dims, comma-separated (e.g. 64,128)")
    parser.add_argument("--seqlen", type=_int_list, default=None,
                        help="only these sequence lengths, comma-separated")
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both")
    parser.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both")
    parser.add_argument("--providers", type=_provider_list, default=list(PROVIDERS),
                        help=f"comma-separated subset of {','.join(PROVIDERS)}")
    parser.add_argument("--arch", choices=ARCHS, default="auto",
                        help="pipeline passed to flash_cute kernels (auto: library default)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--out", default=None,
                        help="output directory (default results/bench-<timestamp>)")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    latency = parser.add_argument_group("latency")
    latency.add_argument("--calls", type=int, default=100,
                         help="calls per timed loop (a fwd+bwd step queues ~5 kernels each: "
                              "keep calls x kernels under CUDA's ~1000 queued launches)")
    latency.add_argument("--rounds", type=int, default=7, help="rounds per provider and case")
    latency.add_argument("--cases", default="fwd,fwd_bwd", help="fwd, fwd_bwd")
    latency.add_argument("--json", default=None, help="write the records here")
    from flash_cute.tools import bench_parallel

    bench_parallel.add_arguments(parser.add_argument_group("parallel"))
    decode = parser.add_argument_group("decode")
    decode.add_argument("--pages", type=_int_list, default=None,
                        help="page sizes to run, 0 for the dense cache (default 0,16,64,256)")
    return parser


def selected_configs(args: argparse.Namespace) -> list[BenchConfig]:
    """The grid cells selected by --quick and the filters (FP8: the forward only)."""
    direction = args.direction
    if getattr(args, "dtype", "bf16") == "e4m3":
        direction = "fwd" if direction in ("fwd", "both") else "none"
    return filter_grid(make_grid(args.quick), args.hdim, args.seqlen, args.causal, direction)


def settings_of(args: argparse.Namespace) -> dict:
    """The run options recorded in the JSON."""
    return {k: getattr(args, k) for k in ("quick", "hdim", "seqlen", "causal", "direction",
                                          "providers", "arch", "dtype", "warmup", "rep")}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark. Exit code: 0 done; 1 some cell errored, was WRONG, or the run
    stopped on a CUDA error; 2 nothing to run (no CUDA, empty selection, no triton)."""
    configs = selected_configs(args)
    if not configs:
        print(f"bench: no cells match the filters (hdims {HDIMS}, seqlens "
              f"{[s for _, s in SIZES]}; --quick uses {QUICK_HDIMS} and "
              f"{[s for _, s in QUICK_SIZES]})", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(CUDA_MESSAGE, file=sys.stderr)
        return 2
    try:
        timer = make_timer(args.warmup, args.rep)
    except ImportError as exc:
        print(f"bench needs triton for do_bench: {exc}", file=sys.stderr)
        return 2
    return _run_on_gpu(args, configs, timer)


def _run_on_gpu(args: argparse.Namespace, configs: list[BenchConfig], timer,
                device: str = "cuda") -> int:
    """The measuring loop; `device` is a parameter only so tests can drive it on the CPU."""
    import torch

    out_dir = args.out or os.path.join("results", f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "bench.json")
    env = environment_info(device)
    env.update(dtype=args.dtype, arch=args.arch)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16,
             "e4m3": torch.float8_e4m3fn}[args.dtype]
    providers = [load_provider(name, args.arch) for name in args.providers]
    # The sanity-check reference is sdpa_flash even when it is not benchmarked.
    reference = next((p for p in providers if p.name == "sdpa_flash"), None)
    reference = reference or load_provider("sdpa_flash")
    torch.manual_seed(0)
    print(format_header(env), file=sys.stderr)
    results: list[dict] = []
    aborted = False
    write_json(build_report(results, env, settings_of(args)), json_path)
    try:
        for i, cell in enumerate(configs, 1):
            records = run_cell(cell, providers, dtype, timer, device, reference)
            results += records
            print(f"[{i}/{len(configs)}] {cell.label()}: " + ", ".join(
                f"{r['provider']} {format_cell(r)}" for r in records), file=sys.stderr,
                flush=True)
            write_json(build_report(results, env, settings_of(args)), json_path)
            if not cuda_healthy(device):
                print("bench: CUDA context is broken (sticky error); stopping early",
                      file=sys.stderr)
                aborted = True
                break
    except KeyboardInterrupt:
        # Ctrl-C still yields the table and plot of the cells measured so far.
        print("bench: interrupted; reporting the cells done so far", file=sys.stderr)
        aborted = True
    return _finish(results, args, env, out_dir, json_path, aborted)


def _finish(results, args, env, out_dir, json_path, aborted) -> int:
    """Print and save the table, draw the plot, print the paths; return the exit code."""
    table = format_table(results, args.providers, env)
    print(table)
    table_path = os.path.join(out_dir, "bench.md")
    with open(table_path, "w") as f:
        f.write(table + "\n")
    print(f"\njson:  {json_path}\ntable: {table_path}")
    if not args.no_plot:
        try:
            png = plot_results(results, os.path.join(out_dir, "bench.png"),
                               title=f"{env.get('gpu')} {args.dtype}")
            print(f"plot:  {png}")
        except ImportError as exc:
            print(f"plot skipped (matplotlib missing: {exc})", file=sys.stderr)
    bad = any(r["status"] == "error" or r["wrong"] for r in results)
    return 1 if bad or aborted else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (`python -m flash_cute.tools.bench`), same options as the CLI."""
    parser = add_arguments(argparse.ArgumentParser(prog="flash_cute bench",
                                                   description=__doc__.splitlines()[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
