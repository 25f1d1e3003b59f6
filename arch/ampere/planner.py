"""Host entry of the Ampere pipeline: what it supports, and the forward and backward launches."""

import functools

from flash_cute.arch.ampere.descriptor import AMPERE
from flash_cute.contract.descriptor import Pipeline
from flash_cute.runtime import launch, launch_bwd, launch_fwd
from flash_cute.runtime.problem import AttentionProblem
from flash_cute.runtime.splits import plan_splits

from .config import (
    BWD_SCHEDULES,
    COMPILE_OPTIONS,
    FWD_SCHEDULES,
    SUPPORTED_HDIMS,
    bwd_smem_bytes,
    fwd_smem_bytes,
)


def check_supported(problem: AttentionProblem, device=None, backward: bool = False) -> None:
    """Head dims with a kernel, and (given a device) tiles that fit its shared memory: sm86,
    sm89 and sm120 give a CTA about 99 KiB, the tables are sized for sm80/sm90."""
    launch.check_head_dims("ampere", problem, SUPPORTED_HDIMS)
    if device is not None:
        launch.check_shared_memory("ampere forward", fwd_smem_bytes(
            problem.hdim, problem.hdim_v, FWD_SCHEDULES[problem.hdim]), device)
        if backward:
            launch.check_shared_memory("ampere backward",
                                       bwd_smem_bytes(problem.hdim, problem.hdim_v), device)


_FWD_KERNEL = launch.KernelRef("flash_cute.arch.ampere.fwd", "AmpereFwd")
_BWD_KERNEL = launch.KernelRef("flash_cute.arch.ampere.bwd", "AmpereBwd")


def forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None, schedule=None, rng_seed=None):
    """(out, lse) for validated inputs. `schedule` overrides (tile_m, tile_n, num_warps) for
    ablations; seqused_q/seqused_k: int32 [batch] or None, as `problem` was validated."""
    lengths = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    return plan_forward(q, k, v, problem, *lengths, schedule=schedule)(q, k, v, *lengths,
                                                                       rng_seed=rng_seed)


def plan_forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None, schedule=None,
                 page_table=None) -> launch_fwd.ForwardLaunch:
    """The `launch_fwd.ForwardLaunch` of `forward`'s call configuration (`page_table`: the
    pages gathered first, `launch_fwd.GatheredPages`: this kernel reads no pages)."""
    from flash_cute.runtime.jit import current_target

    if page_table is not None:
        plan = functools.partial(plan_forward, schedule=schedule)
        return launch_fwd.GatheredPages(plan, q, k, v, problem,
                                    (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k),
                                    page_table)

    schedule = tuple(schedule or FWD_SCHEDULES[problem.hdim])
    # One CTA per tile, no packing: as many CTAs per SM as shared memory holds (at most 2,
    # a register file's worth at 4-8 warps of up to 255 registers).
    per_sm = max(1, min(2, (227 * 1024) // fwd_smem_bytes(problem.hdim, problem.hdim_v,
                                                          schedule)))
    splits = plan_splits(problem, schedule[0], schedule[1], 1, launch.device_sms(q.device),
                         per_sm)
    return launch_fwd.ForwardLaunch("ampere.fwd", _FWD_KERNEL, q, k, v, problem, cu_seqlens_q,
                                cu_seqlens_k, seqused_q, seqused_k, schedule, COMPILE_OPTIONS,
                                current_target(), splits=splits)


def backward(dout, dlse, q, k, v, out, lse, problem: AttentionProblem, cu_seqlens_q=None,
             cu_seqlens_k=None, seqused_q=None, seqused_k=None, deterministic: bool = False,
             rng_seed=None):
    """(dq, dk, dv) through `AmpereBwd` (see `flash_cute.runtime.launch_bwd.BackwardLaunch`); dQ is
    added by fp32 atomics, so `deterministic` is refused (the descriptor does not list it)."""
    lengths = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    return plan_backward(dout, dlse, q, k, v, out, lse, problem, *lengths, deterministic)(
        dout, dlse, q, k, v, out, lse, *lengths, rng_seed=rng_seed)


def plan_backward(dout, dlse, q, k, v, out, lse, problem: AttentionProblem, cu_seqlens_q=None,
                  cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                  deterministic: bool = False) -> launch_bwd.BackwardLaunch:
    """The `launch_bwd.BackwardLaunch` of `backward`'s call configuration."""
    from flash_cute.runtime.jit import current_target

    if deterministic:
        raise NotImplementedError("deterministic=True: the ampere backward adds dQ with fp32 "
                                  "atomics, whose order varies")
    plan = _bwd_plan(problem.hdim, current_target())
    return launch_bwd.BackwardLaunch(plan, dout, dlse, q, k, v, out, lse, problem, cu_seqlens_q,
                                 cu_seqlens_k, seqused_q, seqused_k, deterministic)


@functools.lru_cache(maxsize=None)
def _bwd_plan(hdim: int, target: str) -> launch_bwd.BackwardPlan:
    return launch_bwd.BackwardPlan("ampere.bwd", _BWD_KERNEL, BWD_SCHEDULES[hdim], COMPILE_OPTIONS,
                               target)


# The pipeline dispatch runs: the descriptor joined to this planner's entry points.
PIPELINE = Pipeline.of(AMPERE, plan_forward=plan_forward, plan_backward=plan_backward,
                       check_supported=check_supported)
