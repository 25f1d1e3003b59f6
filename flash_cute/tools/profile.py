"""`python -m flash_cute profile`: the hopper forward's or backward's measured timeline on a
GPU.

The kernel is compiled with its timeline switch (`Variant.timeline`): the first CTAs' warps
record their phase boundaries with the global timer (`flash_cute.blocks.timeline`) during one
warmed-up call. The records are drawn as a Gantt chart per warp role
(`flash_cute.tools.timeline.render`) and the overlap is printed as numbers. The backward's
measurement build spills a few bytes (D-TIMELINE); its switch-off build is the one timed.

    python -m flash_cute profile [--backward] [--hdim 128] [--seqlen 8192] [--batch 2]
                                 [--causal] [--ctas 2] [--out DIR]
"""

from __future__ import annotations

import json
from pathlib import Path


def add_arguments(parser):
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=None,
                        help="query heads (default 2048 / hdim, the standard grid's)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--ctas", type=int, default=2, help="CTAs whose first tile records")
    parser.add_argument("--out", default="results/profile", metavar="DIR")
    parser.add_argument("--backward", action="store_true", help="the backward's timeline")


def roles_of(num_consumer_warpgroups: int, backward: bool = False) -> dict:
    """warp -> role name of the hopper forward or backward (`arch/hopper/pipelines`)."""
    roles = {0: "producer", 1: "dQ writer"} if backward else {0: "producer"}
    for wg in range(1, num_consumer_warpgroups + 1):
        roles.update({w: f"consumer {wg}" for w in range(4 * wg, 4 * wg + 4)})
    return roles


def run(args) -> int:
    import torch

    from flash_cute.arch.hopper import planner
    from flash_cute.contract.timeline import buffer_shape
    from flash_cute.runtime import call
    from flash_cute.tools import timeline

    if not torch.cuda.is_available():
        print("profile needs a CUDA GPU (sm_90a); on the CPU the instrumented kernels "
              "cross-compile: python -m flash_cute inspect --kernel hopper.fwd --all")
        return 2
    heads = args.heads or 2048 // args.hdim
    shape = (args.batch, args.seqlen, heads, args.hdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    options = (None, None, None, args.causal, None, None, 0.0, None, False, None)
    problem = call.validate_call(q, k, v, (None,) * 4, options)
    records = torch.zeros(buffer_shape(args.ctas, 16), dtype=torch.int64, device="cuda")
    if args.backward:
        o, lse = planner.plan_forward(q, k, v, problem)(q, k, v)
        dout = torch.randn_like(o)
        launch = planner.plan_backward(dout, None, q, k, v, o, lse, problem, timeline=records)
        run_once = lambda: launch(dout, None, q, k, v, o, lse)  # noqa: E731
        roles = roles_of(2, backward=True)
    else:
        launch = planner.plan_forward(q, k, v, problem, timeline=records)
        run_once = lambda: launch(q, k, v)  # noqa: E731
        roles = roles_of(launch.call._make_kernel().num_wg)
    for _ in range(3):   # compile, warm up; the last call's records are kept
        records.zero_()
        run_once()
    torch.cuda.synchronize()
    found = records.cpu().tolist()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kernel = "hopper.bwd" if args.backward else "hopper.fwd"
    name = (f"{kernel.replace('.', '_')}_d{args.hdim}_{'causal' if args.causal else 'full'}_"
            f"{args.seqlen}")
    (out / f"{name}.json").write_text(json.dumps(found))
    numbers = timeline.overlap(found, roles)
    drawn = timeline.render(found, out / f"{name}.png", roles,
                            f"{kernel} d{args.hdim} {'causal' if args.causal else ''} "
                            f"{args.batch}x{args.seqlen} ({torch.cuda.get_device_name()})")
    print(json.dumps({"card": torch.cuda.get_device_name(), "kernel": kernel,
                      **vars(args), **numbers, "png": drawn and str(out / f"{name}.png")},
                     indent=1))
    return 0
