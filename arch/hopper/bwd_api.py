"""Host entry of the Hopper backward (`HopperBwd`), kept apart from `api.py` on purpose.

`arch.hopper.api` has no `backward`, so the dispatcher (`flash_cute.interface`) still runs the
Ampere backward on the Hopper forward's (O, LSE). This kernel has only been cross-compiled;
once `tests/test_hopper_bwd_gpu.py` passes on an H100/H200, `backward` moves to (or is
re-exported by) `api.py` and `check_supported(backward=True)` learns `BWD_SUPPORTED_HDIMS`.
"""

from flash_cute import launch
from flash_cute.validation import AttentionProblem

from .api import _tma_ready
from .config import BWD_COMPILE_OPTIONS, BWD_SUPPORTED_HDIMS, BWD_TILES

# dQ is accumulated with fp32 atomics, so its rounding depends on the order CTAs finish.
DETERMINISTIC_BACKWARD = False


def check_supported(problem: AttentionProblem) -> None:
    launch.check_head_dims("hopper backward", problem, BWD_SUPPORTED_HDIMS)


def backward(dout, dlse, q, k, v, out, lse, problem: AttentionProblem, cu_seqlens_q=None,
             cu_seqlens_k=None, deterministic: bool = False, tile=None):
    """(dq, dk, dv) for validated inputs, as `arch.ampere.api.backward`. `tile` overrides
    (tile_m, tile_n, q_stages) for ablations."""
    from flash_cute.jit import current_arch

    from .bwd import HopperBwd

    if deterministic:
        raise NotImplementedError("the hopper backward accumulates dQ with atomics; "
                                  "deterministic=True is not supported")
    arch = current_arch()
    if arch != "sm_90a":
        raise NotImplementedError(f"the hopper backward runs on sm_90a only, not {arch}")
    check_supported(problem)
    return launch.backward("hopper.bwd", HopperBwd, dout, dlse, q, k, v, out, lse, problem,
                           cu_seqlens_q, cu_seqlens_k, tuple(tile or BWD_TILES[problem.hdim]),
                           BWD_COMPILE_OPTIONS, arch, prepare=_tma_ready)
