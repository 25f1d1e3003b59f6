"""Cross-compiling registered kernels for any arch, with no GPU.

CuTe DSL reads its target arch once, when `cutlass` is imported, and `cute.compile` is not
thread-safe, so each arch gets its own worker process (``CUTE_DSL_ARCH`` set in its
environment) that compiles that arch's configs one after another and reports one JSON line per
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


def _artifact_stem(index: int, cfg: KernelConfig) -> str:
    return f"{index:03d}-{cfg.kernel.replace('.', '_')}"


def _worker_env(arch: str, dump_dir: Path) -> dict:
    env = dict(os.environ)
    env["CUTE_DSL_ARCH"] = arch
    env["CUTE_DSL_DUMP_DIR"] = str(dump_dir)
    env.pop("CUTE_DSL_KEEP", None)
    return env


def _run_worker(arch: str, indices: list, out_dir: Path, timeout: float) -> list:
    arch_dir = out_dir / arch
    arch_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flash_cute.xcompile", "--arch", arch, "--out", str(arch_dir),
           "--index", ",".join(map(str, indices))]
    proc = subprocess.run(cmd, env=_worker_env(arch, arch_dir), capture_output=True, text=True,
                          timeout=timeout)
    results = [json.loads(line[len(_MARK):]) for line in proc.stdout.splitlines()
               if line.startswith(_MARK)]
    done = {r["index"] for r in results}
    for i in indices:
        if i not in done:
            tail = (proc.stderr or proc.stdout)[-2000:]
            results.append({"index": i, "arch": arch, "error": f"worker exited {proc.returncode}: {tail}"})
    return results


def cross_compile(configs=None, archs=None, out_dir=None, jobs=None, timeout=1800.0) -> list:
    """Compile `configs` (default: all registered) for each of `archs` that they list.

    Returns one dict per (config, arch): kernel, arch, config, registers, smem_bytes,
    spill_bytes, sass (opcode counts), artifacts (paths of .ptx/.cubin/.sass), or error.
    """
    configs = list(CONFIGS if configs is None else configs)
    index_of = {cfg: CONFIGS.index(cfg) for cfg in configs}
    archs = list(archs or sorted({a for cfg in configs for a in cfg.archs}))
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="flash_cute_xcompile_"))
    work = [(a, [index_of[c] for c in configs if a in c.archs]) for a in archs]
    work = [(a, idx) for a, idx in work if idx]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work) or 1))
    with ThreadPoolExecutor(jobs) as pool:
        batches = list(pool.map(lambda w: _run_worker(w[0], w[1], out_dir, timeout), work))
    results = [r for batch in batches for r in batch]
    for r in results:
        cfg = CONFIGS[r["index"]]
        r.setdefault("kernel", cfg.kernel)
        r.setdefault("config", cfg.config_dict())
    order = {a: i for i, a in enumerate(archs)}
    return sorted(results, key=lambda r: (r["kernel"], r["index"], order[r["arch"]]))


def compile_for_arch(cfg: KernelConfig, arch: str, out_dir=None):
    """PTX (str), cubin (bytes) and SASS (str) of one registered config for `arch`."""
    (result,) = cross_compile([cfg], [arch], out_dir=out_dir)
    if "error" in result:
        raise RuntimeError(f"{cfg.kernel} [{cfg.label}] for {arch}: {result['error']}")
    paths = result["artifacts"]
    return Artifacts(ptx=Path(paths["ptx"]).read_text(), cubin=Path(paths["cubin"]).read_bytes(),
                     sass=Path(paths["sass"]).read_text())


def _compile_one(index: int, arch: str, out: Path) -> dict:
    cfg = CONFIGS[index]
    spec = cfg.builder(cfg)
    art = compile_with_artifacts(spec)
    stem = out / _artifact_stem(index, cfg)
    paths = {"ptx": str(stem) + ".ptx", "cubin": str(stem) + ".cubin", "sass": str(stem) + ".sass"}
    Path(paths["ptx"]).write_text(art.ptx)
    Path(paths["cubin"]).write_bytes(art.cubin)
    Path(paths["sass"]).write_text(art.sass)
    result = {"index": index, "kernel": cfg.kernel, "arch": arch, "config": cfg.config_dict()}
    result.update(art.summary(spec.dynamic_smem_bytes))
    result.update(spec.extra)
    result["artifacts"] = paths
    return result


def _worker_main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="flash_cute cross-compile worker (one arch)")
    parser.add_argument("--arch", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--index", required=True, help="comma-separated registry indices")
    args = parser.parse_args(argv)
    if os.environ.get("CUTE_DSL_ARCH") != args.arch:
        print("CUTE_DSL_ARCH must equal --arch in a worker", file=sys.stderr)
        return 2
    for index in map(int, args.index.split(",")):
        try:
            result = _compile_one(index, args.arch, Path(args.out))
        except Exception as exc:  # reported per config; the other configs still compile
            result = {"index": index, "arch": args.arch,
                      "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"}
        print(_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
