"""Dropout's cost: flash-cute's forward and backward with and without dropout, next to
cuDNN's and FlashAttention-2's (SDPA) in the same run, plus the backward schedules dropout
could take at hdim 128.

    python bench/dropout.py [--hdim 64,128] [--seqlen 2048,8192] [--causal 0,1] [--p 0.1]
                            [--frames] [--no-peers]

Prints TFLOP/s (4·b·h·s²·d, ÷2 causal; bwd 2.5×), the median of `--rounds` interleaved
rounds with their spread, and for each flash-cute row its time against flash-cute without
dropout. The backward is timed alone (autograd.grad of a kept graph).
"""

import argparse
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_cute import flash_attn_func
from flash_cute.arch.hopper import planner as api
from flash_cute.arch.hopper.config import BWD_SCHEDULES
from flash_cute.reference import rng
from flash_cute.runtime.problem import validate_attention_inputs
from flash_cute.tools.bench.measure import interleaved_times, make_timer, spread_pct
from flash_cute.tools.bench.report import markdown_table


def _fwd_bwd(run, q, k, v):
    """(forward callable, backward-only callable) of `run(q, k, v) -> out`."""
    out = run(q, k, v)
    dout = torch.randn_like(out)
    return (lambda: run(q, k, v),
            lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))


def _sdpa(backend, causal, p):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), dropout_p=p,
                                                  is_causal=causal)
    return run


def _ours(causal, p):
    return lambda q, k, v: flash_attn_func(q, k, v, causal=causal, dropout_p=p)[0]


# Frames of a context-parallel ring step (`rng.framed_seed`): a zigzag shard whose Philox
# groups stay whole, and a striped one (a Philox block per element).
FRAMES = {"groups": dict(q_first=4096, k_first=1024, stride=1),
          "strided": dict(q_first=1, k_first=1, stride=4)}


def _ours_framed(causal, p, frame):
    """flash-cute through the operator with a framed seed (the ring's local call)."""
    seeds = {}

    def run(q, k, v):
        if q.device not in seeds:    # one seed, made once: timing the kernels, not its copy
            seeds[q.device] = rng.framed_seed(rng.draw_seed(q.device), heads=q.shape[2],
                                              **FRAMES[frame])
        seed = seeds[q.device]
        options = (None, None, None, causal, None, None, 0.0, None, False, None)
        return torch.ops.flash_cute.fwd(q, k, v, None, None, None, None, *options, True, 0, p,
                                        seed)[0]
    return run


def _hopper_bwd(q, k, v, causal, p, schedule):
    """The hopper backward with dropout under `schedule` (the forward's outputs fixed)."""
    problem = validate_attention_inputs(q, k, v, causal=causal, dropout_p=p)
    seed = rng.draw_seed(q.device)
    out, lse = api.forward(q, k, v, problem, rng_seed=seed)
    dout = torch.randn_like(out)
    return functools.partial(api.backward, dout, None, q, k, v, out, lse, problem,
                             schedule=schedule, rng_seed=seed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", default="64,128")
    ap.add_argument("--seqlen", default="2048,8192")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frames", action="store_true",
                    help="also flash-cute with framed seeds (a ring step's draws)")
    ap.add_argument("--no-peers", action="store_true", help="flash-cute's rows only")
    args = ap.parse_args()
    timer = make_timer(25, 100)
    rows = []
    for hdim in map(int, args.hdim.split(",")):
        for seqlen in map(int, args.seqlen.split(",")):
            batch, nheads = 16384 // seqlen, 2048 // hdim
            for causal in map(bool, map(int, args.causal.split(","))):
                q, k, v = (torch.randn(batch, seqlen, nheads, hdim, device="cuda",
                                       dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                flops = 4 * batch * nheads * seqlen * seqlen * hdim / (2 if causal else 1)
                fns = {}
                providers = [("flash_cute p=0", _ours(causal, 0.0)),
                             (f"flash_cute p={args.p}", _ours(causal, args.p))]
                if args.frames:
                    providers += [(f"flash_cute p={args.p} frame={f}",
                                   _ours_framed(causal, args.p, f)) for f in FRAMES]
                if not args.no_peers:
                    providers += [("cudnn p=0", _sdpa(SDPBackend.CUDNN_ATTENTION, causal, 0.0)),
                                  (f"cudnn p={args.p}",
                                   _sdpa(SDPBackend.CUDNN_ATTENTION, causal, args.p)),
                                  (f"fa2 p={args.p}",
                                   _sdpa(SDPBackend.FLASH_ATTENTION, causal, args.p))]
                for name, run in providers:
                    try:
                        fwd, bwd = _fwd_bwd(run, q, k, v)
                    except RuntimeError as e:  # a backend that refuses the shape
                        print(f"{name}: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    fns[("fwd", name)], fns[("bwd", name)] = fwd, bwd
                if hdim == 128 and not args.no_peers:
                    for tile_m, swap in ((80, True), (64, True), (64, False)):
                        sched = BWD_SCHEDULES[128]._replace(tile_m=tile_m, swap_sdp=swap)
                        name = f"flash_cute p={args.p} bwd {tile_m}{'+swap' if swap else ''}"
                        fns[("bwd", name)] = _hopper_bwd(q.detach(), k.detach(), v.detach(),
                                                         causal, args.p, sched)
                stats = interleaved_times(fns, args.rounds, timer)
                base = {d: stats[(d, "flash_cute p=0")][0] for d in ("fwd", "bwd")}
                for (direction, name), st in stats.items():
                    work = flops * (2.5 if direction == "bwd" else 1.0)
                    vs = (f"{st[0] / base[direction]:.3f}x" if name.startswith("flash_cute")
                          else "")
                    rows.append((direction, hdim, seqlen, int(causal), name,
                                 f"{work / st[0] / 1e9:.1f}", spread_pct(st), vs))
                    print(rows[-1], flush=True)
                del q, k, v, fns
    print("\n" + markdown_table(["dir", "hdim", "seqlen", "causal", "provider", "TFLOP/s",
                                 "round spread", "time / flash_cute p=0"],
                                [list(map(str, r)) for r in rows]))


if __name__ == "__main__":
    main()
