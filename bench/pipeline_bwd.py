"""Backward of one pipeline, called directly (no dispatcher), next to FA4 and SDPA in one run.

    python bench/pipeline_bwd.py [--pipeline hopper] [--hdim 64,128] [--seqlen 2048,8192]
                                 [--schedules 64x128x2,64x128x2+swap_sdp,...] [--rounds 3]

Prints TFLOP/s (2.5 x 4·b·h·s²·d, ÷2 causal), the median of `--rounds` rounds that time every
provider and tile in turn, with the rounds' spread, and the largest |dq|, |dk|, |dv|
difference from SDPA-flash's relative to its largest entry; used for ablations before a
kernel is dispatched.
"""

import argparse
import functools
import importlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_cute import flash_attn_func
from flash_cute.runtime.problem import validate_attention_inputs
from flash_cute.tools.bench.measure import ablation_rows, make_timer
from flash_cute.tools.bench.report import ablation_table
from flash_cute.tools.kernel_config import schedule_label


def _parse_schedule(pipeline: str, text: str):
    """``64x128x2`` -> (64, 128, 2); ``+name`` turns on a switch of the pipeline's BwdSchedule
    (``64x128x2+swap_sdp``), ``+name=N`` sets a number (``64x48x2+swap_dkv+do_stages=1``);
    without them the numbers fill the config's first fields and its defaults the rest (so
    ``64x128x2`` is the schedule with every switch off)."""
    nums, *flags = text.split("+")
    values = tuple(map(int, nums.split("x")))
    config = getattr(importlib.import_module(f"flash_cute.arch.{pipeline}.config"),
                     "BwdSchedule", None)
    if config is None:
        if flags:
            raise SystemExit(f"{pipeline} has no backward schedule switches: {text}")
        return values
    named = dict(f.split("=") for f in flags if "=" in f)
    return config(*values, **{f: True for f in flags if "=" not in f},
                  **{k: int(v) for k, v in named.items()})


def _sdpa(backend, q, k, v, do, causal):
    leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    fn = lambda: torch.autograd.grad(out, leaves, do.transpose(1, 2), retain_graph=True)  # noqa: E731
    return fn, lambda: [g.transpose(1, 2) for g in fn()]


def _rel_err(grads, ref) -> float:
    """Largest |dq|, |dk|, |dv| difference relative to the reference's largest entry."""
    return max(((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
               for g, r in zip(grads, ref))


def _fa4(q, k, v, do, causal):
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError:
        return None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fa4(*leaves, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pipeline", default="hopper")
    p.add_argument("--hdim", default="64,128")
    p.add_argument("--seqlen", default="2048,8192")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--schedules", "--tiles", dest="schedules", default=None,
                   help="e.g. 64x128x2,64x128x2+swap_sdp (default: the pipeline's table)")
    p.add_argument("--rounds", type=int, default=3, help="round-robin rounds per cell (median)")
    args = p.parse_args()
    timer = make_timer(25, 100)
    mod = importlib.import_module(f"flash_cute.arch.{args.pipeline}.planner")
    rows = []
    for hdim in map(int, args.hdim.split(",")):
        for seqlen in map(int, args.seqlen.split(",")):
            batch, nheads = 16384 // seqlen, 2048 // hdim
            for causal in map(bool, map(int, args.causal.split(","))):
                q, k, v, do = (torch.randn(batch, seqlen, nheads, hdim, device="cuda",
                                           dtype=torch.bfloat16) for _ in range(4))
                flops = 2.5 * 4 * batch * nheads * seqlen * seqlen * hdim / (2 if causal else 1)
                cell = (hdim, seqlen, int(causal))
                timed, ref_grads = _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, do, causal)
                ref = ref_grads()
                fns = {"sdpa_flash": timed,
                       "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, do, causal)[0],
                       "fa4": _fa4(q, k, v, do, causal)}
                errs = {}
                problem = validate_attention_inputs(q, k, v, causal=causal)
                out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
                tiles = [None] if not args.schedules else [
                    _parse_schedule(args.pipeline, t) for t in args.schedules.split(",")]
                for tile in tiles:
                    kw = {} if tile is None else {"schedule": tile}
                    fn = functools.partial(mod.backward, do, None, q, k, v, out, lse, problem,
                                           **kw)
                    label = args.pipeline + ("" if tile is None else "-" + schedule_label(tile))
                    fns[label] = fn
                    errs[label] = f"{_rel_err(fn(), ref):.1e}"
                rows += ablation_rows(cell, fns, errs, flops, args.rounds, timer)
    print("\n" + ablation_table(rows, "bwd TFLOP/s", "rel. err vs sdpa_flash"))


if __name__ == "__main__":
    main()
