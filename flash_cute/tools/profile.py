"""`python -m flash_cute profile`: the hopper forward's measured timeline on a GPU.

The forward is compiled with its timeline switch (`Variant.timeline`): the first CTAs' warps
record their phase boundaries with the global timer (`flash_cute.blocks.timeline`) during one
warmed-up call. The records are drawn as a Gantt chart per warp role
(`flash_cute.tools.timeline.render`) and the overlap is printed as numbers.

    python -m flash_cute profile [--hdim 128] [--seqlen 8192] [--batch 2] [--causal]
                                 [--ctas 2] [--out DIR]
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


def roles_of(num_consumer_warpgroups: int) -> dict:
    """warp -> role name of the hopper forward (`arch/hopper/pipelines.forward`)."""
    roles = {0: "producer"}
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
    launch = planner.plan_forward(q, k, v, problem, timeline=records)
    for _ in range(3):   # compile, warm up; the last call's records are kept
        records.zero_()
        launch(q, k, v)
    torch.cuda.synchronize()
    found = records.cpu().tolist()
    roles = roles_of(launch.call._make_kernel().num_wg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"hopper_fwd_d{args.hdim}_{'causal' if args.causal else 'full'}_{args.seqlen}"
    (out / f"{name}.json").write_text(json.dumps(found))
    numbers = timeline.overlap(found, roles)
    drawn = timeline.render(found, out / f"{name}.png", roles,
                            f"hopper.fwd d{args.hdim} {'causal' if args.causal else ''} "
                            f"{args.batch}x{args.seqlen} ({torch.cuda.get_device_name()})")
    print(json.dumps({"card": torch.cuda.get_device_name(), "kernel": "hopper.fwd",
                      **vars(args), **numbers, "png": drawn and str(out / f"{name}.png")},
                     indent=1))
    return 0
