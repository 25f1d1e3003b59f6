"""Ablation of the Hopper forward's schedule (FA3's two overlaps, the persistent tile
scheduler, tile, K/V stages), next to FA4 and cuDNN in the same run.

    python bench/hopper_fwd_ablation.py [--hdim 64,128,256] [--seqlen 2048,8192] [--causal 0,1]
                                        [--configs 128x128x2+ov+pp,128x128x2+ov+ps]

A config is tile_m x tile_n x kv_stages, then +ov (intra-warpgroup overlap), +pp
(inter-warpgroup ping-pong) and +ps (persistent: one CTA per SM walking the tiles; also
spelled +persistent). The default compares the table's schedule with persistence flipped and
with each overlap on and off. Prints TFLOP/s (4·b·h·s²·d, ÷2 causal), the median of
`--rounds` rounds that time every peer and config in turn, with the rounds' spread, and the
largest |O| difference from SDPA-flash.
"""

import argparse
import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_cute.arch.hopper import planner as api
from flash_cute.arch.hopper.config import FWD_SCHEDULES, FwdSchedule, with_switches
from flash_cute.runtime.problem import validate_attention_inputs
from flash_cute.tools.bench.measure import ablation_rows, make_timer
from flash_cute.tools.bench.report import ablation_table

_SWITCHES = {"ov": "intra_wg_overlap", "pp": "pingpong", "ps": "persistent",
             "persistent": "persistent"}


def parse_config(text: str) -> FwdSchedule:
    dims, *switches = text.split("+")
    unknown = set(switches) - set(_SWITCHES)
    if unknown:
        raise SystemExit(f"unknown switch(es) {sorted(unknown)} in {text!r}: use +ov, +pp, +ps")
    on = {_SWITCHES[s] for s in switches}
    return FwdSchedule(*map(int, dims.split("x")), **{f: f in on for f in set(_SWITCHES.values())})


def label(schedule: FwdSchedule) -> str:
    return ("x".join(map(str, schedule[:3])) + "+ov" * schedule.intra_wg_overlap
            + "+pp" * schedule.pingpong + "+ps" * schedule.persistent)


def default_configs(base: FwdSchedule) -> list:
    """The table's schedule, it with persistence flipped (a 192-row tile runs persistent
    only: without, 128 rows), and each overlap on and off."""
    overlaps = [base._replace(intra_wg_overlap=o, pingpong=pp)
                for o, pp in ((True, True), (True, False), (False, True), (False, False))]
    return [base, with_switches(base, persistent=not base.persistent)] \
        + [c for c in overlaps if c != base]


def peers(q, k, v, causal):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(qt, kt, vt, is_causal=causal)
        yield name, run
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError:
        return
    yield "fa4", lambda: fa4(q, k, v, causal=causal)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hdim", default="64,128,256")
    p.add_argument("--seqlen", default="8192")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--configs", default=None)
    p.add_argument("--rounds", type=int, default=3, help="round-robin rounds per cell (median)")
    args = p.parse_args()
    timer = make_timer(25, 100)
    rows = []
    for hdim in map(int, args.hdim.split(",")):
        base = FWD_SCHEDULES[hdim]
        configs = ([parse_config(c) for c in args.configs.split(",")] if args.configs else
                   default_configs(base))
        for seqlen in map(int, args.seqlen.split(",")):
            batch, nheads = 16384 // seqlen, 2048 // hdim
            for causal in map(bool, map(int, args.causal.split(","))):
                q, k, v = (torch.randn(batch, seqlen, nheads, hdim, device="cuda",
                                       dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * batch * nheads * seqlen * seqlen * hdim / (2 if causal else 1)
                cell = (hdim, seqlen, int(causal))
                fns = dict(peers(q, k, v, causal))
                ref = fns["sdpa_flash"]().transpose(1, 2)
                errs = {}
                problem = validate_attention_inputs(q, k, v, causal=causal)
                for schedule in configs:
                    fn = functools.partial(api.forward, q, k, v, problem, schedule=schedule)
                    fns[label(schedule)] = fn
                    errs[label(schedule)] = (
                        f"{(fn()[0].float() - ref.float()).abs().max().item():.1e}")
                rows += ablation_rows(cell, fns, errs, flops, args.rounds, timer)
    print("\n" + ablation_table(rows, "fwd TFLOP/s", "max err vs sdpa_flash"))


if __name__ == "__main__":
    main()
