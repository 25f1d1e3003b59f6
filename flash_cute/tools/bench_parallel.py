"""`python -m flash_cute bench parallel`, one process per GPU under torchrun: context
parallelism over the launch's process group, its correctness and its throughput.

    torchrun --standalone --nproc-per-node N -m flash_cute bench parallel --check
    torchrun --standalone --nproc-per-node N -m flash_cute bench parallel --tokens 131072

`--check`: each layout's ring (contiguous, striped, zigzag) and Ulysses, causal, forward and
backward, against single-GPU `flash_attn_func` on the gathered sequence by the FlashAttention
rule (`tolerance_check`, float64 attention as the reference), at `CHECK_TOKENS` tokens and a
few heads, where a dense float64 reference fits.

Throughput, per cell (zigzag ring or Ulysses, global tokens, forward or backward; causal,
hdim 128, GQA 32:8, batch 1):

* ours: the sharded call, each rep started together (a barrier) and timed by CUDA events,
  the slowest rank's time per rep, the median of the reps; TFLOP/s per GPU by the standard
  count (4·b·h·s²·d, halved for causal, the backward 2.5x) over the world;
* local: our single-GPU kernel on one rank's local work (`local_work`: its zigzag chunks'
  queries against the keys before them, or Ulysses' heads over the whole sequence), the
  ratio ours / local the share of the kernel's speed the parallel call keeps;
* torch_cp: torch's context parallelism (`context_parallel`) with SDPA on cuDNN, K/V heads
  repeated to the query heads, on the same shapes.

`--overlap` profiles one ring call (torch.profiler) and writes what share of the NCCL
kernels' time runs under the attention kernels. Rank 0 prints the table and writes
`parallel.json` under `--out`. `--device cpu` (gloo, float64 local attention, tiny shapes)
runs the same harness on CPUs, for its tests.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

HEADS, KV_HEADS, HDIM = 32, 8, 128
TOKENS = (131072, 524288)
CHECK_TOKENS = 8192
KINDS = ("ring", "ulysses")


def local_work(kind: str, tokens: int, world: int, rank: int) -> list:
    """One rank's share of a causal problem as single-GPU calls: (first query position,
    queries, keys, head share). Zigzag: its two chunks of tokens / (2 x world), each's
    queries against every key up to its end (bottom-right causal is then the global mask);
    Ulysses: the whole sequence for heads / world."""
    if kind == "ulysses":
        return [(0, tokens, tokens, world)]
    chunk = tokens // (2 * world)
    return [(c * chunk, chunk, (c + 1) * chunk, 1) for c in (rank, 2 * world - 1 - rank)]


def overlap_share(comm: list, compute: list) -> float:
    """The share of the communication intervals' time ((start, end) pairs) that some
    compute interval covers (1.0 with no communication)."""
    merged = []
    for start, end in sorted(compute):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = sum(end - start for start, end in comm)
    if total <= 0:
        return 1.0
    covered = 0.0
    for start, end in comm:
        for lo, hi in merged:
            covered += max(0.0, min(end, hi) - max(start, lo))
    return covered / total


def add_arguments(group) -> None:
    group.add_argument("--check", action="store_true",
                       help="parallel: correctness against one GPU, not throughput")
    group.add_argument("--tokens", default=None,
                       help="parallel: global tokens per cell, comma-separated (default "
                            "131072,524288)")
    group.add_argument("--kinds", default=",".join(KINDS),
                       help=f"parallel: comma-separated, of {', '.join(KINDS)}")
    group.add_argument("--reps", type=int, default=5, help="parallel: timed reps per cell")
    group.add_argument("--no-peer", action="store_true",
                       help="parallel: without torch's context parallelism")
    group.add_argument("--overlap", action="store_true",
                       help="parallel: profile one ring call for the transfers' overlap")
    group.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                       help="parallel: cpu runs gloo ranks with float64 local attention")


def run(args) -> int:
    """Exit code: 0 done; 1 a check failed or a cell errored; 2 not launched by torchrun."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        print("bench parallel runs one process per GPU: torchrun --nproc-per-node N -m "
              "flash_cute bench parallel ...", file=sys.stderr)
        return 2
    cpu = args.device == "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if not cpu:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo" if cpu else "nccl")
    try:
        ctx = _Context(torch, dist, cpu, local_rank, args)
        records = check(ctx) if args.check else throughput(ctx)
        failed = any(not r.get("ok", True) or r.get("error") for r in records)
        if ctx.rank == 0:
            _report(ctx, records)
    finally:
        # Every rank done with every collective before any tears its group down.
        dist.barrier()
        dist.destroy_process_group()
    # The results are written and the group is gone: the process leaves without the
    # interpreter's teardown, which after gloo collectives run from autograd's threads can
    # abort it ("terminate called without an active exception") and fail a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


