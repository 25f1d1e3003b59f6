"""CPU checks of the launch path: kernels compile through TVM-FFI against fake tensors built
from the call's own tensors, and the compiled function gets the torch tensors and Python
numbers themselves (the GPU tests run that call); a float is compiled as Float32, an int as
Int32, and anything else is refused."""

import os
import subprocess
import sys

_COMPILE_AND_RECORD = '''
import torch
import flash_cute.jit as jit
from flash_cute.bwd_prep import BwdPostprocessKernel
from flash_cute.arch.hopper.dq_accum import HopperDqPostprocess

calls = []


class Recording:
    def get(self, key, build):
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
