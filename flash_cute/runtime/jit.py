"""JIT layer: the compile cache, TVM-FFI launches, fake tensors for compiling without a GPU.

The cache key holds only what changes the generated code: kernel, SM target, dtype, head dims,
flags, schedule and a variant hash (score/mask mods). Batch and sequence lengths are never in it:
kernels take them as dynamic shapes, so a new length reuses the compiled kernel.
``cute.compile`` is not thread-safe, so compiles are serialized by a lock.
"""

import contextlib
import functools
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import torch

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32,
          "e4m3": cutlass.Float8E4M3FN, "e5m2": cutlass.Float8E5M2}


@dataclass(frozen=True)
class CompileKey:
    kernel: str
    target: str
    dtype: str
    hdim: Optional[int]
    hdim_v: Optional[int]
    schedule: tuple
    flags: tuple = ()
    variant: str = ""


def variant_hash(*objs) -> str:
    """Stable hash of user-supplied variant code (e.g. a score_mod's source), for CompileKey."""
    h = hashlib.sha256()
    for obj in objs:
        h.update(repr(obj).encode())
    return h.hexdigest()[:16]


class CompileCache:
    """Compiled kernels by CompileKey; `get` compiles on a miss, one compile at a time. Behind
    the in-memory table sits the persistent one (`disk_cache.KernelStore`): a miss here first
    looks on disk, and a kernel compiled here is written there."""

    def __init__(self):
        self._entries = {}
        self._lock = threading.Lock()
        self._store = None
        self._store_ready = False
        self._from_disk = set()
        # Bumped by `clear` and `rebuild`: a `KernelCall` holding an older function looks again.
        self.generation = 0

    def get(self, key: CompileKey, build: Callable[[], object], options: str = ""):
        hit = self._entries.get(key)
        if hit is not None:
            return hit
        with self._lock:
            if key not in self._entries:
                self._entries[key] = self._build(key, build, options)
            return self._entries[key]

    def _build(self, key, build, options: str):
        if not self._store_ready:
            from flash_cute.runtime.disk_cache import KernelStore

            self._store, self._store_ready = KernelStore.default(), True
        if self._store is None:
            return build()
        loaded = self._store.loaded
        compiled = self._store.get_or_build(f"{key!r} {options}", build)
        if self._store.loaded > loaded:
            self._from_disk.add(key)
        return compiled

    def loaded_from_disk(self, key: CompileKey) -> bool:
        return key in self._from_disk

    def rebuild(self, key: CompileKey, build: Callable[[], object], options: str = ""):
        """Compile `key` here and replace its disk entry (one that loaded but does not run)."""
        with self._lock:
            compiled = build()
            self._entries[key] = compiled
            self._from_disk.discard(key)
            self.generation += 1
            if self._store is not None:
                text = f"{key!r} {options}"
                self._store.store(self._store.path(text), compiled, text)
            return compiled

    @property
    def store(self):
        """The disk store behind this cache (None when the cache is off or not used yet)."""
        return self._store

    def clear(self):
        """Forget the compiled kernels of this process (the disk cache keeps them)."""
        with self._lock:
            self._entries.clear()
            self._from_disk.clear()
            self._store_ready = False
            self.generation += 1

    def __len__(self):
        return len(self._entries)

    def keys(self):
        return list(self._entries)


compile_cache = CompileCache()


