"""Cross-compiling registered kernels for any SM target, with no GPU.

CuTe DSL reads its target once, when `cutlass` is imported, and `cute.compile` is not
thread-safe, so each target gets its own worker process (``CUTE_DSL_ARCH`` set in its
environment) that compiles that target's configs one after another and reports one JSON line per
config. This module imports no CuTe DSL itself; only the workers do.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from flash_cute.kernel_config import CompileSpec, KernelConfig
from flash_cute.registry import CONFIGS

_MARK = "@@flash_cute_result@@ "


@dataclass
class Artifacts:
    ptx: str
    cubin: bytes
    sass: str

    def summary(self, dynamic_smem_bytes: int = 0) -> dict:
        """registers / smem_bytes / spill_bytes of the main kernel, and SASS opcode counts."""
        from flash_cute.sass import kernel_resources, opcode_counts

        kernels = kernel_resources(self.cubin)
        main = max(kernels, key=lambda k: k.registers)
        return {
            "registers": main.registers,
            "smem_bytes": main.static_smem_bytes + dynamic_smem_bytes,
            "spill_bytes": main.frame_bytes,
            "sass": opcode_counts(self.sass),
        }


def compile_with_artifacts(spec: CompileSpec) -> Artifacts:
    """Compile `spec` for this process's target and keep PTX, cubin and SASS.

    SASS needs nvdisasm (pip nvidia-cuda-nvdisasm>=13.4) and is written only when the target
    equals CUTE_DSL_ARCH, which is why cross-compiles run one worker process per target.
    """
    import cutlass.cute as cute

    from flash_cute.jit import compile_record, fake_stream

    options = " ".join(filter(None, ["--keep-ptx --keep-cubin --keep-sass", spec.options]))
    if hasattr(spec.args, "_fields"):
        compiled = compile_record(spec.fn, spec.args, fake_stream(), options)
    else:
        compiled = cute.compile(spec.fn, *spec.args, options=options)
    art = compiled.artifacts
    if not art.CUBIN or not art.SASS:
        raise RuntimeError("compile produced no cubin/SASS: is nvidia-cuda-nvdisasm installed?")
    return Artifacts(ptx=art.PTX or "", cubin=art.CUBIN, sass=art.SASS)


def _artifact_stem(index: int, entry: KernelConfig) -> str:
    return f"{index:03d}-{entry.kernel.replace('.', '_')}"


def _worker_env(target: str, dump_dir: Path) -> dict:
    env = dict(os.environ)
    env["CUTE_DSL_ARCH"] = target
    env["CUTE_DSL_DUMP_DIR"] = str(dump_dir)
    env.pop("CUTE_DSL_KEEP", None)
    return env


def _run_worker(target: str, indices: list, out_dir: Path, timeout: float) -> list:
    target_dir = out_dir / target
    target_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flash_cute.xcompile", "--target", target, "--out",
           str(target_dir), "--index", ",".join(map(str, indices))]
    proc = subprocess.run(cmd, env=_worker_env(target, target_dir), capture_output=True, text=True,
                          timeout=timeout)
    results = [json.loads(line[len(_MARK):]) for line in proc.stdout.splitlines()
               if line.startswith(_MARK)]
    done = {r["index"] for r in results}
    for i in indices:
        if i not in done:
            tail = (proc.stderr or proc.stdout)[-2000:]
            results.append({"index": i, "target": target,
                            "error": f"worker exited {proc.returncode}: {tail}"})
    return results


def cross_compile(configs=None, targets=None, out_dir=None, jobs=None, timeout=1800.0) -> list:
    """Compile `configs` (default: all registered) for each of `targets` that they list.

    Returns one dict per (config, target): kernel, target, config, registers, smem_bytes,
    spill_bytes, sass (opcode counts), artifacts (paths of .ptx/.cubin/.sass), or error.
    """
    configs = list(CONFIGS if configs is None else configs)
    index_of = {entry: CONFIGS.index(entry) for entry in configs}
    targets = list(targets or sorted({a for entry in configs for a in entry.targets}))
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="flash_cute_xcompile_"))
    work = [(a, [index_of[c] for c in configs if a in c.targets]) for a in targets]
    work = [(a, idx) for a, idx in work if idx]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work) or 1))
    with ThreadPoolExecutor(jobs) as pool:
        batches = list(pool.map(lambda w: _run_worker(w[0], w[1], out_dir, timeout), work))
    results = [r for batch in batches for r in batch]
    for r in results:
        entry = CONFIGS[r["index"]]
        r.setdefault("kernel", entry.kernel)
        r.setdefault("config", entry.config_dict())
    order = {a: i for i, a in enumerate(targets)}
    return sorted(results, key=lambda r: (r["kernel"], r["index"], order[r["target"]]))


def compile_for_target(entry: KernelConfig, target: str, out_dir=None):
    """PTX (str), cubin (bytes) and SASS (str) of one registered config for `target`."""
    (result,) = cross_compile([entry], [target], out_dir=out_dir)
    if "error" in result:
        raise RuntimeError(f"{entry.kernel} [{entry.label}] for {target}: {result['error']}")
    paths = result["artifacts"]
    return Artifacts(ptx=Path(paths["ptx"]).read_text(), cubin=Path(paths["cubin"]).read_bytes(),
                     sass=Path(paths["sass"]).read_text())


def _compile_one(index: int, target: str, out: Path) -> dict:
    entry = CONFIGS[index]
    spec = entry.builder(entry)
    art = compile_with_artifacts(spec)
    stem = out / _artifact_stem(index, entry)
    paths = {"ptx": str(stem) + ".ptx", "cubin": str(stem) + ".cubin", "sass": str(stem) + ".sass"}
    Path(paths["ptx"]).write_text(art.ptx)
    Path(paths["cubin"]).write_bytes(art.cubin)
    Path(paths["sass"]).write_text(art.sass)
    result = {"index": index, "kernel": entry.kernel, "target": target, "config": entry.config_dict()}
    result.update(art.summary(spec.dynamic_smem_bytes))
    result.update(spec.extra)
    result["artifacts"] = paths
    return result


def _worker_main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="flash_cute cross-compile worker (one target)")
    parser.add_argument("--target", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--index", required=True, help="comma-separated registry indices")
    args = parser.parse_args(argv)
    if os.environ.get("CUTE_DSL_ARCH") != args.target:
        print("CUTE_DSL_ARCH must equal --target in a worker", file=sys.stderr)
        return 2
    for index in map(int, args.index.split(",")):
        try:
            result = _compile_one(index, args.target, Path(args.out))
        except Exception as exc:  # reported per config; the other configs still compile
            result = {"index": index, "target": args.target,
                      "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"}
        print(_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