class _Context:
    def __init__(self, torch, dist, cpu: bool, local_rank: int, args):
        self.torch, self.dist, self.cpu, self.args = torch, dist, cpu, args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cpu" if cpu else f"cuda:{local_rank}")
        self.card = "CPU (gloo)" if cpu else torch.cuda.get_device_name(self.device)

    def timed(self, fn, reps: int, warmup: int = 2) -> float:
        """The median over `reps` of the slowest rank's time of `fn` (ms), every rep started
        together; the same number of calls on every rank, so collectives stay in step."""
        torch, dist = self.torch, self.dist
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            dist.barrier()
            if self.cpu:
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            else:
                begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                begin.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(begin.elapsed_time(end))
        slowest = torch.tensor(times, dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return statistics.median(slowest.tolist())


# ------------------------------------------------------------------------- correctness

def check(ctx) -> list:
    """Each layout's ring and Ulysses, causal, forward and backward, on this world."""
    cases = [("ring", layout) for layout in ("contiguous", "striped", "zigzag")]
    cases.append(("ulysses", "zigzag"))
    return [_check_one(ctx, kind, layout) for kind, layout in cases]


def _check_one(ctx, kind: str, layout: str) -> dict:
    torch = ctx.torch
    from flash_cute import flash_attn_func
    from flash_cute.parallel import Float64Local, positions, ring_attention, ulysses_attention
    from flash_cute.reference.attention import attention_ref, tolerance_check

    world = ctx.world
    # Ulysses splits the K/V heads over the ranks; the ring runs GQA.
    heads, kv_heads = (max(4, world), max(4, world)) if kind == "ulysses" else (4, 2)
    tokens = 64 * 2 * world if ctx.cpu else CHECK_TOKENS
    dtype = torch.float64 if ctx.cpu else torch.bfloat16
    gen = torch.Generator(device=ctx.device).manual_seed(11)
    q, dout = (torch.randn(1, tokens, heads, HDIM, device=ctx.device, generator=gen)
               for _ in range(2))
    k, v = (torch.randn(1, tokens, kv_heads, HDIM, device=ctx.device, generator=gen)
            for _ in range(2))
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    exact = [t.detach().double().clone().requires_grad_(True) for t in (q, k, v)]
    out64, _ = attention_ref(*exact, causal=True)
    out64.backward(dout.double())
    native = None
    if not ctx.cpu:
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        single = flash_attn_func(*leaves, causal=True)[0]
        single.backward(dout)
        native = [single] + [t.grad for t in leaves]
    pos = positions(tokens, layout, world, ctx.rank)
    mine = [t.detach()[:, pos].clone().requires_grad_(True) for t in (q, k, v)]
    call = ring_attention if kind == "ring" else ulysses_attention
    local = Float64Local() if ctx.cpu else None
    out = call(*mine, layout=layout, causal=True, local=local)
    out.backward(dout[:, pos])
    record = {"check": f"{kind} {layout}", "world": world, "tokens": tokens, "heads": heads,
              "kv_heads": kv_heads, "ok": True, "errors": {}}
    got = [out] + [t.grad for t in mine]
    refs = [out64] + [t.grad for t in exact]
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        ref = refs[i][:, pos]
        if native is None:
            err = (got[i] - ref).abs().max().item()
            ok = err <= 1e-9 * max(1.0, ref.abs().max().item())
        else:
            res = tolerance_check(got[i], ref, native[i][:, pos])
            err, ok = res.err, bool(res.ok)
        flags = torch.tensor([float(ok), err], dtype=torch.float64, device=ctx.device)
        ctx.dist.all_reduce(flags[:1], op=ctx.dist.ReduceOp.MIN)
        ctx.dist.all_reduce(flags[1:], op=ctx.dist.ReduceOp.MAX)
        record["errors"][name] = flags[1].item()
        record["ok"] &= bool(flags[0].item())
    return record


# -------------------------------------------------------------------------- throughput

def throughput(ctx) -> list:
    args = ctx.args
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(TOKENS)
    if ctx.cpu:
        tokens = [t for t in tokens if t <= 4096] or [256 * ctx.world]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    records = []
    for kind in kinds:
        for total in tokens:
            for direction in ("fwd", "bwd"):
                records.append(_cell(ctx, kind, total, direction))
    if args.overlap and "ring" in kinds:
        records.append(_overlap(ctx, min(tokens)))
    return records


def _problem(ctx, tokens: int, grad: bool):
    torch = ctx.torch
    heads, kv_heads = (4, 2) if ctx.cpu else (HEADS, KV_HEADS)
    dtype = torch.float64 if ctx.cpu else torch.bfloat16
    shard = tokens // ctx.world
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
    q = torch.randn(1, shard, heads, HDIM, device=ctx.device, dtype=dtype, generator=gen)
    k, v = (torch.randn(1, shard, kv_heads, HDIM, device=ctx.device, dtype=dtype,
                        generator=gen) for _ in range(2))
    if grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    return q, k, v, heads


def _cell(ctx, kind: str, tokens: int, direction: str) -> dict:
    """One cell: ours, the local work on one GPU, and torch's context parallelism."""
    from flash_cute.parallel import Float64Local, ring_attention, ulysses_attention
    from flash_cute.tools.bench.measure import attention_flops, tflops_per_s

    record = {"kind": kind, "layout": "zigzag", "tokens": tokens, "world": ctx.world,
              "direction": direction, "card": ctx.card, "hdim": HDIM}
    try:
        q, k, v, heads = _problem(ctx, tokens, direction == "bwd")
        call = ring_attention if kind == "ring" else ulysses_attention
        local = Float64Local() if ctx.cpu else None
        grad = ctx.torch.randn_like(q)

        def fwd():
            with ctx.torch.no_grad():
                call(q, k, v, layout="zigzag", causal=True, local=local)

        def fwd_bwd():
            call(q, k, v, layout="zigzag", causal=True, local=local).backward(grad)
        ms = _direction_ms(ctx, fwd, fwd_bwd, direction)
        flops = attention_flops(1, heads, tokens, tokens, HDIM, causal=True,
                                direction=direction)
        record.update(heads=heads, ms=ms, tflops_per_gpu=tflops_per_s(flops / ctx.world, ms))
        if not ctx.cpu:
            record["local_ms"] = _local_ms(ctx, kind, tokens, direction, heads)
            record["vs_local"] = record["local_ms"] / ms
            if not ctx.args.no_peer:
                record.update(_peer(ctx, tokens, direction, heads, ms))
    except Exception as exc:  # a cell that fails is a row that says so
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return record


def _direction_ms(ctx, fwd, fwd_bwd, direction: str) -> float:
    reps = ctx.args.reps
    forward = ctx.timed(fwd, reps)
    return forward if direction == "fwd" else max(ctx.timed(fwd_bwd, reps) - forward, 1e-6)


def _local_ms(ctx, kind: str, tokens: int, direction: str, heads: int) -> float:
    """Our single-GPU kernel on this rank's local work (`local_work`), timed as the
    sharded call is (the slowest rank's)."""
    torch = ctx.torch
    from flash_cute import flash_attn_func

    calls = []
    for _, nq, nk, share in local_work(kind, tokens, ctx.world, ctx.rank):
        h, hk = heads // share, KV_HEADS // share
        q = torch.randn(1, nq, h, HDIM, device=ctx.device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, nk, hk, HDIM, device=ctx.device, dtype=torch.bfloat16)
                for _ in range(2))
        if direction == "bwd":
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        calls.append((q, k, v))

    def fwd():
        with torch.no_grad():
            for q, k, v in calls:
                flash_attn_func(q, k, v, causal=True)

    def fwd_bwd():
        for q, k, v in calls:
            out = flash_attn_func(q, k, v, causal=True)[0]
            out.backward(torch.ones_like(out))
    return _direction_ms(ctx, fwd, fwd_bwd, direction)


