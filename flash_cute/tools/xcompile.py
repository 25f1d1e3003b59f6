"""Cross-compiling registered kernels for any SM target, with no GPU.

CuTe DSL reads its target once, when `cutlass` is imported, and `cute.compile` is not
thread-safe, so each target gets its own worker process (``CUTE_DSL_ARCH`` set in its
environment) that compiles that target's configs one after another and reports one JSON line per
config. This module imports no CuTe DSL itself; only the workers do.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from flash_cute.runtime.disk_cache import ResultStore
from flash_cute.tools.kernel_config import CompileSpec, KernelConfig
from flash_cute.tools.registry import CONFIGS

_MARK = "@@flash_cute_result@@ "


@dataclass
class Artifacts:
    ptx: str
    cubin: bytes
    sass: str

    def summary(self, dynamic_smem_bytes: int = 0) -> dict:
        """registers / smem_bytes / spill_bytes of the main kernel, and SASS opcode counts."""
        from flash_cute.tools.sass import kernel_resources, opcode_counts

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

    from flash_cute.runtime.jit import compile_record, fake_stream

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


def result_key(entry: KernelConfig, target: str) -> str:
    """What names a cross-compile result in the disk cache (whose folder already holds the
    fingerprint of the sources and toolchain)."""
    builder = f"{entry.builder.__module__}.{entry.builder.__qualname__}"
    return json.dumps([entry.kernel, target, entry.config_dict(), builder], sort_keys=True)


def _worker_env(target: str, dump_dir: Path) -> dict:
    env = dict(os.environ)
    env["CUTE_DSL_ARCH"] = target
    env["CUTE_DSL_DUMP_DIR"] = str(dump_dir)
    env.pop("CUTE_DSL_KEEP", None)
    return env


def _run_worker(target: str, indices: list, out_dir: Path, timeout: float, done) -> list:
    """One worker process for `target`; `done(result)` as each config finishes."""
    target_dir = out_dir / target
    target_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flash_cute.tools.xcompile", "--target", target, "--out",
           str(target_dir), "--index", ",".join(map(str, indices))]
    results, lines = [], []
    with subprocess.Popen(cmd, env=_worker_env(target, target_dir), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith(_MARK):
                    results.append(json.loads(line[len(_MARK):]))
                    done(results[-1])
                else:
                    lines.append(line)
        finally:
            timer.cancel()
    finished = {r["index"] for r in results}
    for i in indices:
        if i not in finished:
            tail = "".join(lines)[-2000:]
            results.append({"index": i, "target": target,
                            "error": f"worker exited {proc.returncode}: {tail}"})
            done(results[-1])
    return results


def _cached(entry: KernelConfig, index: int, target: str, out_dir) -> Optional[dict]:
    """A result of this build compiled before (its artifacts copied into `out_dir` when
    given), or None."""
    store = ResultStore.default(target)
    found = store.load(result_key(entry, target)) if store else None
    if found is None:
        return None
    if out_dir is not None:
        stem = Path(out_dir) / target / _artifact_stem(index, entry)
        stem.parent.mkdir(parents=True, exist_ok=True)
        for kind, src in list(found["artifacts"].items()):
            found["artifacts"][kind] = shutil.copyfile(src, f"{stem}.{kind}")
    found.update(index=index, kernel=entry.kernel, target=target, config=entry.config_dict(),
                 cached=True)
    return found


def cross_compile(configs=None, targets=None, out_dir=None, jobs=None, timeout=1800.0,
                  progress: Optional[Callable] = None) -> list:
    """Compile `configs` (default: all registered) for each of `targets` that they list.

    Returns one dict per (config, target): kernel, target, config, registers, smem_bytes,
    spill_bytes, sass (opcode counts), artifacts (paths of .ptx/.cubin/.sass: under `out_dir`
    when given, else in the disk cache), cached (found there), or error. What the disk cache
    holds for this build is not compiled again; the misses go to one worker per target, in
    parallel. `progress(result)` is called as each result arrives.
    """
    configs = list(CONFIGS if configs is None else configs)
    index_of = {entry: CONFIGS.index(entry) for entry in configs}
    targets = list(targets or sorted({a for entry in configs for a in entry.targets}))
    report = progress or (lambda result: None)
    results, work = [], []
    for target in targets:
        misses = []
        for entry in configs:
            if target not in entry.targets:
                continue
            found = _cached(entry, index_of[entry], target, out_dir)
            if found is None:
                misses.append(index_of[entry])
            else:
                results.append(found)
                report(found)
        if misses:
            work.append((target, misses))
    lock = threading.Lock()

    def done(result):
        with lock:
            report(result)

    with tempfile.TemporaryDirectory(prefix="flash_cute_xcompile_") as scratch:
        base = Path(out_dir) if out_dir is not None else Path(scratch)
        jobs = max(1, min(jobs or os.cpu_count() or 1, len(work) or 1))
        with ThreadPoolExecutor(jobs) as pool:
            batches = list(pool.map(lambda w: _run_worker(w[0], w[1], base, timeout, done),
                                    work))
        if out_dir is None:
            for r in (r for batch in batches for r in batch):
                _point_into_cache(r)
    results += [r for batch in batches for r in batch]
    for r in results:
        entry = CONFIGS[r["index"]]
        r.setdefault("kernel", entry.kernel)
        r.setdefault("config", entry.config_dict())
    order = {a: i for i, a in enumerate(targets)}
    return sorted(results, key=lambda r: (r["kernel"], r["index"], order[r["target"]]))


def _point_into_cache(result: dict) -> None:
    """A scratch result's artifacts, which go with the scratch folder: their copies in the disk
    cache, or none."""
    if "artifacts" not in result:
        return
    entry = CONFIGS[result["index"]]
    store = ResultStore.default(result["target"])
    found = store.load(result_key(entry, result["target"])) if store else None
    if found is None:
        result.pop("artifacts")
    else:
        result["artifacts"] = found["artifacts"]


def compile_for_target(entry: KernelConfig, target: str, out_dir=None):
    """PTX (str), cubin (bytes) and SASS (str) of one registered config for `target`."""
    with tempfile.TemporaryDirectory(prefix="flash_cute_xcompile_") as scratch:
        (result,) = cross_compile([entry], [target], out_dir=out_dir or scratch)
        if "error" in result:
            raise RuntimeError(f"{entry.kernel} [{entry.label}] for {target}: "
                               f"{result['error']}")
        paths = result["artifacts"]
        return Artifacts(ptx=Path(paths["ptx"]).read_text(),
                         cubin=Path(paths["cubin"]).read_bytes(),
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
    result = {"index": index, "kernel": entry.kernel, "target": target,
              "config": entry.config_dict()}
    result.update(art.summary(spec.dynamic_smem_bytes))
    result.update(spec.extra)
    describe = getattr(spec.fn, "pipeline", None)
    if describe is not None:
        result["pipeline"] = describe().to_dict()
    store = ResultStore.default(target)
    if store is not None:
        store.store(result_key(entry, target), result, paths)
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
