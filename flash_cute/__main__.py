"""`python -m flash_cute [inspect|bench [latency|decode|fp8|parallel]|check|cache|profile]`
(also the `flash-cute` command).

With no sub-command: on a CUDA machine, `check` (a quick correctness check against the
float64 reference and a short benchmark with a plot); without a GPU, `inspect` (one forward
kernel per SM target, cross-compiled, compared and plotted).
"""

import argparse
import sys


def _parser():
    parser = argparse.ArgumentParser(prog="python -m flash_cute", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    from flash_cute.tools import cache_cli, inspection, profile, selfcheck
    from flash_cute.tools.bench import cli as bench

    inspection.add_arguments(sub.add_parser("inspect", help="cross-compile kernels, report SASS"))
    bench.add_arguments(sub.add_parser("bench", help="TFLOP/s against SDPA and FA4 (GPU)"))
    selfcheck.add_arguments(sub.add_parser("check",
                                           help="correctness check + short benchmark (GPU)"))
    cache_cli.add_arguments(sub.add_parser("cache", help="the persistent JIT cache"))
    profile.add_arguments(sub.add_parser("profile",
                                         help="the hopper forward's measured timeline (GPU)"))
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command is None:
        import torch

        default = ["check"] if torch.cuda.is_available() else ["inspect"]
        args = _parser().parse_args(default)
    if args.command == "inspect":
        from flash_cute.tools import inspection

        return inspection.run(args)
    if args.command == "bench" and args.what == "decode":
        from flash_cute.tools import bench_decode

        return bench_decode.run(args)
    if args.command == "bench" and args.what == "fp8":
        from flash_cute.tools import bench_fp8

        return bench_fp8.run(args)
    if args.command == "bench" and args.what == "parallel":
        from flash_cute.tools import bench_parallel

        return bench_parallel.run(args)
    if args.command == "bench" and args.what == "latency":
        from flash_cute.tools import bench_latency

        return bench_latency.run(args)
    if args.command == "bench":
        from flash_cute.tools.bench import cli as bench

        return bench.run(args)
    if args.command == "cache":
        from flash_cute.tools import cache_cli

        return cache_cli.run(args)
    if args.command == "profile":
        from flash_cute.tools import profile

        return profile.run(args)
    from flash_cute.tools import selfcheck

    return selfcheck.run(args)


if __name__ == "__main__":
    sys.exit(main())
