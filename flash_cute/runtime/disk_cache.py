"""The persistent JIT cache: compiled kernels (and `inspect`'s cross-compile results) on disk,
shared by every process of a machine.

Where: ``$FLASH_CUTE_CACHE_DIR``, else ``$XDG_CACHE_HOME/flash-cute`` (``~/.cache/flash-cute``);
``FLASH_CUTE_CACHE=0`` turns it off. Entries live under a fingerprint of everything that
decides the machine code besides the compile key: every source file of flash_cute and
flash_cute.arch, and the versions of Python, cutlass-dsl, apache-tvm-ffi and torch. A change to
any of them starts a new fingerprint folder; the old one is stale (`cache clear --stale`).

A kernel is one object file (the TVM-FFI function `export_to_c` writes) named by a hash of its
compile key and options. Writers hold a per-entry file lock from the check to the rename of the
finished file into place, so processes that need the same kernel at the same time compile it
once (the others wait, then load it); readers need no lock, since an entry appears whole or
not at all. An entry that fails to load (truncated, or from an incompatible build) is compiled
again and replaced.
"""

import hashlib
import json
import os
import shutil
import sys
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

ENV_DIR = "FLASH_CUTE_CACHE_DIR"
ENV_SWITCH = "FLASH_CUTE_CACHE"
# A compile that takes longer than this under another process's lock is done again here
# rather than waited for (the entry is then written by whichever finishes first).
LOCK_TIMEOUT_S = 900.0
_EXPORTED_NAME = "func"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def cache_root() -> Path:
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "flash-cute"


def _versions() -> dict:
    """The toolchain's versions, from the modules themselves (each is imported by the time a
    kernel is compiled or loaded; reading the installed metadata instead costs milliseconds)."""
    import cutlass
    import torch
    import tvm_ffi

    return {"nvidia-cutlass-dsl": cutlass.__version__, "apache-tvm-ffi": tvm_ffi.__version__,
            "torch": torch.__version__}


def source_files() -> list:
    """Every source file of flash_cute and flash_cute.arch (each once, whatever the layout:
    an install maps arch/ to flash_cute.arch, a copied tree holds it inside flash_cute/)."""
    import importlib.util

    package = importlib.util.find_spec("flash_cute").submodule_search_locations
    arch = importlib.util.find_spec("flash_cute.arch").submodule_search_locations
    roots = {os.path.realpath(p) for p in [*package, *arch]}
    found = set()
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            found.update(os.path.join(folder, f) for f in files if f.endswith(".py"))
    return sorted(Path(p) for p in found)


@lru_cache(maxsize=None)
def fingerprint() -> str:
    """What, besides a compile key, decides the machine code: the package's sources and the
    versions of the toolchain that compiles them (once per process)."""
    h = hashlib.sha256()
    h.update(f"python {sys.version_info[0]}.{sys.version_info[1]}\n".encode())
    for dist, version in _versions().items():
        h.update(f"{dist} {version}\n".encode())
    for path in source_files():
        data = path.read_bytes()
        h.update(f"{path.name} {len(data)}\n".encode())
        h.update(data)
    return h.hexdigest()[:24]


