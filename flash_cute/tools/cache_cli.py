"""`python -m flash_cute cache info|clear|warm`: the persistent JIT cache (`disk_cache`).

``warm`` compiles the attention kernels of a set of configurations into the cache ahead of
time, for a GPU's target or any other (``--target sm_90a`` on a machine without one: the
kernels are compiled for that target against meta tensors and launched nowhere), so that a
deployment, or eight processes of one training job, start with every kernel they need on disk.
The cache folder (``FLASH_CUTE_CACHE_DIR``) can then be shipped as is.
"""

import itertools
import json
import os
import subprocess
import sys

_DTYPES = ("bf16", "fp16")


def add_arguments(parser):
    sub = parser.add_subparsers(dest="cache_command", required=True)
    sub.add_parser("info", help="where the cache is and what it holds")
    clear = sub.add_parser("clear", help="remove cached kernels and inspect results")
    clear.add_argument("--stale", action="store_true",
                       help="only those of other builds (other sources or toolchain versions)")
    warm = sub.add_parser("warm", help="compile attention kernels into the cache ahead of time")
    warm.add_argument("--arch", default=None, help="pipeline (default: the target's own)")
    warm.add_argument("--target", default=None,
                      help="SM target (default: this machine's GPU), e.g. sm_90a")
    warm.add_argument("--hdim", default="64,128", help="head dims (hdim_v = hdim)")
    warm.add_argument("--dtype", default="bf16", choices=_DTYPES + ("both",))
    warm.add_argument("--causal", default="both", choices=("0", "1", "both"))
    warm.add_argument("--direction", default="both", choices=("fwd", "bwd", "both"))
    warm.add_argument("--varlen", action="store_true", help="the packed (cu_seqlens) layout")
    warm.add_argument("--gqa", type=int, default=1, metavar="G",
                      help="query heads per K/V head (GQA: dK/dV per query head, summed)")
    warm.add_argument("--seqlen", type=int, default=4096,
                      help="a sequence length whose schedule is compiled (short causal "
                           "problems take their own tiles)")


def _pipeline_for(target: str):
    from flash_cute.runtime.dispatch import PIPELINES

    major = {"sm_80": 8, "sm_90a": 9, "sm_100a": 10}.get(target)
    for p in PIPELINES:
        if major is not None and p.runs_on(major) and p.hardware_tested:
            return p
    raise SystemExit(f"no pipeline runs on {target}")


def _warm_here(args, target: str) -> list:
    """Compile every selected configuration in this process (CUTE_DSL_ARCH = target)."""
    import torch

    from flash_cute.runtime.dispatch import pipeline_named
    from flash_cute.runtime.jit import compile_cache, compile_only
    from flash_cute.runtime.problem import validate_attention_inputs

    pipeline = pipeline_named(args.arch) if args.arch else _pipeline_for(target)
    dtypes = _DTYPES if args.dtype == "both" else (args.dtype,)
    causals = (False, True) if args.causal == "both" else (args.causal == "1",)
    done = []
    for hdim, dtype, causal in itertools.product(
            [int(h) for h in args.hdim.split(",")], dtypes, causals):
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        heads_kv = 2
        lead = (2 * args.seqlen,) if args.varlen else (2, args.seqlen)
        q = torch.empty(*lead, heads_kv * args.gqa, hdim, dtype=torch_dtype, device="meta")
        k = torch.empty(*lead, heads_kv, hdim, dtype=torch_dtype, device="meta")
        kw = {}
        if args.varlen:
            cu = torch.tensor([0, args.seqlen, 2 * args.seqlen], dtype=torch.int32)
            kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=args.seqlen,
                      max_seqlen_k=args.seqlen)
        problem = validate_attention_inputs(q, k, k, causal=causal, require_cuda=False, **kw)
        cu_q, cu_k = kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")
        before = len(compile_cache)
        with compile_only():
            out, lse = pipeline.forward(q, k, k, problem, cu_q, cu_k, None, None)
            if args.direction in ("bwd", "both"):
                pipeline.backward(out, None, q, k, k, out, lse, problem, cu_q, cu_k)
        done.append({"pipeline": pipeline.name, "target": target, "hdim": hdim, "dtype": dtype,
                     "causal": causal, "kernels": len(compile_cache) - before})
    return done


def _warm_argv(args, target: str) -> list:
    argv = ["--target", target, "--hdim", args.hdim, "--dtype", args.dtype, "--causal",
            args.causal, "--direction", args.direction, "--gqa", str(args.gqa), "--seqlen",
            str(args.seqlen)]
    return argv + (["--arch", args.arch] if args.arch else []) + (["--varlen"] if args.varlen
                                                                  else [])


def run(args) -> int:
    from flash_cute.runtime import disk_cache

    if args.cache_command == "info":
        print(json.dumps(disk_cache.info(), indent=1))
        return 0
    if args.cache_command == "clear":
        n = disk_cache.clear(stale_only=args.stale)
        print(f"removed {n} folder{'s' * (n != 1)} from {disk_cache.cache_root()}")
        return 0
    if not disk_cache.enabled():
        print(f"the cache is off ({disk_cache.ENV_SWITCH}=0): nothing to warm", file=sys.stderr)
        return 2
    target = args.target or os.environ.get("CUTE_DSL_ARCH")
    if target is None:
        import torch

        if not torch.cuda.is_available():
            print("no GPU here: name the target, e.g. --target sm_90a", file=sys.stderr)
            return 2
        from flash_cute.runtime.jit import current_target

        target = current_target()
    if os.environ.get("CUTE_DSL_ARCH") != target:
        # CuTe DSL fixes its target when cutlass is imported: warm in a process of its own.
        env = {**os.environ, "CUTE_DSL_ARCH": target}
        return subprocess.run([sys.executable, "-m", "flash_cute", "cache", "warm",
                               *_warm_argv(args, target)], env=env).returncode
    from flash_cute.runtime.jit import compile_cache

    for row in _warm_here(args, target):
        print(f"{row['pipeline']} {row['target']} {row['dtype']} hdim {row['hdim']} "
              f"causal={row['causal']}: {row['kernels']} kernel(s)")
    store = compile_cache.store
    print(f"compiled {store.built if store else 0}, loaded {store.loaded if store else 0}; "
          f"cache: {disk_cache.cache_root() / disk_cache.fingerprint()}")
    return 0
