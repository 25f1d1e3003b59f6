"""The persistent JIT cache on the CPU: kernels compiled for a target (against meta tensors,
launched nowhere) go to disk, later processes load them, concurrent processes compile each
once, and a damaged entry is compiled again."""

import os
import re
import subprocess
import sys

import pytest

from flash_cute.runtime import disk_cache

WARM = [sys.executable, "-m", "flash_cute", "cache", "warm", "--target", "sm_90a", "--hdim",
        "64", "--causal", "1", "--direction", "fwd"]


def _warm(cache_dir, extra=()):
    env = {**os.environ, "FLASH_CUTE_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run(WARM + list(extra), capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    built, loaded = map(int, re.search(r"compiled (\d+), loaded (\d+)", proc.stdout).groups())
    return built, loaded


def _entries(cache_dir):
    return {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*.o")}


def test_a_later_process_loads_what_an_earlier_one_compiled(tmp_path):
    assert _warm(tmp_path) == (1, 0)
    first = _entries(tmp_path)
    assert len(first) == 1 and all(p.stat().st_size > 0 for p in first)
    assert _warm(tmp_path) == (0, 1)
    assert _entries(tmp_path) == first


def test_processes_that_need_the_same_kernel_compile_it_once(tmp_path):
    env = {**os.environ, "FLASH_CUTE_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen(WARM, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    counts = [tuple(map(int, re.search(r"compiled (\d+), loaded (\d+)", o).groups()))
              for o, _ in outs]
    assert sum(b for b, _ in counts) == 1 and sum(l for _, l in counts) == 3, counts


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path):
    _warm(tmp_path)
    (path,) = _entries(tmp_path)
    path.write_bytes(b"not an object file")
    assert _warm(tmp_path) == (1, 0)
    assert path.stat().st_size > 100
    assert _warm(tmp_path) == (0, 1)


def test_the_fingerprint_follows_the_sources_and_versions(monkeypatch):
    base = disk_cache.fingerprint()
    assert re.fullmatch(r"[0-9a-f]{24}", base)
    names = {p.name for p in disk_cache.source_files()}
    assert {"launch.py", "fwd.py", "bwd.py", "tma.py"} <= names
    disk_cache.fingerprint.cache_clear()
    monkeypatch.setattr(disk_cache, "_versions",
                        lambda: {"nvidia-cutlass-dsl": "0-other", "apache-tvm-ffi": "0",
                                 "torch": "0"})
    try:
        assert disk_cache.fingerprint() != base
    finally:
        disk_cache.fingerprint.cache_clear()


def test_the_cache_is_off_with_its_switch_and_moves_with_its_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path / "here"))
    assert disk_cache.cache_root() == tmp_path / "here"
    assert disk_cache.KernelStore.default().folder.is_dir()
    monkeypatch.setenv(disk_cache.ENV_SWITCH, "0")
    assert disk_cache.KernelStore.default() is None
    monkeypatch.delenv(disk_cache.ENV_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.cache_root() == tmp_path / "xdg" / "flash-cute"


@pytest.mark.parametrize("stale_only", [False, True])
def test_clear_removes_this_or_only_other_builds(monkeypatch, tmp_path, stale_only):
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path))
    (tmp_path / disk_cache.fingerprint() / "kernels").mkdir(parents=True)
    (tmp_path / ("0" * 24)).mkdir()
    removed = disk_cache.clear(stale_only=stale_only)
    left = {p.name for p in tmp_path.iterdir()}
    assert (removed, left) == ((1, {disk_cache.fingerprint()}) if stale_only else (2, set()))


def test_a_loaded_kernel_that_refuses_its_arguments_is_compiled_again(monkeypatch):
    """An entry that loads but whose function raises TypeError on the call (an incompatible
    build) is replaced by a kernel compiled in the process; a kernel compiled here that
    raises is not retried."""
    from flash_cute.runtime import jit

    calls = []

    def refuse(*args):
        raise TypeError("mismatched argument")

    class Store:
        loaded, built = 0, 0

        def get_or_build(self, text, build):
            self.loaded += 1
            return refuse

        def path(self, text):
            return None

        def store(self, path, compiled, text):
            calls.append("stored")

    cache = jit.CompileCache()
    cache._store, cache._store_ready = Store(), True
    monkeypatch.setattr(jit, "compile_cache", cache)
    key = jit.CompileKey("k", "sm_90a", "bf16", 64, 64, ())
    monkeypatch.setattr(jit.cute, "compile", lambda *a, **kw: lambda *v: calls.append(v))
    jit.launch_kernel(key, lambda: None, (1.0,))
    assert calls == ["stored", (1.0,)] and not cache.loaded_from_disk(key)
    with pytest.raises(TypeError):
        cache._entries[key] = refuse
        jit.launch_kernel(key, lambda: None, (1.0,))


_HIT_IMPORTS = r"""
import sys
from flash_cute.tools import cache_cli
p = __import__("argparse").ArgumentParser()
cache_cli.add_arguments(p)
args = p.parse_args(sys.argv[1:])
rows = cache_cli._warm_here(args, "sm_90a")
from flash_cute.runtime.jit import compile_cache
kernels = sorted(m for m in sys.modules if m in {
    "flash_cute.arch.hopper.fwd", "flash_cute.arch.hopper.bwd", "flash_cute.arch.hopper.dq_accum",
    "flash_cute.kernels.bwd_prep"})
print("@@", compile_cache.store.built, compile_cache.store.loaded, kernels)
"""


def test_a_disk_hit_imports_no_kernel_module(tmp_path):
    """A forward and backward whose four kernels all come from disk never import the CuTe DSL
    kernel modules (`launch.KernelRef`): they cost tens of milliseconds of the first call."""
    both = ["--direction", "both"]
    assert _warm(tmp_path, both)[0] == 4
    env = {**os.environ, "FLASH_CUTE_CACHE_DIR": str(tmp_path), "CUTE_DSL_ARCH": "sm_90a"}
    argv = WARM[4:] + both
    proc = subprocess.run([sys.executable, "-c", _HIT_IMPORTS, *argv], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("@@"))
    assert line == "@@ 0 4 []", line
