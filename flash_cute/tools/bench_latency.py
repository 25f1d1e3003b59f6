"""`python -m flash_cute bench latency`: the host time of one call, next to FA4 and SDPA.

A short call (a decode step, a small batch) costs what the host spends issuing it more than
what the GPU spends running it. Each provider's call is timed, round by round interleaved
with the other providers, behind a spin kernel (`torch.cuda._sleep`) queued first, so every
launch of the timed loop queues and none waits for the GPU:

* **host**: the loop's wall time per call, which is then the CPU's alone. A round in which
  the spin kernel finished before the loop did (the GPU went idle, and launches may have
  waited) is run again with a longer spin; the record says how many rounds that took.
* **gpu**: the GPU time per call of the same calls, between CUDA events placed after the
  spin and after the loop (the kernels ran back to back).
* **loop**: the wall time per call of a plain loop synchronized at its end, which is what a
  user sees: about max(host, gpu).

Cases: a tiny forward (b 1, s 128, h 16, d 128, bf16, no grad) and a forward + backward step
(`torch.autograd.grad` of its output). SDPA takes the [b, s, h, d] tensors through transposed
views, as a caller with that layout would; each provider's backend selection (SDPA's
`sdpa_kernel`) is entered once around its loop, not per call.
"""

import json
import statistics
import time
from dataclasses import dataclass

# The H200's SM clock is about 1.98 GHz: 2e8 cycles spin about 0.1 s.
_SPIN_CYCLES = 200_000_000
# Untimed calls queued before each timed loop.
_WARM_CALLS = 10


@dataclass(frozen=True)
class Shape:
    batch: int = 1
    seqlen: int = 128
    heads: int = 16
    hdim: int = 128
    causal: bool = False


def _step(provider, case: str, shape: Shape):
    """(call, context): a no-argument callable running one `case` call of `provider` on fresh
    inputs, and the context to enter around its loops."""
    import torch

    grad = case == "fwd_bwd"
    q, k, v = (torch.randn(shape.batch, shape.seqlen, shape.heads, shape.hdim, device="cuda",
                           dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    dout = torch.randn_like(q)
    if not grad:
        def call():
            with torch.no_grad():
                provider.forward(q, k, v, shape.causal)
    else:
        def call():
            out = provider.forward(q, k, v, shape.causal)
            torch.autograd.grad(out, (q, k, v), dout)
    return call, provider.context


def _timed_round(call, calls: int, spin_cycles: int) -> tuple:
    """(host seconds per call, GPU seconds per call, whether the GPU stayed busy)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(spin_cycles)
    after_spin = torch.cuda.Event(enable_timing=True)
    done = torch.cuda.Event(enable_timing=True)
    after_spin.record()
    for _ in range(_WARM_CALLS):
        call()  # queued behind the spin too: caches and the allocator warm again
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - start) / calls
    busy = not after_spin.query()
    done.record()
    torch.cuda.synchronize()
    return host, after_spin.elapsed_time(done) * 1e-3 / (calls + _WARM_CALLS), busy


def _loop_round(call, calls: int) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def measure(providers: dict, cases, calls: int, rounds: int, shape: Shape = Shape()) -> list:
    """Records {provider, case, host_us, gpu_us, loop_us, respins} (medians over rounds), the
    providers interleaved within each round."""
    steps = {}
    for name, provider in providers.items():
        for case in cases:
            call, context = _step(provider, case, shape)
            with context():
                for _ in range(3):
                    call()  # compile, plan, warm the allocator
            steps[name, case] = (call, context)
    samples = {key: {"host": [], "gpu": [], "loop": [], "respins": 0} for key in steps}
    for _ in range(rounds):
        for key, (call, context) in steps.items():
            spin = _SPIN_CYCLES
            with context():
                host, gpu, busy = _timed_round(call, calls, spin)
                while not busy and spin < 64 * _SPIN_CYCLES:
                    spin *= 2
                    samples[key]["respins"] += 1
                    host, gpu, busy = _timed_round(call, calls, spin)
                loop = _loop_round(call, calls)
            for name, value in (("host", host), ("gpu", gpu), ("loop", loop)):
                samples[key][name].append(value)
    return [{"provider": name, "case": case, "shape": shape.__dict__,
             **{m: statistics.median(s[m]) * 1e6 for m in ("host", "gpu", "loop")},
             "respins": s["respins"]}
            for (name, case), s in samples.items()]


def format_table(records: list) -> str:
    cases = list(dict.fromkeys(r["case"] for r in records))
    head = "| provider | " + " | ".join(f"{c} host | {c} gpu | {c} loop" for c in cases) + " |"
    rows = [head, "|" + "---:|" * (1 + 3 * len(cases))]
    for name in dict.fromkeys(r["provider"] for r in records):
        by_case = {r["case"]: r for r in records if r["provider"] == name}
        cells = []
        for c in cases:
            r = by_case.get(c)
            cells += ([f"{r['host_us']:.1f}", f"{r['gpu_us']:.1f}", f"{r['loop_us']:.1f}"]
                      if r else ["n/a"] * 3)
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n(µs per call; host: CPU time with launches queued behind a " \
        "busy GPU; loop: a plain loop's wall time)"


def run(args) -> int:
    import torch

    from flash_cute.tools.bench.providers import load_provider
    from flash_cute.tools.bench.report import environment_info

    if not torch.cuda.is_available():
        print("bench latency needs a CUDA GPU", file=__import__("sys").stderr)
        return 2
    providers = {}
    for name in args.providers:
        provider = load_provider(name)
        if provider.unavailable:
            print(f"  {name}: n/a ({provider.unavailable})")
            continue
        providers[name] = provider
    cases = [c for c in args.cases.split(",") if c]
    records = measure(providers, cases, args.calls, args.rounds)
    for r in records:
        r["host_us"], r["gpu_us"], r["loop_us"] = r.pop("host"), r.pop("gpu"), r.pop("loop")
    print(format_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment_info(), "records": records}, f, indent=1)
    return 0
