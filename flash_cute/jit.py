"""JIT layer: the compile cache, TVM-FFI launches, fake tensors for compiling without a GPU,
and artifacts.

The cache key holds only what changes the generated code: kernel, arch, dtype, head dims, flags,
tile config and a variant hash (score/mask mods). Batch and sequence lengths are never in it:
kernels take them as dynamic shapes, so a new length reuses the compiled kernel.
``cute.compile`` is not thread-safe, so compiles are serialized by a lock.
"""

import functools
import hashlib
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import torch

from flash_cute.sass import kernel_resources, opcode_counts

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}


@dataclass(frozen=True)
class CompileKey:
    kernel: str
    arch: str
    dtype: str
    hdim: Optional[int]
    hdim_v: Optional[int]
    tile: tuple
    flags: tuple = ()
    variant: str = ""


def variant_hash(*objs) -> str:
    """Stable hash of user-supplied variant code (e.g. a score_mod's source), for CompileKey."""
    h = hashlib.sha256()
    for obj in objs:
        h.update(repr(obj).encode())
    return h.hexdigest()[:16]


class CompileCache:
    """Compiled kernels by CompileKey; `get` compiles on a miss, one compile at a time."""

    def __init__(self):
        self._entries = {}
        self._lock = threading.Lock()

    def get(self, key: CompileKey, build: Callable[[], object]):
        hit = self._entries.get(key)
        if hit is not None:
            return hit
        with self._lock:
            if key not in self._entries:
                self._entries[key] = build()
            return self._entries[key]

    def __len__(self):
        return len(self._entries)

    def keys(self):
        return list(self._entries)


compile_cache = CompileCache()


def current_arch() -> str:
    """Arch label of this process for cache keys and arch checks: CUTE_DSL_ARCH, else the
    current GPU's family (sm_80 for any 8.x, sm_90a for 9.0, sm_100a for 10.x)."""
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return env
    if not (torch.cuda.is_initialized() or torch.cuda.is_available()):
        raise RuntimeError("no CUDA GPU and CUTE_DSL_ARCH is unset: name an arch to cross-compile")
    return _arch_label(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _arch_label(device_index: int) -> str:
    from flash_cute.device import device_capability

    major, minor = device_capability(device_index)
    return {8: "sm_80", 9: "sm_90a", 10: "sm_100a"}.get(major, f"sm_{major}{minor}")


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


@dataclass
class CompileSpec:
    """What a registry builder returns: the jit callable, its fake arguments, and extras."""

    fn: Callable
    args: tuple
    dynamic_smem_bytes: int = 0
    extra: dict = field(default_factory=dict)
    options: str = ""


@dataclass
class Artifacts:
    ptx: str
    cubin: bytes
    sass: str

    def summary(self, dynamic_smem_bytes: int = 0) -> dict:
        """registers / smem_bytes / spill_bytes of the main kernel, and SASS opcode counts."""
        kernels = kernel_resources(self.cubin)
        main = max(kernels, key=lambda k: k.registers)
        return {
            "registers": main.registers,
            "smem_bytes": main.static_smem_bytes + dynamic_smem_bytes,
            "spill_bytes": main.frame_bytes,
            "sass": opcode_counts(self.sass),
        }


def compile_with_artifacts(spec: CompileSpec) -> Artifacts:
    """Compile `spec` for this process's arch and keep PTX, cubin and SASS.

    SASS needs nvdisasm (pip nvidia-cuda-nvdisasm>=13.4) and is written only when the target
    arch equals CUTE_DSL_ARCH, which is why cross-compiles run one worker process per arch.
    """
    options = " ".join(filter(None, ["--keep-ptx --keep-cubin --keep-sass", spec.options]))
    compiled = cute.compile(spec.fn, *spec.args, options=options)
    art = compiled.artifacts
    if not art.CUBIN or not art.SASS:
        raise RuntimeError("compile produced no cubin/SASS: is nvidia-cuda-nvdisasm installed?")
    return Artifacts(ptx=art.PTX or "", cubin=art.CUBIN, sass=art.SASS)


class TensorArg(NamedTuple):
    """A torch tensor argument of `launch_kernel`, with the byte alignment the kernel may
    assume of its data pointer (strides are compiled with no divisibility; a kernel that
    needs one asserts it, `layouts.assume_aligned_strides`)."""
    tensor: object
    align: int = 16


def tensor_arg(t, align: int = 16):
    return None if t is None else TensorArg(t, align)


_TORCH_TO_DSL = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
                 torch.float32: cutlass.Float32, torch.int32: cutlass.Int32}


