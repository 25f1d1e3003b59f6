"""Seeded fuzz of the public API against the float64 reference, forward and backward (GPU).

    python bench/fuzz.py [--configs 500] [--seed 0] [--arch hopper] [--workers 1]
                         [--minutes 0] [--json FILE]
    python bench/fuzz.py --index-contents 200 [--seed 0]   (bench/fuzz_index.py)

Each config is drawn from every axis the pipeline supports: dtype, head dims (hdim_v < hdim
too), GQA ratios, padded or varlen layout (empty sequences included), seqused, odd and tiny
lengths (1, 7, 113, ...), causal, sliding windows, softcap, the backward and its
deterministic mode; on hopper, the FP8 forward (e4m3 with FA3's descales or block scales),
held to 1.25x its emulation's error (the same call on CPU copies). Outputs, LSE and
gradients are checked by the FlashAttention rule
(`flash_cute.reference.attention.tolerance_check`: error at most twice that of the same computation
in the input dtype), with an absolute floor scaled to each reference's magnitude, so that
gradients whose reference is exactly zero (sk = 1 gives dK = 0) do not turn rounding into a
miss. A miss or an exception is printed with its config; the summary counts them per axis.
A CUDA error stops the run (the context is lost). New features add their axes here.
`--index-contents N` runs the fuzz of bad index contents instead (`bench/fuzz_index.py`: the
content check off, the cache against its model, the dropped-rows status word).
"""

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

LENGTHS = (1, 2, 7, 16, 63, 113, 128, 129, 255, 333, 512, 777, 1024)
# Where the calls run: the GPU; a test sets "cpu" to run the draw and check code paths there.
DEVICE = "cuda"


def draw(rng: random.Random, pipeline: str) -> dict:
    """One random config of the supported space of `pipeline` (hopper or ampere)."""
    from flash_cute.arch.ampere import config as ampere
    from flash_cute.arch.hopper import config as hopper

    cfg_mod = hopper if pipeline == "hopper" else ampere
    hdim, hdim_v = rng.choice(sorted(cfg_mod.SUPPORTED_HDIMS))
    bwd_dims = getattr(cfg_mod, "BWD_SUPPORTED_HDIMS", cfg_mod.SUPPORTED_HDIMS)
    heads_kv = rng.choice((1, 2, 4))
    group = rng.choice((1, 1, 2, 4, 8))
    varlen = rng.random() < 0.4
    batch = rng.randint(1, 4)
    lens_q = [rng.choice(LENGTHS + (0,) * varlen) for _ in range(batch)]
    lens_k = [rng.choice(LENGTHS + (0,) * varlen) for _ in range(batch)]
    if not varlen:
        lens_q, lens_k = [max(lens_q)] * batch, [max(lens_k)] * batch
    causal = rng.random() < 0.4
    window = (None, None)
    if not causal and rng.random() < 0.2:
        window = (rng.choice((None, 0, 17, 100)), rng.choice((None, 0, 5, 64)))
    cfg = dict(pipeline=pipeline, dtype=rng.choice(("bf16", "fp16")), hdim=hdim, hdim_v=hdim_v,
               heads_kv=heads_kv, group=group, varlen=varlen, lens_q=lens_q, lens_k=lens_k,
               causal=causal, window=window,
               softcap=rng.choice((0.0,) * 4 + (5.0, 30.0)),
               seqused_k=rng.random() < 0.15, bwd=(hdim, hdim_v) in bwd_dims and rng.random() < 0.6)
    cfg["deterministic"] = cfg["bwd"] and pipeline == "hopper" and rng.random() < 0.2
    if pipeline == "hopper" and rng.random() < 0.15:
        # The FP8 forward: its head dims, no backward; FA3's descales, or block scales
        # (padded, without softcap).
        cfg.update(dtype="e4m3", bwd=False, deterministic=False)
        cfg["hdim"], cfg["hdim_v"] = rng.choice(sorted(hopper.FP8_SUPPORTED_HDIMS))
        cfg["scales"] = ("block" if not varlen and not cfg["softcap"] and rng.random() < 0.5
                         else "head")
    return cfg


