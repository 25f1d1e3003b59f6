"""Host entry of the Blackwell pipeline (forward only, compile-verified: it has not run on
hardware, so dispatch takes it only when named, `Pipeline.hardware_tested`)."""

from flash_cute.arch.blackwell.descriptor import BLACKWELL
from flash_cute.arch.sm90plus.host import tma_ready
from flash_cute.contract.descriptor import Pipeline
from flash_cute.contract.variant import EX2_EMULATION_ENV
from flash_cute.runtime import launch, launch_fwd
from flash_cute.runtime.problem import AttentionProblem

from .config import (
    COMPILE_OPTIONS,
    FWD_SCHEDULES,
    Q_STAGES,
    SUPPORTED_HDIMS,
    TILE_M,
    FwdSchedule,
    default_ex2_per16,
)

_FWD_KERNEL = launch.KernelRef("flash_cute.arch.blackwell.fwd", "BlackwellFwd")


def check_supported(problem: AttentionProblem, device=None, backward: bool = False) -> None:
    """Head dims (hdim, hdim_v) with a schedule: (64, 64), (128, 128), (192, 128); with
    pack_gqa=True, a group that divides the 128-row Q tile."""
    if (problem.hdim, problem.hdim_v) not in FWD_SCHEDULES:
        raise NotImplementedError(
            f"head dims ({problem.hdim}, {problem.hdim_v}): the blackwell forward has "
            f"{', '.join(str(d) for d in SUPPORTED_HDIMS)}")
    launch.packed_heads(problem, TILE_M)


def takes(problem: AttentionProblem) -> bool:
    """Whether dispatch may give it `problem` (when allowed at all): its head dims."""
    return (problem.hdim, problem.hdim_v) in FWD_SCHEDULES


def plan_forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None, schedule=None) -> launch_fwd.ForwardLaunch:
    """The `launch_fwd.ForwardLaunch` of a call configuration on sm_100a. The software exp2's share
    is FA4's per case (`config.default_ex2_per16`) unless FLASH_CUTE_EX2_EMULATION sets one."""
    import os

    from flash_cute.contract.variant import ex2_emulation_per16
    from flash_cute.runtime.jit import current_target

    target = current_target()
    if target != "sm_100a":
        raise NotImplementedError(f"the blackwell pipeline runs on sm_100a only, not {target}")
    check_supported(problem)
    per16 = (ex2_emulation_per16() if os.environ.get(EX2_EMULATION_ENV, "").strip()
             else default_ex2_per16(problem.hdim, problem.causal))
    chosen = tuple(schedule or FWD_SCHEDULES[(problem.hdim, problem.hdim_v)])
    # Packing fills the CTA's two Q tiles (`launch.packed_heads`' rule).
    pack = launch.packed_heads(problem, TILE_M, Q_STAGES * TILE_M)
    return launch_fwd.ForwardLaunch("blackwell.fwd", _FWD_KERNEL, q, k, v, problem, cu_seqlens_q,
                                cu_seqlens_k, seqused_q, seqused_k, chosen, COMPILE_OPTIONS,
                                target, prepare=tma_ready, pack_gqa=pack, ex2_per16=per16,
                                tile=(TILE_M, FwdSchedule(*chosen).tile_n),
                                q_tiles_per_cta=Q_STAGES)


# The pipeline dispatch runs: the descriptor joined to this planner's entry points.
PIPELINE = Pipeline.of(BLACKWELL, plan_forward=plan_forward, check_supported=check_supported,
                       takes=takes)
