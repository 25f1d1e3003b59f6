"""The first call's time: a cold compile, a disk-cache hit, and processes that start together.

    python bench/first_call.py [--hdim 128] [--seqlen 1024] [--processes 8] [--no-fa4]

Each measurement runs in a fresh process with `cutlass` and `flash_cute` already imported (and
torch's autograd warmed by a tiny backward: torch's first one imports sympy, seconds that belong
to neither library), and times the first forward and the first backward (to a synchronize) of
a causal bf16 problem:

* cold: an empty cache folder (`FLASH_CUTE_CACHE_DIR`), so every kernel compiles;
* hit: the folder the cold run filled, so every kernel loads from disk;
* FA4 cold (`flash_attn.cute`, its own cache off, as it ships), in the same run, and its
  disk hit with its opt-in cache on;
* N processes started together on another empty folder: how many kernels each compiled and
  loaded (the sum of compiles should be the number of distinct kernels).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time
import cutlass, torch
which, hdim, seqlen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if which == "fa4":
    from flash_attn.cute import flash_attn_func as attn
else:
    import flash_cute
    from flash_cute.runtime import jit
    attn = flash_cute.flash_attn_func
q, k, v = (torch.randn(1, seqlen, 2048 // hdim, hdim, device="cuda", dtype=torch.bfloat16,
                       requires_grad=True) for _ in range(3))
# torch's own first backward with a gradient argument imports sympy (seconds, whatever the
# library): done first, so the times below are the library's.
(torch.ones(2, device="cuda", requires_grad=True) * 2).backward(torch.ones(2, device="cuda"))
torch.cuda.synchronize()
t0 = time.perf_counter()
out = attn(q, k, v, causal=True)
out = out[0] if isinstance(out, tuple) else out
torch.cuda.synchronize()
t1 = time.perf_counter()
out.backward(torch.ones_like(out))
torch.cuda.synchronize()
t2 = time.perf_counter()
ref = torch.nn.functional.scaled_dot_product_attention(
    *(t.detach().float().transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
row = {"fwd_s": t1 - t0, "bwd_s": t2 - t1,
       "max_err": (out.detach().float() - ref).abs().max().item()}
if which != "fa4":
    store = jit.compile_cache.store
    row.update(built=store.built if store else None, loaded=store.loaded if store else None)
print("@@" + json.dumps(row))
"""


def run_child(which: str, args, cache: str, fa4_cache: str = "") -> dict:
    env = {**os.environ, "FLASH_CUTE_CACHE_DIR": cache}
    if fa4_cache:
        env.update(FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1",
                   FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=fa4_cache)
    proc = subprocess.run([sys.executable, "-c", _CHILD, which, str(args.hdim), str(args.seqlen)],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        return {"error": proc.stderr[-1500:]}
    return json.loads(next(ln[2:] for ln in proc.stdout.splitlines() if ln.startswith("@@")))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--no-fa4", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache, crowd = os.path.join(tmp, "cache"), os.path.join(tmp, "crowd")
        rows = {"flash_cute cold": run_child("ours", args, cache),
                "flash_cute disk hit": run_child("ours", args, cache)}
        if not args.no_fa4:
            rows["fa4 cold"] = run_child("fa4", args, cache)
            fa4_cache = os.path.join(tmp, "fa4")
            run_child("fa4", args, cache, fa4_cache)
            rows["fa4 disk hit (its cache on)"] = run_child("fa4", args, cache, fa4_cache)
        env = {**os.environ, "FLASH_CUTE_CACHE_DIR": crowd}
        procs = [subprocess.Popen([sys.executable, "-c", _CHILD, "ours", str(args.hdim),
                                   str(args.seqlen)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
                 for _ in range(args.processes)]
        crowd_rows = []
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            line = next((ln[2:] for ln in out.splitlines() if ln.startswith("@@")), None)
            crowd_rows.append(json.loads(line) if line else {"error": err[-500:]})
    print("| run | first fwd s | first bwd s | compiled | loaded | max err vs fp32 |\n"
          "|---|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | error: {row['error'][-200:]!r} | | | |")
            continue
        print(f"| {name} | {row['fwd_s']:.3f} | {row['bwd_s']:.3f} | {row.get('built', '')} | "
              f"{row.get('loaded', '')} | {row['max_err']:.1e} |")
    ok = [r for r in crowd_rows if "error" not in r]
    print(f"\n{args.processes} processes together: compiled {[r['built'] for r in ok]}, "
          f"loaded {[r['loaded'] for r in ok]}, errors {len(crowd_rows) - len(ok)}; "
          f"first fwd+bwd s {[round(r['fwd_s'] + r['bwd_s'], 2) for r in ok]}")


if __name__ == "__main__":
    main()