def _inputs(cfg: dict, gen: torch.Generator):
    # FP8 configs draw bf16 values and quantize them (`_fp8_inputs`).
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.bfloat16}[cfg["dtype"]]
    h, hk = cfg["heads_kv"] * cfg["group"], cfg["heads_kv"]
    if cfg["varlen"]:
        lead_q, lead_k = (sum(cfg["lens_q"]),), (sum(cfg["lens_k"]),)
    else:
        lead_q = (len(cfg["lens_q"]), cfg["lens_q"][0])
        lead_k = (len(cfg["lens_k"]), cfg["lens_k"][0])

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype).requires_grad_()

    q, k = randn(*lead_q, h, cfg["hdim"]), randn(*lead_k, hk, cfg["hdim"])
    v = randn(*lead_k, hk, cfg["hdim_v"])
    kw = dict(causal=cfg["causal"], window_size=cfg["window"], softcap=cfg["softcap"])
    if cfg["varlen"]:
        def cu(lens):
            return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                device=DEVICE)
        kw.update(cu_seqlens_q=cu(cfg["lens_q"]), cu_seqlens_k=cu(cfg["lens_k"]))
    if cfg["seqused_k"]:
        used = [int(torch.randint(0, n + 1, (), generator=gen, device=DEVICE))
                for n in cfg["lens_k"]]
        kw["seqused_k"] = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    return q, k, v, kw


def _fp8_inputs(q, k, v, cfg: dict) -> tuple:
    """e4m3 q, k, v and their scales: FA3's descales (one per K/V head, shared by the batch
    entries, q's by the group's query heads) or block scales (`quantize_fp8`)."""
    from flash_cute.fp8 import E4M3_MAX, quantize_fp8, to_e4m3

    q, k, v = (t.detach().float() for t in (q, k, v))
    if cfg["scales"] == "block":
        (q8, qs), (k8, ks), (v8, vs) = (quantize_fp8(t) for t in (q, k, v))
        return (q8, k8, v8), (qs, ks, vs)
    hk, batch = cfg["heads_kv"], len(cfg["lens_q"])
    out, scales = [], []
    for t in (q, k, v):
        grouped = t.reshape(*t.shape[:-2], hk, -1)
        keep = grouped.dim() - 2   # the K/V head mode
        amax = grouped.abs().amax(dim=tuple(i for i in range(grouped.dim()) if i != keep))
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        out.append(to_e4m3(grouped / scale[:, None]).view(t.shape))
        scales.append(scale.expand(batch, hk).contiguous())
    return tuple(out), tuple(scales)


def run_fp8_config(cfg: dict, q, k, v, kw: dict) -> list:
    """The FP8 forward against float64 of its dequantized inputs, held to 1.25x the error of
    its emulation (the CPU path of the same call) on the same inputs."""
    import flash_cute
    from flash_cute.fp8 import dequantize_fp8
    from flash_cute.reference.attention import attention_ref

    (q8, k8, v8), scales = _fp8_inputs(q, k, v, cfg)
    call_kw = dict(kw, return_lse=True, q_descale=scales[0], k_descale=scales[1],
                   v_descale=scales[2])
    fn = flash_cute.flash_attn_func
    if cfg["varlen"] or "seqused_k" in kw:
        fn = flash_cute.flash_attn_varlen_func
        if cfg["varlen"]:
            call_kw.update(max_seqlen_q=max(cfg["lens_q"]), max_seqlen_k=max(cfg["lens_k"]))
    out, lse = fn(q8, k8, v8, **call_kw)
    cpu = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in call_kw.items()}
    emu, emu_lse = fn(q8.cpu(), k8.cpu(), v8.cpu(), **cpu)
    group = cfg["group"]
    if cfg["scales"] == "block":
        deq = [dequantize_fp8(t, s) for t, s in zip((q8, k8, v8), scales)]
    else:
        per = (scales[0].repeat_interleave(group, dim=1), scales[1], scales[2])
        deq = [t.double() * s.double()[0][(None,) * (t.dim() - 2) + (slice(None), None)]
               for t, s in zip((q8, k8, v8), per)]
    ref, ref_lse = attention_ref(*deq, mode="float64", **kw)
    missed = []
    for name, got, model, ref64 in (("O", out, emu, ref), ("LSE", lse, emu_lse, ref_lse)):
        finite = torch.isfinite(ref64)
        err = (got.double() - ref64)[finite].abs()
        model_err = (model.double().to(ref64.device) - ref64)[finite].abs()
        bound = 1.25 * model_err.max().item() + 1e-5 if err.numel() else 0.0
        if err.numel() and (err.max().item() > bound or not torch.equal(
                torch.isfinite(got), finite)):
            missed.append(f"FP8 {name} err {err.max().item():.2e} model "
                          f"{model_err.max().item():.2e}")
    return missed