def _peer(ctx, tokens: int, direction: str, heads: int, ours_ms: float) -> dict:
    """torch's context parallelism with SDPA on cuDNN on the same shapes (K/V heads repeated
    to the query heads); its load balancing is its own (head-and-tail shards for causal)."""
    torch = ctx.torch
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        mesh = init_device_mesh("cuda", (ctx.world,))
        shape = (1, heads, tokens, HDIM)
        q, k, v = (torch.randn(shape, device=ctx.device, dtype=torch.bfloat16)
                   for _ in range(3))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]), \
                sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            leaves = [t.detach().requires_grad_(direction == "bwd") for t in (q, k, v)]
            grad = torch.randn_like(leaves[0])

            def fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(*leaves, is_causal=True)

            def fwd_bwd():
                F.scaled_dot_product_attention(*leaves, is_causal=True).backward(grad)
            ms = _direction_ms(ctx, fwd, fwd_bwd, direction)
        return {"torch_cp_ms": ms, "vs_torch_cp": ms / ours_ms}
    except Exception as exc:
        return {"torch_cp_error": f"{type(exc).__name__}: {exc}"[:300]}


def _overlap(ctx, tokens: int) -> dict:
    """One ring forward and backward under torch.profiler: the share of the NCCL kernels'
    time that attention kernels run under (this rank's GPU timeline)."""
    torch = ctx.torch
    from torch.profiler import ProfilerActivity, profile

    from flash_cute.parallel import ring_attention

    record = {"overlap": "ring zigzag", "tokens": tokens, "world": ctx.world,
              "card": ctx.card}
    if ctx.cpu:
        record["skipped"] = "the overlap is measured on GPUs (NCCL kernels)"
        return record
    q, k, v, _ = _problem(ctx, tokens, True)
    ring_attention(q, k, v, layout="zigzag", causal=True).sum().backward()
    ctx.dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ring_attention(q, k, v, layout="zigzag", causal=True).sum().backward()
        torch.cuda.synchronize()
    comm, compute = [], []
    for event in prof.events():
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start, event.time_range.end)
        (comm if "nccl" in event.name.lower() else compute).append(span)
    record.update(nccl_kernels=len(comm), nccl_us=sum(e - s for s, e in comm),
                  overlap_share=overlap_share(comm, compute))
    return record