def _spec(arg):
    """What `cute.compile` sees of a launch argument: a fake tensor with every extent and
    stride dynamic (unit last stride), Float32 for a float, Int32 for an int, or None."""
    if isinstance(arg, TensorArg):
        shape = tuple(dynamic_dim() for _ in arg.tensor.shape)
        return fake_tensor(_TORCH_TO_DSL[arg.tensor.dtype], shape, align=arg.align)
    if isinstance(arg, bool) or not isinstance(arg, (int, float, type(None))):
        raise TypeError(f"launch argument {arg!r}: expected a TensorArg, float, int or None")
    return arg if arg is None else (cutlass.Float32 if isinstance(arg, float) else cutlass.Int32)(arg)


def _value(arg):
    """What the compiled TVM-FFI function takes for it: the torch tensor (detached: DLPack
    refuses a tensor that requires grad, as autograd's inputs do), or the number itself."""
    if type(arg) is not TensorArg:
        return arg
    t = arg.tensor
    return t.detach() if t.requires_grad else t


def launch_kernel(key: "CompileKey", make_kernel: Callable[[], object], args: tuple,
                  options: str = ""):
    """Launch a kernel class instance's `__call__` on the current torch stream, compiling it
    once per `key` through TVM-FFI (`--enable-tvm-ffi`): it is compiled against fake tensors
    (dynamic shapes and strides, `TensorArg.align`) and the stream the call finds current,
    then called with the torch tensors and Python numbers themselves, which skips the DLPack
    conversion and argument adaptation of a `JitExecutor` call (bench/launch_overhead.py).
    `args`: the call's arguments before its stream, each a `TensorArg`, a Python float (a
    Float32 parameter), int (Int32) or None; `key` must tell apart everything that changes
    their specs (dtypes, ranks, which are None, int against float)."""

    def build():
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        spec = tuple(_spec(a) for a in args) + (stream,)
        return cute.compile(make_kernel(), *spec,
                            options=f"{options} --enable-tvm-ffi".strip())

    compile_cache.get(key, build)(*[_value(a) for a in args])


def attention_runtime_args(problem, cu_seqlens_q, cu_seqlens_k):
    """An attention kernel's arguments after its tensors, for a validated `AttentionProblem`:
    (scale, softcap, window left, window right) and the cu_seqlens (None when padded)."""
    # Cast: a float or int slot is fixed by the first compile of each key.
    scalars = (float(problem.softmax_scale),
               float(problem.softcap) if problem.softcap > 0 else 1.0,
               int(problem.window_left or 0), int(problem.window_right or 0))
    cu = (TensorArg(cu_seqlens_q, 4), TensorArg(cu_seqlens_k, 4)) if problem.varlen \
        else (None, None)
    return scalars, cu


def fake_seqused_args(seqused_q: bool, seqused_k: bool) -> tuple:
    """Fake (mSeqUsedQ, mSeqUsedK) of a kernel that takes them: int32 [batch] or None."""
    from cutlass import Int32

    return tuple(fake_tensor(Int32, (dynamic_dim(),), align=4) if used else None
                 for used in (seqused_q, seqused_k))


