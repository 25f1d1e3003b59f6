"""CPU checks of the launch path: kernels compile through TVM-FFI against fake tensors built
from the call's own tensors, and the compiled function gets the torch tensors and Python
numbers themselves (the GPU tests run that call); a float is compiled as Float32, an int as
Int32, and anything else is refused."""

import os
import subprocess
import sys

import pytest

_COMPILE_AND_RECORD = '''
import torch
import flash_cute.runtime.jit as jit
from flash_cute.kernels.bwd_prep import BwdPostprocessKernel
from flash_cute.arch.hopper.dq_accum import HopperDqPostprocess

calls = []


class Recording:
    generation = 0

    def get(self, key, build, options=""):
        fn = build()
        assert type(fn).__name__ == "TVMFFIJitCompiledFunctionWithKwargs", type(fn)
        return lambda *args: calls.append(args)


jit.compile_cache = Recording()
acc, dq = torch.zeros(2, 33, 3, 64), torch.zeros(2, 33, 3, 64, dtype=torch.bfloat16)
acc.requires_grad_()
jit.launch_kernel(jit.CompileKey("blocks.bwd.postprocess", "sm_90a", "bf16", 64, None, (), ()),
                  lambda: BwdPostprocessKernel(jit.DTYPES["bf16"], 64),
                  (jit.TensorArg(acc), jit.TensorArg(dq), 0.5))
tiles, cu = torch.zeros(7, 3, 64 * 128), torch.tensor([0, 5, 9], dtype=torch.int32)
packed = torch.zeros(9, 3, 128, dtype=torch.float16)
jit.launch_kernel(jit.CompileKey("hopper.bwd.dq_postprocess", "sm_90a", "fp16", 128, None, (),
                                 ()),
                  lambda: HopperDqPostprocess(jit.DTYPES["fp16"], 128, 64, (1, 2), True),
                  (jit.TensorArg(tiles), jit.TensorArg(packed), 0.25,
                   jit.tensor_arg(cu, 4), 5))
(a, d, s), (t, p, s2, c, n) = calls
assert not a.requires_grad and a.data_ptr() == acc.data_ptr() and d is dq
assert t is tiles and p is packed and c is cu
assert (type(s), s, type(s2), s2, type(n), n) == (float, 0.5, float, 0.25, int, 5)
try:
    jit.launch_kernel(jit.CompileKey("x", "sm_90a", "bf16", 64, None, (), ()), None,
                      (jit.TensorArg(acc), jit.TensorArg(dq), True))
except TypeError as e:
    assert "expected a TensorArg, float, int or None" in str(e), e
else:
    raise AssertionError("a bool launch argument was accepted")
print("recorded")
'''


def test_launch_kernel_compiles_through_tvm_ffi_and_passes_torch_values():
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_AND_RECORD], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0 and "recorded" in proc.stdout, proc.stderr[-3000:]


# The launch scripts' compile cache: it records each launch's key and values, and with
# `compile` really compiles each kernel first (for the call's fake tensors).
_RECORDING = """
launches = []


class Recording:
    generation = 0

    def get(self, key, build, options=""):
        if {compile}:
            build()
        return lambda *args: launches.append((key, args))


jit.compile_cache = Recording()
"""


_BACKWARD_LAUNCHES = '''
import torch
import flash_cute.runtime.jit as jit
from flash_cute.arch.hopper import planner as api
from flash_cute.runtime.problem import validate_attention_inputs

''' + _RECORDING.format(compile=False) + '''
for varlen, causal in ((False, True), (True, False), (False, False)):
    for _ in range(2):
        if varlen:
            q, k, v = (torch.randn(37, 4, 128, dtype=torch.bfloat16) for _ in range(3))
            cu = torch.tensor([0, 16, 37], dtype=torch.int32)
            problem = validate_attention_inputs(q, k[:, :2], v[:, :2], cu_seqlens_q=cu,
                                                cu_seqlens_k=cu, max_seqlen_q=21,
                                                max_seqlen_k=21, require_cuda=False)
            k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
            lse = torch.randn(4, 37)
        else:
            q, k, v = (torch.randn(2, 37, 4, 128, dtype=torch.bfloat16) for _ in range(3))
            problem = validate_attention_inputs(q, k, v, causal=causal, require_cuda=False)
            lse = torch.randn(2, 4, 37)
        out, dout = torch.randn_like(q), torch.randn_like(q)
        dk_dv = api.backward(dout, None, q, k, v, out, lse, problem, cu if varlen else None,
                             cu if varlen else None)[1:]
    (pre, _), (main, a), (post, _) = launches[-3:]
    assert len(launches) % 3 == 0
    assert launches[-6][0] == pre and launches[-5][0] == main and launches[-4][0] == post
    assert (pre.kernel, main.kernel, post.kernel) == ("blocks.bwd.preprocess", "hopper.bwd",
                                                "hopper.bwd.dq_postprocess"), (pre, main, post)
    lse2, delta = a[4], a[5]
    assert lse2.shape == delta.shape == lse.shape
    assert lse2.data_ptr() % 16 == 0 and delta.data_ptr() % 16 == 0
    assert abs(lse2.data_ptr() - delta.data_ptr()) >= lse.numel() * 4
    # varlen: 64 rows, P in shared memory; a causal problem of 37 rows: 64 rows (short
    # causal); without the mask the head dim's 80 rows. The postprocess reads those tiles.
    want = (64, 128, 2, False) if varlen else ((64 if causal else 80), 128, 2, True)
    assert main.schedule[:4] == want and post.schedule[0] == want[0], (main.schedule,
                                                                       post.schedule)
    dk, dv = a[7], a[8]
    # GQA (varlen call): fp32 per query head, zeroed (rows past every sequence get nothing).
    assert dk.dtype == (torch.float32 if varlen else torch.bfloat16)
    assert dk.shape[-2] == 4 and (not varlen or (dk.count_nonzero() == 0
                                                 and dv.count_nonzero() == 0))
    assert dk_dv[0].shape == k.shape and dk_dv[0].dtype == q.dtype
print("launched")
'''