def entry_name(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _lock(path: Path):
    from filelock import FileLock

    return FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` then rename into place: a reader sees the whole entry or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if tmp.stat().st_size == 0:
            raise OSError(f"empty cache entry {tmp}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class KernelStore:
    """Compiled TVM-FFI functions on disk, one object file per (compile key, options)."""

    def __init__(self, folder: Path):
        self.folder = folder
        # What this process did: kernels it compiled (and wrote), and kernels it loaded.
        self.built = self.loaded = 0

    @classmethod
    def default(cls) -> Optional["KernelStore"]:
        """The store of this fingerprint, or None when the cache is off or cannot be made."""
        if not enabled():
            return None
        folder = cache_root() / fingerprint() / "kernels"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        return cls(folder)

    def path(self, text: str) -> Path:
        return self.folder / f"{entry_name(text)}.o"

    def load(self, text: str):
        """The cached function, or None (absent, or unloadable: then it is rebuilt)."""
        path = self.path(text)
        if not path.exists():
            return None
        try:
            import cutlass.cute as cute

            module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
            return getattr(module, _EXPORTED_NAME)
        except Exception:  # noqa: BLE001 - any failure to load makes it a miss
            return None

    def get_or_build(self, text: str, build: Callable):
        """The function for `text` (a compile key and its options): from disk, or built by
        `build()` and written, once across processes."""
        found = self.load(text)
        if found is None:
            from filelock import Timeout

            path = self.path(text)
            try:
                with _lock(path):
                    found = self.load(text)
                    if found is None:
                        self.built += 1
                        compiled = build()
                        self.store(path, compiled, text)
                        return compiled
            except Timeout:
                self.built += 1
                return build()
        self.loaded += 1
        return found

    def store(self, path: Path, compiled, text: str) -> None:
        """Write `compiled` (a TVM-FFI compiled function) and a note of its key; a failed
        write leaves no entry (the kernel still runs from memory)."""
        try:
            _atomic_write(path, lambda tmp: compiled.export_to_c(
                object_file_path=str(tmp), function_name=_EXPORTED_NAME))
            path.with_suffix(".key").write_text(text + "\n")
        except Exception:  # noqa: BLE001 - the cache is an optimization
            return


class ResultStore:
    """`inspect`'s cross-compile results on disk: per (target, config) its summary (JSON) and
    its PTX, cubin and SASS."""

    ARTIFACTS = ("ptx", "cubin", "sass")

    def __init__(self, folder: Path):
        self.folder = folder

    @classmethod
    def default(cls, target: str) -> Optional["ResultStore"]:
        if not enabled():
            return None
        folder = cache_root() / fingerprint() / "inspect" / target
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        return cls(folder)

    def stem(self, text: str) -> Path:
        return self.folder / entry_name(text)

    def load(self, text: str) -> Optional[dict]:
        """The summary and artifact paths of a config compiled before, or None."""
        stem = self.stem(text)
        summary = stem.with_suffix(".json")
        paths = {kind: str(stem.with_suffix("." + kind)) for kind in self.ARTIFACTS}
        if not summary.exists() or not all(os.path.exists(p) for p in paths.values()):
            return None
        try:
            result = json.loads(summary.read_text())
        except (OSError, ValueError):
            return None
        result["artifacts"] = paths
        return result

    def store(self, text: str, result: dict, artifacts: dict) -> None:
        """`artifacts`: kind -> a file to copy in; the summary goes last, so an entry with a
        summary is whole."""
        stem = self.stem(text)
        try:
            with _lock(stem):
                for kind in self.ARTIFACTS:
                    _atomic_write(stem.with_suffix("." + kind),
                                  lambda tmp, src=artifacts[kind]: shutil.copyfile(src, tmp))
                body = {k: v for k, v in result.items() if k != "artifacts"}
                _atomic_write(stem.with_suffix(".json"),
                              lambda tmp: tmp.write_text(json.dumps(body)))
        except Exception:  # noqa: BLE001 - the cache is an optimization
            return


def info() -> dict:
    """What the cache holds: its folder, this build's fingerprint, and per fingerprint folder
    its kernels, inspect results and bytes."""
    root = cache_root()
    out = {"root": str(root), "enabled": enabled(), "fingerprint": fingerprint(), "folders": []}
    if not root.exists():
        return out
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files = [p for p in folder.rglob("*") if p.is_file()]
        out["folders"].append({
            "fingerprint": folder.name, "current": folder.name == fingerprint(),
            "kernels": sum(p.suffix == ".o" for p in files),
            "inspect_results": sum(p.suffix == ".json" for p in files),
            "bytes": sum(p.stat().st_size for p in files)})
    return out


def clear(stale_only: bool = False) -> int:
    """Remove every fingerprint folder (or only those of other builds); returns how many."""
    root = cache_root()
    if not root.exists():
        return 0
    removed = 0
    for folder in root.iterdir():
        if folder.is_dir() and not (stale_only and folder.name == fingerprint()):
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    return removed