def _fake_layout(varlen: bool):
    """Dynamic extents of a fake launch: (Q rows, K rows, heads, kv heads, per-row vector shape
    [b, h, sq] or [h, tq], cu_seqlens pair or (None, None)), padded or varlen."""
    from cutlass import Int32

    heads, heads_kv = dynamic_dim(), dynamic_dim()
    if varlen:
        rows_q, rows_k, batch1 = (dynamic_dim(),), (dynamic_dim(),), dynamic_dim()
        cu = (fake_tensor(Int32, (batch1,), align=4), fake_tensor(Int32, (batch1,), align=4))
        return rows_q, rows_k, heads, heads_kv, (heads, rows_q[0]), cu
    batch, seqlen_q, seqlen_k = dynamic_dim(), dynamic_dim(), dynamic_dim()
    return (batch, seqlen_q), (batch, seqlen_k), heads, heads_kv, (batch, heads, seqlen_q), \
        (None, None)


def fake_backward_args(dtype, hdim: int, hdim_v: int, varlen: bool, *, seqused=None,
                       dkv_fp32: bool = False, stats_align: int = 4, dq_align: int = 4,
                       semaphores=None) -> tuple:
    """Fake arguments of a backward main kernel (the `launch.backward` argument list) with
    dynamic batch, heads and lengths, padded or varlen, for cross-compiling. The alignments
    are those the arch's launch promises (`launch.backward`'s row_stats_align, dq_accum_align);
    `seqused`: as in `fake_forward_args`; `semaphores`: None for a kernel without the dQ
    semaphore argument, else whether it gets one (deterministic)."""
    from cutlass import Float32, Int32

    rows_q, rows_k, h, hk, stats, cu = _fake_layout(varlen)
    dkv_dtype, dkv_align = (Float32, 4) if dkv_fp32 else (dtype, 16)
    used = () if seqused is None else fake_seqused_args(*seqused)
    sem = () if semaphores is None else (
        fake_tensor(Int32, (dynamic_dim(), h, dynamic_dim()), align=4) if semaphores else None,)
    return (fake_tensor(dtype, rows_q + (h, hdim)), fake_tensor(dtype, rows_k + (hk, hdim)),
            fake_tensor(dtype, rows_k + (hk, hdim_v)), fake_tensor(dtype, rows_q + (h, hdim_v)),
            fake_tensor(Float32, stats, align=stats_align),
            fake_tensor(Float32, stats, align=stats_align),
            fake_tensor(Float32, rows_q + (h, hdim), align=dq_align),
            fake_tensor(dkv_dtype, rows_k + (h, hdim), align=dkv_align),
            fake_tensor(dkv_dtype, rows_k + (h, hdim_v), align=dkv_align),
            Float32(0.125), Float32(1.0), Int32(0), Int32(0), Int32(1)) + cu + used + sem \
        + (fake_stream(),)


def fake_forward_args(dtype, hdim: int, hdim_v: int, varlen: bool, seqused=None) -> tuple:
    """Fake arguments of an attention forward kernel (the `launch.forward` argument list) with
    dynamic batch, heads and lengths, padded or varlen, for cross-compiling. `seqused`: None
    for a kernel without the seqused arguments, else (seqused_q, seqused_k) bools."""
    from cutlass import Float32, Int32

    rows_q, rows_k, heads, heads_kv, lse_shape, cu = _fake_layout(varlen)
    used = () if seqused is None else fake_seqused_args(*seqused)
    return (fake_tensor(dtype, rows_q + (heads, hdim)), fake_tensor(dtype, rows_k + (heads_kv, hdim)),
            fake_tensor(dtype, rows_k + (heads_kv, hdim_v)),
            fake_tensor(dtype, rows_q + (heads, hdim_v)), fake_tensor(Float32, lse_shape, align=4),
            Float32(0.125), Float32(1.0), Int32(0), Int32(0), Int32(1)) + cu + used \
        + (fake_stream(),)