def current_target() -> str:
    """The SM target of this process, for cache keys and target checks: CUTE_DSL_ARCH, else
    the current GPU's (sm_80 for any 8.x, sm_90a for 9.0, sm_100a for 10.0, the family
    target sm_100f for the rest of 10.x: sm_100a cubins do not load on 10.3)."""
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return env
    if not (torch.cuda.is_initialized() or torch.cuda.is_available()):
        raise RuntimeError("no CUDA GPU and CUTE_DSL_ARCH is unset: name a target to cross-compile")
    return _target_label(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _target_label(device_index: int) -> str:
    from flash_cute.runtime.device import device_capability

    major, minor = device_capability(device_index)
    return target_of(major, minor)


def target_of(major: int, minor: int) -> str:
    """The SM target the kernels of compute capability major.minor compile for."""
    if major == 10:
        return "sm_100a" if minor == 0 else "sm_100f"
    return {8: "sm_80", 9: "sm_90a"}.get(major, f"sm_{major}{minor}")


def dynamic_dim(divisibility: int = 1):
    """A run-time extent for fake tensors (batch, sequence length, ...)."""
    return cute.sym_int(divisibility=divisibility)


def fake_tensor(dtype, shape, align: int = 16):
    """Fake tensor with a unit last stride and dynamic other strides, for compiling without a
    GPU. `launch_kernel` compiles against the same fake tensors, so what cross-compiles
    here is what compiles at run time (nothing is known about the strides' divisibility)."""
    strides = tuple(cute.sym_int64() for _ in shape[:-1]) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, strides, assumed_align=align)


def fake_stream():
    return cute.runtime.make_fake_stream()


class TensorArg(NamedTuple):
    """A torch tensor argument of `launch_kernel`, with the byte alignment the kernel may
    assume of its data pointer (strides are compiled with no divisibility; a kernel that
    needs one asserts it, `layouts.assume_aligned_strides`)."""
    tensor: object
    align: int = 16


def tensor_arg(t, align: int = 16):
    return None if t is None else TensorArg(t, align)


_TORCH_TO_DSL = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
                 torch.float32: cutlass.Float32, torch.int32: cutlass.Int32,
                 torch.int64: cutlass.Int64, torch.uint8: cutlass.Uint8,
                 torch.float8_e4m3fn: cutlass.Float8E4M3FN, torch.float8_e5m2: cutlass.Float8E5M2}


def _value(arg):
    """What the compiled TVM-FFI function takes for it: the torch tensor (detached: DLPack
    refuses a tensor that requires grad, as autograd's inputs do), or the number itself."""
    if type(arg) is not TensorArg:
        return arg
    t = arg.tensor
    return t.detach() if t.requires_grad else t


_ENTRY_SOURCE = "def entry({params}, stream):\n    kernel(record({params}), stream)\n"


def record_entry(kernel, record_type):
    """A `@cute.jit` function taking `record_type`'s fields one by one, then the stream, that
    calls ``kernel(record_type(...), stream)``: what is compiled for a kernel whose `__call__`
    takes an argument record, so that its TVM-FFI function takes the fields themselves (a
    NamedTuple argument would be an ffi.Array built on every call). Written from the record's
    field names, it holds no control flow, so the DSL need not preprocess it."""
    if {"kernel", "record", "stream"} & set(record_type._fields):
        raise ValueError(f"{record_type.__name__}: a field may not be named kernel, record or "
                         "stream (the entry's own names)")
    params = ", ".join(record_type._fields)
    namespace = {"kernel": kernel, "record": record_type}
    exec(_ENTRY_SOURCE.format(params=params), namespace)
    return cute.jit(preprocess=False)(namespace["entry"])


def compile_record(kernel, record, stream, options: str = ""):
    """`cute.compile` of `kernel` for an argument record of fake tensors and DSL scalars
    (`record_entry`); the compiled function takes the record's fields, then the stream."""
    entry = record_entry(kernel, type(record))
    return cute.compile(entry, *record, stream, options=options)


class _ArgSpec(NamedTuple):
    """What `cute.compile` needs of a tensor launch argument: its dtype, rank and alignment."""
    dtype: object
    rank: int
    align: int

    def fake(self):
        return fake_tensor(_TORCH_TO_DSL[self.dtype],
                           tuple(dynamic_dim() for _ in range(self.rank)), align=self.align)


