"""Host entry of the Hopper pipeline: what it supports, and the forward launch with its cache.

Forward only for now: the Hopper backward is still to come, so `backward` is absent and the
autograd Function says so when a gradient is asked for.
"""

import torch

from flash_cute.validation import AttentionProblem
from flash_cute.variant import Variant

from .config import COMPILE_OPTIONS, SUPPORTED_HDIMS, TILES

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# No backward yet; there is nothing to be deterministic about, and deterministic=True with a
# gradient is refused like any unsupported backward.
DETERMINISTIC_BACKWARD = False


def check_supported(problem: AttentionProblem) -> None:
    if (problem.hdim, problem.hdim_v) not in SUPPORTED_HDIMS:
        pairs = ", ".join(f"{a}/{b}" for a, b in sorted(SUPPORTED_HDIMS))
        raise NotImplementedError(
            f"the hopper pipeline has no kernel for hdim/hdim_v {problem.hdim}/{problem.hdim_v}; "
            f"supported: {pairs}"
        )


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` with the strides of its size-1 dims made compact.

    Validation ignores those strides (the kernel never steps along them), but a TMA descriptor
    encodes every stride and rejects one that is not a multiple of 16 bytes.
    """
    if all(t.stride(i) % 8 == 0 or t.shape[i] != 1 for i in range(t.dim() - 1)):
        return t
    strides, step = [], 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        strides.append(step if size == 1 else stride)
        step = max(step, size * strides[-1])
    return t.as_strided(t.shape, tuple(reversed(strides)))


def forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None, tile=None):
    """(out, lse) for validated inputs; out has v's head dim, lse is fp32. `tile` overrides
    (tile_m, tile_n, kv_stages) for ablations."""
    from cutlass import Int32
    import cutlass.cute as cute

    from flash_cute.jit import (DTYPES, CompileKey, attention_runtime_args, compile_cache, current_arch,
                                current_stream, to_cute_tensor)

    from .fwd import HopperFwd

    out = torch.empty(*q.shape[:-1], problem.hdim_v, dtype=q.dtype, device=q.device)
    if problem.varlen:
        lse = torch.empty(problem.nheads, q.shape[0], dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty(problem.batch, problem.nheads, q.shape[1], dtype=torch.float32,
                          device=q.device)
    if out.numel() == 0 or problem.max_seqlen_q == 0:
        lse.fill_(-float("inf"))
        return out.zero_(), lse
    arch = current_arch()
    if arch != "sm_90a":
        # WGMMA and setmaxnreg exist on sm_90a only; newer GPUs run their own pipeline.
        raise NotImplementedError(f"the hopper pipeline runs on sm_90a only, not {arch}")
    variant = Variant.from_problem(problem)
    dtype = _DTYPE_NAMES[q.dtype]
    tile = tuple(tile or TILES[problem.hdim])
    key = CompileKey("hopper.fwd", arch, dtype, problem.hdim, problem.hdim_v, tile,
                     variant.flags())
    scalars, cu = attention_runtime_args(problem, cu_seqlens_q, cu_seqlens_k)
    q, k, v = (_tma_ready(t) for t in (q, k, v))
    args = (to_cute_tensor(q), to_cute_tensor(k), to_cute_tensor(v), to_cute_tensor(out),
            to_cute_tensor(lse, 4)) + scalars + (Int32(problem.max_seqlen_q),) + cu \
        + (current_stream(),)

    def build():
        kernel = HopperFwd(DTYPES[dtype], problem.hdim, problem.hdim_v, variant, tile=tile)
        return cute.compile(kernel, *args, options=COMPILE_OPTIONS)

    compile_cache.get(key, build)(*args)
    return out, lse