# ------------------------------------------------------------------------------ report

def _report(ctx, records: list) -> None:
    out = ctx.args.out or os.path.join("results", time.strftime("parallel-%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "parallel.json")
    with open(path, "w") as f:
        json.dump({"records": records, "world": ctx.world, "card": ctx.card,
                   "argv": sys.argv}, f, indent=1)
    for r in records:
        print(_row(r))
    print(f"bench parallel: {len(records)} records in {path}")


def _row(r: dict) -> str:
    if "check" in r:
        errors = " ".join(f"{k} {v:.2e}" for k, v in r["errors"].items())
        return f"check {r['check']:<16} world {r['world']} {'ok' if r['ok'] else 'FAIL'} {errors}"
    if "overlap" in r:
        if "error" in r or "skipped" in r:
            return f"overlap {r['overlap']}: {r.get('error') or r['skipped']}"
        return (f"overlap {r['overlap']} {r['tokens']} tokens: {r['nccl_kernels']} NCCL kernels, "
                f"{r['overlap_share']:.0%} of their time under attention kernels")
    head = f"{r['kind']:<8} {r['tokens']:>8} {r['direction']} world {r['world']}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    text = f"{head} {r['ms']:9.2f} ms {r['tflops_per_gpu']:7.1f} TFLOP/s/GPU"
    if "vs_local" in r:
        text += f" ({r['vs_local']:.2f} of one GPU on the local work)"
    if "vs_torch_cp" in r:
        text += f", torch CP {r['torch_cp_ms']:.2f} ms ({r['vs_torch_cp']:.2f}x ours)"
    elif "torch_cp_error" in r:
        text += f", torch CP: {r['torch_cp_error']}"
    return text