def _floor(ref: torch.Tensor, dtype) -> float:
    """An absolute floor scaled to the reference's magnitude (one unit of the dtype's
    precision at its largest entry)."""
    return float(ref.detach().abs().max()) * torch.finfo(dtype).eps if ref.numel() else 0.0


def run_config(cfg: dict, seed: int) -> list:
    """The names of the checks that missed (empty: all passed)."""
    import flash_cute
    from flash_cute.reference.attention import attention_ref, tolerance_check

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v, kw = _inputs(cfg, gen)
    if cfg["dtype"] == "e4m3":
        return run_fp8_config(cfg, q, k, v, kw)
    ref_kw = dict(kw)
    call_kw = dict(kw, return_lse=True, arch=cfg["pipeline"], deterministic=cfg["deterministic"])
    if cfg["varlen"]:
        call_kw.update(max_seqlen_q=max(cfg["lens_q"]), max_seqlen_k=max(cfg["lens_k"]))
        out, lse = flash_cute.flash_attn_varlen_func(q, k, v, **call_kw)
    else:
        seqused_k = call_kw.pop("seqused_k", None)
        if seqused_k is None:
            out, lse = flash_cute.flash_attn_func(q, k, v, **call_kw)
        else:
            out, lse = flash_cute.flash_attn_varlen_func(q, k, v, seqused_k=seqused_k, **call_kw)
    ref, ref_lse = attention_ref(q, k, v, mode="float64", **ref_kw)
    nat, nat_lse = attention_ref(q, k, v, mode="native", **ref_kw)
    checks = [("O", out, ref, nat), ("LSE", lse, ref_lse, nat_lse)]
    if cfg["bwd"]:
        dout = torch.randn(out.shape, generator=gen, device=DEVICE).to(out.dtype)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        grads64 = torch.autograd.grad(ref, (q, k, v), dout.double())
        grads_nat = torch.autograd.grad(nat, (q, k, v), dout)
        checks += [(n, g, r, a) for n, g, r, a in zip(("dQ", "dK", "dV"), grads, grads64,
                                                        grads_nat)]
    missed = []
    for name, got, ref64, native in checks:
        if name == "LSE":
            res = tolerance_check(got, ref64, native, atol=1e-4)
        else:
            # The rule's own rounding allowance, plus the floor scaled to the reference.
            base = tolerance_check(got, ref64, native)
            res = tolerance_check(got, ref64, native, atol=base.atol + _floor(ref64, q.dtype))
        if not res.ok:
            missed.append(f"{name} err {res.err:.2e} native {res.err_native:.2e} "
                          f"atol {res.atol:.1e}")
    return missed


def _axes(cfg: dict) -> list:
    scales = [f"scales={cfg['scales']}"] if cfg["dtype"] == "e4m3" else []
    return scales + [f"dtype={cfg['dtype']}", f"hdim={cfg['hdim']}/{cfg['hdim_v']}",
            f"group={cfg['group']}", "varlen" if cfg["varlen"] else "padded",
            "causal" if cfg["causal"] else ("window" if cfg["window"] != (None, None) else "full"),
            "softcap" if cfg["softcap"] else "no softcap",
            ("bwd det" if cfg["deterministic"] else "bwd") if cfg["bwd"] else "fwd only"]


