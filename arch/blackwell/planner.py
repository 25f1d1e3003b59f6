"""Host entry of the Blackwell pipeline, forward and backward (compile-verified: it has not run
on hardware, so dispatch takes it only when named, `Pipeline.hardware_tested`). Its code is
compiled for sm_100a on compute capability 10.0 and for the family target sm_100f on the
rest of 10.x (10.3, B300: sm_100a cubins do not load there; `runtime.jit.current_target`)."""

from flash_cute.arch.blackwell.descriptor import BLACKWELL
from flash_cute.arch.sm90plus.host import tma_ready
from flash_cute.contract.descriptor import Pipeline
from flash_cute.contract.variant import EX2_EMULATION_ENV
from flash_cute.runtime import launch, launch_bwd, launch_fwd
from flash_cute.runtime.problem import AttentionProblem

from .config import (
    BWD_HDIMS,
    BWD_SCHEDULES,
    COMPILE_OPTIONS,
    FWD_SCHEDULES,
    SUPPORTED_HDIMS,
    TILE_M,
    BwdSchedule,
    FwdSchedule,
    default_ex2_per16,
)

_FWD_KERNEL = launch.KernelRef("flash_cute.arch.blackwell.fwd", "BlackwellFwd")
_BWD_KERNEL = launch.KernelRef("flash_cute.arch.blackwell.bwd", "BlackwellBwd")
# The SM targets its code is compiled for: 10.0, and the 10.x family.
TARGETS = ("sm_100a", "sm_100f")


def check_supported(problem: AttentionProblem, device=None, backward: bool = False) -> None:
    """Head dims (hdim, hdim_v) with a schedule: (64, 64), (128, 128), (192, 128), (256, 256)
    (the backward: `config.BWD_HDIMS`); with
    pack_gqa=True, a group that divides the 128-row Q tile (the backward runs unpacked: its
    outputs do not depend on how the forward tiled). The backward refuses learnable captured
    tensors of a score mod (their gradients are the hopper backward's)."""
    if (problem.hdim, problem.hdim_v) not in FWD_SCHEDULES:
        raise NotImplementedError(
            f"head dims ({problem.hdim}, {problem.hdim_v}): the blackwell forward has "
            f"{', '.join(str(d) for d in SUPPORTED_HDIMS)}")
    launch.packed_heads(problem, TILE_M)
    if backward:
        launch.check_head_dims("blackwell backward", problem, BWD_HDIMS)
        if getattr(problem, "mod_grads", False):
            raise NotImplementedError("learnable captured tensors of a score mod: the "
                                      "blackwell backward does not take their gradients")


def takes(problem: AttentionProblem, backward: bool = False) -> bool:
    """Whether dispatch may give it `problem` (when allowed at all): its head dims, the
    backward's too where the call needs one."""
    dims = (problem.hdim, problem.hdim_v)
    return dims in FWD_SCHEDULES and (not backward or dims in BWD_HDIMS)


def plan_forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None, schedule=None) -> launch_fwd.ForwardLaunch:
    """The `launch_fwd.ForwardLaunch` of a call configuration on sm_100a. The software exp2's share
    is FA4's per case (`config.default_ex2_per16`) unless FLASH_CUTE_EX2_EMULATION sets one."""
    import os

    from flash_cute.contract.variant import ex2_emulation_per16
    from flash_cute.runtime.jit import current_target

    target = current_target()
    _check_target(target)
    check_supported(problem)
    per16 = (ex2_emulation_per16() if os.environ.get(EX2_EMULATION_ENV, "").strip()
             else default_ex2_per16(problem.hdim, problem.causal))
    chosen = tuple(schedule or FWD_SCHEDULES[(problem.hdim, problem.hdim_v)])
    q_tiles = FwdSchedule(*chosen).q_tiles
    # Packing fills the CTA's Q tiles (`launch.packed_heads`' rule).
    pack = launch.packed_heads(problem, TILE_M, q_tiles * TILE_M)
    return launch_fwd.ForwardLaunch("blackwell.fwd", _FWD_KERNEL, q, k, v, problem, cu_seqlens_q,
                                cu_seqlens_k, seqused_q, seqused_k, chosen, COMPILE_OPTIONS,
                                target, prepare=tma_ready, pack_gqa=pack, ex2_per16=per16,
                                tile=(TILE_M, FwdSchedule(*chosen).tile_n),
                                q_tiles_per_cta=q_tiles)


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise NotImplementedError(f"the blackwell pipeline runs on sm_100a / sm_100f (compute "
                                  f"capability 10.x) only, not {target}")


def plan_backward(dout, dlse, q, k, v, out, lse, problem: AttentionProblem, cu_seqlens_q=None,
                  cu_seqlens_k=None, seqused_q=None, seqused_k=None, deterministic: bool = False,
                  schedule=None, timeline=None) -> launch_bwd.BackwardLaunch:
    """The `launch_bwd.BackwardLaunch` of a backward call on sm_100a / sm_100f
    (`BlackwellBwd`, compile-verified only). `timeline` (the hopper kernels' measured
    timeline) is refused."""
    from flash_cute.runtime.jit import current_target

    target = current_target()
    _check_target(target)
    check_supported(problem, backward=True)
    if timeline is not None:
        raise NotImplementedError("the measured timeline runs on sm_90a only (the hopper "
                                  "kernels')")
    chosen = tuple(schedule or BWD_SCHEDULES[(problem.hdim, problem.hdim_v)])
    # A block mask's key tiles come padded to whole clusters (the pair reads two at once).
    plan = launch_bwd.BackwardPlan("blackwell.bwd", _BWD_KERNEL, chosen, COMPILE_OPTIONS,
                                   target, prepare=tma_ready,
                                   key_tiles_per_cta=BwdSchedule(*chosen).cta_group)
    return launch_bwd.BackwardLaunch(plan, dout, dlse, q, k, v, out, lse, problem,
                                     cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                     deterministic)


# The pipeline dispatch runs: the descriptor joined to this planner's entry points.
PIPELINE = Pipeline.of(BLACKWELL, plan_forward=plan_forward, plan_backward=plan_backward,
                       check_supported=check_supported, takes=takes)