def _arg_spec(arg):
    """A launch argument's compile-time description: `_ArgSpec` for a `TensorArg`, the type of
    a float or int, or None."""
    if isinstance(arg, TensorArg):
        return _ArgSpec(arg.tensor.dtype, arg.tensor.dim(), arg.align)
    if isinstance(arg, bool) or not isinstance(arg, (int, float, type(None))):
        raise TypeError(f"launch argument {arg!r}: expected a TensorArg, float, int or None")
    return None if arg is None else type(arg)


def _fake(spec, example):
    if isinstance(spec, _ArgSpec):
        return spec.fake()
    return None if spec is None else (cutlass.Float32 if spec is float else cutlass.Int32)(example)


class KernelCall:
    """One kernel of one launch configuration: compiled (or loaded from the disk cache) at its
    first call, then its TVM-FFI function is called directly, with torch tensors and Python
    numbers, on the current torch stream. Per-call host work is what decides short calls, so
    everything a configuration fixes is worked out once, here and in `flash_cute.runtime.launch`.

    `args`: an argument record (`flash_cute.contract.kernel_args`) for a kernel whose `__call__`
    takes one, else a tuple of the arguments before the stream; each value a `TensorArg`, a Python
    float (a Float32 parameter), int (Int32) or None. They fix the compiled specs: dtypes,
    ranks and alignments (shapes and strides stay dynamic), which optional tensors are None,
    float against int; `key` must tell those apart. A call passes values in the same order
    (tensors detached where they require grad: DLPack refuses them)."""

    __slots__ = ("key", "options", "_make_kernel", "_specs", "_examples", "_record", "_fn",
                 "_generation")

    def __init__(self, key: "CompileKey", make_kernel: Callable[[], object], args,
                 options: str = ""):
        self.key = key
        self.options = f"{options} --enable-tvm-ffi".strip()
        self._make_kernel = make_kernel
        self._specs = tuple(_arg_spec(a) for a in args)
        self._examples = tuple(a if type(a) in (int, float) else None for a in args)
        self._record = type(args) if hasattr(args, "_fields") else None
        self._fn, self._generation = None, -1

    def _build(self):
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        spec = tuple(_fake(s, e) for s, e in zip(self._specs, self._examples))
        if self._record is not None:
            return compile_record(self._make_kernel(), self._record(*spec), stream, self.options)
        return cute.compile(self._make_kernel(), *spec, stream, options=self.options)

    def compiled(self):
        """The compiled function (compiling or loading it the first time)."""
        if self._fn is None or self._generation != compile_cache.generation:
            self._fn = compile_cache.get(self.key, self._build, self.options)
            self._generation = compile_cache.generation
        return self._fn

    def __call__(self, *values):
        fn = self._fn if self._generation == compile_cache.generation else None
        if fn is None:
            fn = self.compiled()
        if _COMPILE_ONLY.on:
            return
        try:
            fn(*values)
        except TypeError:
            # A kernel loaded from disk that refuses these arguments is an entry of an
            # incompatible build: compile it here and replace the entry.
            if not compile_cache.loaded_from_disk(self.key):
                raise
            self._fn = compile_cache.rebuild(self.key, self._build, self.options)
            self._fn(*values)


def launch_kernel(key: "CompileKey", make_kernel: Callable[[], object], args, options: str = ""):
    """Launch a kernel class instance's `__call__` once, compiling it once per `key`: a
    `KernelCall` made and called on the spot (`KernelCall` for `args`). Kernels that launch
    often keep their `KernelCall` instead (`flash_cute.runtime.launch`)."""
    KernelCall(key, make_kernel, args, options)(*(_value(a) for a in args))


class _CompileOnly(threading.local):
    on = False


_COMPILE_ONLY = _CompileOnly()


@contextlib.contextmanager
def compile_only():
    """Within it, `launch_kernel` compiles (and caches) but launches nothing: for filling the
    disk cache ahead of time, also on a machine without the GPU (tensors on the meta device,
    CUTE_DSL_ARCH naming the target)."""
    _COMPILE_ONLY.on = True
    try:
        yield
    finally:
        _COMPILE_ONLY.on = False
