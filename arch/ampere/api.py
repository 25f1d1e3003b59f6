"""Host entry of the Ampere pipeline: what it supports, and the forward and backward launches."""

from flash_cute import launch
from flash_cute.validation import AttentionProblem

from .config import (BWD_TILES, COMPILE_OPTIONS, SUPPORTED_HDIMS, TILES, bwd_smem_bytes,
                     fwd_smem_bytes)

# dQ is accumulated with fp32 atomics, so its rounding depends on the order CTAs finish.
DETERMINISTIC_BACKWARD = False
# forward/backward take seqused_q/seqused_k (the dispatcher reads this without importing the DSL).
SUPPORTS_SEQUSED = True


def check_supported(problem: AttentionProblem, device=None, backward: bool = False) -> None:
    """Head dims with a kernel, and (given a device) tiles that fit its shared memory: sm86,
    sm89 and sm120 give a CTA about 99 KiB, the tables are sized for sm80/sm90."""
    launch.check_head_dims("ampere", problem, SUPPORTED_HDIMS)
    if device is not None:
        launch.check_shared_memory("ampere forward", fwd_smem_bytes(
            problem.hdim, problem.hdim_v, TILES[problem.hdim]), device)
        if backward:
            launch.check_shared_memory("ampere backward",
                                       bwd_smem_bytes(problem.hdim, problem.hdim_v), device)


def forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None, tile=None,
            seqused_q=None, seqused_k=None):
    """(out, lse) for validated inputs. `tile` overrides (tile_m, tile_n, num_warps) for
    ablations; seqused_q/seqused_k: int32 [batch] or None, as `problem` was validated."""
    from flash_cute.jit import current_arch

    from .fwd import AmpereFwd

    return launch.forward("ampere.fwd", AmpereFwd, q, k, v, problem, cu_seqlens_q, cu_seqlens_k,
                          tuple(tile or TILES[problem.hdim]), COMPILE_OPTIONS, current_arch(),
                          seqused_q=seqused_q, seqused_k=seqused_k)


def backward(dout, dlse, q, k, v, out, lse, problem: AttentionProblem, cu_seqlens_q=None,
             cu_seqlens_k=None, deterministic: bool = False, seqused_q=None, seqused_k=None):
    """(dq, dk, dv) through `AmpereBwd` (see `flash_cute.launch.backward`)."""
    from flash_cute.jit import current_arch

    from .bwd import AmpereBwd

    return launch.backward("ampere.bwd", AmpereBwd, dout, dlse, q, k, v, out, lse, problem,
                           cu_seqlens_q, cu_seqlens_k, BWD_TILES[problem.hdim], COMPILE_OPTIONS,
                           current_arch(), seqused_q=seqused_q, seqused_k=seqused_k)