def test_backward_launches_preprocess_main_and_postprocess_with_the_planned_buffers():
    """The Hopper backward's host path with the compile cache stubbed (no GPU): per call the
    preprocess, the main kernel (the head dim's 80 rows, 64 for a short causal problem and
    for varlen) and the dQ
    postprocess, in that order and with the same keys on a repeated call; LSE₂ and Δ
    16-byte aligned and apart; GQA's dK/dV fp32 per query head and zeroed for varlen."""
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    proc = subprocess.run([sys.executable, "-c", _BACKWARD_LAUNCHES], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0 and "launched" in proc.stdout, proc.stderr[-3000:]


def test_a_kernel_call_compiles_once_and_looks_again_after_the_cache_is_cleared(monkeypatch):
    """`KernelCall` keeps its compiled function between calls (the plan cache's launches call
    it directly) and fetches it again once the compile cache was cleared or rebuilt."""
    from flash_cute.runtime import jit

    builds, calls = [], []
    cache = jit.CompileCache()
    cache._store, cache._store_ready = None, True
    monkeypatch.setattr(jit, "compile_cache", cache)
    monkeypatch.setattr(jit.cute, "compile",
                        lambda *a, **kw: (builds.append(1), lambda *v: calls.append(v))[1])
    call = jit.KernelCall(jit.CompileKey("k", "sm_90a", "bf16", 64, 64, ()), lambda: None,
                          (1.0, 2, None))
    call(0.5, 3, None)
    call(0.25, 4, None)
    assert len(builds) == 1 and calls == [(0.5, 3, None), (0.25, 4, None)]
    cache.clear()
    cache._store_ready = True  # clear() forgets the store; keep it off
    call(0.125, 5, None)
    assert len(builds) == 2 and calls[-1] == (0.125, 5, None)
    with jit.compile_only():
        call(1.0, 6, None)
    assert len(calls) == 3


def test_a_kernel_call_refuses_arguments_it_cannot_compile():
    from flash_cute.runtime import jit

    with pytest.raises(TypeError, match="expected a TensorArg"):
        jit.KernelCall(jit.CompileKey("k", "sm_90a", "bf16", 64, 64, ()), lambda: None, (True,))


def test_split_scratch_is_kept_per_stream_and_fresh_under_capture(monkeypatch):
    """`launch_fwd.SplitScratch`: one set of zeroed counts (and small partials) per stream, the
    same set again on that stream, the oldest stream's dropped past KEEP_STREAMS, partials
    over KEEP_PARTIALS_BYTES made per call, and fresh ones while a graph is captured."""
    import torch

    from flash_cute.runtime import launch_fwd

    stream = [0]
    capturing = [False]
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: stream[0],
                        raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    size = [8]

    def new_parts():
        return torch.empty(size[0]), torch.empty(2)

    scratch = launch_fwd.SplitScratch(5, new_parts, torch.device("cpu"))
    first = scratch.get()
    assert first[2].tolist() == [0] * 5
    assert all(a is b for a, b in zip(scratch.get(), first))
    stream[0] = 1
    other = scratch.get()
    assert all(a is not b for a, b in zip(other, first))
    for s in range(2, 2 + launch_fwd.KEEP_STREAMS):
        stream[0] = s
        scratch.get()
    assert 0 not in scratch.by_stream and len(scratch.by_stream) == launch_fwd.KEEP_STREAMS
    capturing[0] = True
    captured = scratch.get()
    assert all(a is not b for a, b in zip(captured, scratch.get()))
    capturing[0] = False
    size[0] = launch_fwd.KEEP_PARTIALS_BYTES // 4
    stream[0] = 99
    big = scratch.get()
    again = scratch.get()
    assert big[0] is not again[0] and big[2] is again[2]


def test_the_merge_launch_names_the_kernel_it_compiles():
    """The LSE merge's launch keys its kernel by rows per CTA without importing it: the two
    must agree."""
    from flash_cute.kernels.lse_merge import LseMergeKernel
    from flash_cute.runtime import lse_merge

    assert lse_merge.ROWS_PER_CTA == LseMergeKernel.rows_per_cta
    assert lse_merge._KERNEL.module == LseMergeKernel.__module__


_PARTIAL_LAUNCHES = '''
import dataclasses
import torch
import flash_cute.runtime.jit as jit
from flash_cute.arch.ampere import planner as ampere
from flash_cute.arch.hopper import planner as hopper
from flash_cute.runtime.problem import validate_attention_inputs

''' + _RECORDING.format(compile=False) + '''
# The per-stream split scratch asks the CUDA runtime for the stream (a CPU build stubs it).
torch.cuda.is_current_stream_capturing = lambda: False
torch._C._cuda_getCurrentRawStream = lambda index: 0
q, k, v = (torch.randn(2, 37, 4, 128, dtype=torch.bfloat16) for _ in range(3))
problem = validate_attention_inputs(q, k, v, causal=True, require_cuda=False)
partial = dataclasses.replace(problem, partial_out=True)
for planner in (hopper, ampere):
    out16, _ = planner.plan_forward(q, k, v, problem)(q, k, v)
    key16, key16_args = launches[-1]
    out, lse = planner.plan_forward(q, k, v, partial)(q, k, v)
    key, args = launches[-1]
    flags = dict(key.flags)
    assert flags.get("split_kv") and not dict(key16.flags).get("split_kv"), (key, key16)
    assert args[3].dtype == torch.float32 and args[3].shape == (1, 2, 37, 4, 128)
    assert out.dtype == torch.float32 and out.shape == (2, 37, 4, 128) and lse.shape == (2, 4, 37)
    assert out.data_ptr() == args[3].data_ptr() and lse.data_ptr() == args[4].data_ptr()
    assert out16.dtype == torch.bfloat16
    # The compiled function takes every field of the record, None ones included: a call
    # that passes fewer is refused by TVM-FFI on the GPU.
    from flash_cute.contract.kernel_args import FwdArgs
    assert len(args) == len(key16_args) == len(FwdArgs._fields), (len(args), len(key16_args))
print("launched")
'''


def test_partial_out_runs_the_split_kernel_with_one_split_and_returns_its_float32_partial():
    """The operator's partial_out on CUDA (a ring step's float32 O), host path with the
    compile cache recording: the hopper and ampere planners launch their split-KV kernel with
    one split, and the call returns that split's float32 O and LSE, unmerged; the same
    problem without it keeps its 16-bit, unsplit launch."""
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    proc = subprocess.run([sys.executable, "-c", _PARTIAL_LAUNCHES], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0 and "launched" in proc.stdout, proc.stderr[-3000:]


_WIDE_BACKWARD = '''
import dataclasses
import torch
import flash_cute.runtime.jit as jit
from flash_cute.arch.ampere import planner as ampere
from flash_cute.arch.hopper import planner as hopper
from flash_cute.runtime.problem import validate_attention_inputs

''' + _RECORDING.format(compile=True) + '''
q, k, v = (torch.randn(2, 37, 4, 128, dtype=torch.bfloat16) for _ in range(3))
problem = validate_attention_inputs(q, k, v, causal=True, require_cuda=False)
wide = dataclasses.replace(problem, grads_fp32=True)
out, dout = torch.randn_like(q), torch.randn_like(q)
lse = torch.randn(2, 4, 37)
for planner, name in ((hopper, "hopper.bwd"), (ampere, "ampere.bwd")):
    dq, dk, dv = planner.plan_backward(dout, None, q, k, v, out, lse, wide)(
        dout, None, q, k, v, out, lse)
    main = next(key for key, _ in reversed(launches) if key.kernel == name)
    assert dict(main.flags)["dkv_fp32"], main
    assert all(g.dtype == torch.float32 and g.shape == q.shape for g in (dq, dk, dv)), name
    if name == "hopper.bwd":
        post = launches[-1][0]
        assert post.kernel == "hopper.bwd.dq_postprocess" and dict(post.flags)["fp32_out"]
        assert launches[-1][1][1] is dq
    # No work (no keys): zeros, in float32 too.
    k0, v0 = k[:, :0], v[:, :0]
    empty = dataclasses.replace(validate_attention_inputs(q, k0, v0, require_cuda=False),
                                grads_fp32=True)
    grads = planner.plan_backward(dout, None, q, k0, v0, out, lse, empty)(
        dout, None, q, k0, v0, out, lse)
    assert all(g.dtype == torch.float32 and not g.any() for g in grads), name
print("launched")
'''


@pytest.mark.slow
def test_grads_fp32_compiles_the_float32_gradient_paths_and_returns_them():
    """The operator's grads_fp32 on CUDA (a ring step's float32 gradients), host path with
    the compile cache recording and each kernel really compiled: the hopper and ampere
    backwards take their float32 dK/dV path (as for GQA) and return dQ unrounded (the hopper
    postprocess compiled to write float32; the ampere accumulator scaled)."""
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    proc = subprocess.run([sys.executable, "-c", _WIDE_BACKWARD], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0 and "launched" in proc.stdout, proc.stderr[-3000:]