def _run_shard(args, shard: int, shards: int) -> dict:
    """Configs i with i % shards == shard of the seeded sequence (the same configs whatever
    the number of shards)."""
    rng = random.Random(args.seed)
    counts, misses, crashes, done = collections.Counter(), [], [], 0
    deadline = time.time() + args.minutes * 60 if args.minutes else None
    for i in range(args.configs):
        cfg = draw(rng, args.arch)
        if i % shards != shard or (args.only and i not in args.only):
            continue
        if deadline and time.time() > deadline:
            break
        counts.update(_axes(cfg))
        done += 1
        try:
            missed = run_config(cfg, args.seed * 1_000_003 + i)
        except Exception as exc:  # noqa: BLE001 - every exception is a finding
            crashes.append((i, cfg, repr(exc)))
            fatal = "CUDA error" in str(exc) or "illegal memory" in str(exc)
            print(f"[{i}] {'CUDA ERROR, stopping' if fatal else 'CRASH'}: {exc!r}\n  {cfg}",
                  file=sys.stderr, flush=True)
            if fatal:
                break
            continue
        if missed:
            misses.append((i, cfg, missed))
            print(f"[{i}] MISS {missed}\n  {cfg}", file=sys.stderr, flush=True)
    return {"configs": done, "misses": misses, "crashes": crashes, "axes": counts}


def _run_workers(args) -> dict:
    """One process per shard (CUDA and the DSL's compiler want processes, not threads);
    the disk cache makes a kernel two shards need compile once."""
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for j in range(args.workers):
            path = os.path.join(tmp, f"shard{j}.json")
            cmd = [sys.executable, __file__, "--configs", str(args.configs), "--seed",
                   str(args.seed), "--arch", args.arch, "--shard", f"{j}/{args.workers}",
                   "--minutes", str(args.minutes), "--only", ",".join(map(str, args.only)),
                   "--json", path]
            procs.append((subprocess.Popen(cmd), path))
        total = {"configs": 0, "misses": [], "crashes": [], "axes": collections.Counter()}
        for j, (proc, path) in enumerate(procs):
            proc.wait()
            if not os.path.exists(path):
                total["crashes"].append((None, f"shard {j}", f"exit status {proc.returncode}"))
                continue
            with open(path) as f:
                part = json.load(f)
            total["configs"] += part["configs"]
            total["misses"] += part["misses"]
            total["crashes"] += part["crashes"]
            total["axes"].update(part["axes"])
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", default="hopper", choices=("hopper", "ampere"))
    p.add_argument("--workers", type=int, default=1,
                   help="processes, each running every WORKERS-th config")
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)
    p.add_argument("--minutes", type=float, default=0,
                   help="stop starting configs after this long (0: no limit)")
    p.add_argument("--only", default="", help="comma-separated config indices to rerun")
    p.add_argument("--json", default=None)
    p.add_argument("--index-contents", type=int, default=0,
                   help="run N cases of bench/fuzz_index.py (bad index contents) instead")
    args = p.parse_args()
    if args.index_contents:
        cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "fuzz_index.py"),
               "--cases", str(args.index_contents), "--seed", str(args.seed)]
        return subprocess.call(cmd + (["--json", args.json] if args.json else []))
    args.only = {int(i) for i in args.only.split(",") if i}
    start = time.time()
    if args.shard:
        shard, shards = map(int, args.shard.split("/"))
        result = _run_shard(args, shard, shards)
    elif args.workers > 1:
        result = _run_workers(args)
    else:
        result = _run_shard(args, 0, 1)
    if not args.shard:
        print(f"fuzz --seed {args.seed} --arch {args.arch} --configs {args.configs}: "
              f"{result['configs']} configs run in {time.time() - start:.0f} s, "
              f"{len(result['misses'])} misses, {len(result['crashes'])} crashes", flush=True)
        print("  " + ", ".join(f"{k}: {n}" for k, n in sorted(result["axes"].items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(result, seed=args.seed, arch=args.arch), f, indent=1, default=str)
    return 1 if result["misses"] or result["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
