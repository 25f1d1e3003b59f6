"""Host entry of the Hopper pipeline: what it supports, and the forward and backward launches."""

import functools

from flash_cute.arch.hopper.descriptor import HOPPER
from flash_cute.arch.sm90plus.host import tma_ready
from flash_cute.contract.descriptor import Pipeline
from flash_cute.runtime import launch, launch_bwd, launch_fwd
from flash_cute.runtime.problem import AttentionProblem
from flash_cute.runtime.splits import plan_splits

from .config import (
    BWD_SUPPORTED_HDIMS,
    COMPILE_OPTIONS,
    CTAS_PER_SM,
    FP8_SCHEDULES,
    FP8_SUPPORTED_HDIMS,
    FWD_SCHEDULES,
    MIN_PAGE_ROWS,
    PACK_ROWS,
    SHORT_CAUSAL_BWD_ROWS,
    SUPPORTED_HDIMS,
    BwdSchedule,
    bwd_compile_options,
    bwd_schedule,
    bwd_smem_plan,
    fwd_schedule,
    short_causal,
)


def check_supported(problem: AttentionProblem, device=None, backward: bool = False) -> None:
    """Head dims with a kernel (the tiles are sized for the H100/H200's 227 KiB), and a
    group that divides the tile when pack_gqa=True."""
    launch.check_head_dims("hopper", problem, SUPPORTED_HDIMS)
    # Raises for pack_gqa=True with a group that does not divide the tile.
    launch.packed_heads(problem, PACK_ROWS)
    if backward:
        launch.check_head_dims("hopper backward", problem, BWD_SUPPORTED_HDIMS)


_FWD_KERNEL = launch.KernelRef("flash_cute.arch.hopper.fwd", "HopperFwd")
_BWD_KERNEL = launch.KernelRef("flash_cute.arch.hopper.bwd", "HopperBwd")


def forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None, schedule=None, rng_seed=None):
    """(out, lse) for validated inputs. `schedule` overrides the `config.FwdSchedule` for
    ablations; seqused_q/seqused_k: int32 [batch] or None, as `problem` was validated."""
    lengths = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    return plan_forward(q, k, v, problem, *lengths, schedule=schedule)(q, k, v, *lengths,
                                                                       rng_seed=rng_seed)


def plan_forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None, schedule=None,
                 page_table=None, append=None, timeline=None) -> launch_fwd.ForwardLaunch:
    """The `launch_fwd.ForwardLaunch` of `forward`'s call configuration. `page_table`: k / v
    are paged caches, read by the kernel (`paged`) where their page size allows, else
    gathered first (`launch_fwd.GatheredPages`). `append`: (k_new, v_new) written into the
    cache by the kernel (`kv_append`), or by torch first where the pages are gathered.
    `timeline`: the measured timeline's record buffer (`python -m flash_cute profile`)."""
    from flash_cute.runtime.jit import current_target

    target = current_target()
    if target != "sm_90a":
        # WGMMA and setmaxnreg exist on sm_90a only; newer GPUs run their own pipeline.
        raise NotImplementedError(f"the hopper pipeline runs on sm_90a only, not {target}")
    lengths = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    if page_table is not None and not pages_in_kernel(k.shape[1]):
        plan = functools.partial(plan_forward, schedule=schedule)
        gathered = launch_fwd.GatheredPages(plan, q, k, v, problem, lengths, page_table)
        return gathered if append is None else launch_fwd.AppendFirst(gathered)
    pack = launch.packed_heads(problem, PACK_ROWS, FWD_SCHEDULES[problem.hdim].tile_m)
    short = short_causal(problem.causal, problem.max_seqlen_q * pack, problem.max_seqlen_k)

    def pick(row_stores: bool, decode: bool):
        return tuple(schedule or fwd_schedule(problem.hdim, pack, row_stores, short,
                                              problem.dropout_p > 0, decode))

    def split(chosen):
        return plan_splits(problem, chosen[0], chosen[1], pack, launch.device_sms(q.device),
                           CTAS_PER_SM.get(chosen[0] // 64, 1))

    page_rows = k.shape[1] if page_table is not None else None
    decode = takes_decode_pair(problem, pack, append is not None or timeline is not None,
                               page_rows)
    chosen = pick(problem.varlen or problem.has_seqused_q, decode)
    splits = split(chosen)
    if decode and splits is None:
        # The pair was measured split; unsplit decode keeps the default.
        decode = False
        chosen = pick(problem.varlen or problem.has_seqused_q, decode)
        splits = split(chosen)
    if splits is not None:
        # Split partials leave by row stores (`HopperFwd._rows_past_sequence`).
        chosen = pick(True, decode)
    return launch_fwd.ForwardLaunch("hopper.fwd", _FWD_KERNEL, q, k, v, problem, cu_seqlens_q,
                                cu_seqlens_k, seqused_q, seqused_k, chosen, COMPILE_OPTIONS,
                                target, prepare=tma_ready, pack_gqa=pack, splits=splits,
                                page_table=page_table, append=append,
                                merge_in_kernel=True, timeline=timeline)


def takes_decode_pair(problem: AttentionProblem, pack: int, extras: bool,
                      page_rows=None) -> bool:
    """Decode that runs `config.DECODE_PAIR` (D-DECODE-PAIR), where it was measured: one
    padded sequence at hdim 128, at most `PAIR_ROWS` packed query rows, split-KV allowed, a
    dense cache or pages of 16 to 64 rows (`page_rows`), and none of dropout, mods, softcap,
    windows, an append or a timeline (`extras`), or a float32 partial. Not with
    `seqlen_k_per_split`, whose promise is that a sequence's bits do not depend on the batch
    beside it: a batch of one would otherwise run the pair, and a larger one not."""
    return (problem.hdim == problem.hdim_v == 128 and problem.batch == 1
            and problem.seqlen_k_per_split is None
            and not problem.varlen and problem.max_seqlen_q * pack <= PAIR_ROWS
            and (page_rows is None or 16 <= page_rows <= 64)
            and problem.num_splits != 1 and not problem.partial_out
            and problem.dropout_p == 0 and problem.mods is None and not problem.softcap
            and not problem.is_local and not extras)


# Packed query rows the pair was measured with: one query of 4 heads per K/V head.
PAIR_ROWS = 8


_FP8_KERNEL = launch.KernelRef("flash_cute.arch.hopper.fwd_fp8", "HopperFwdFp8")


def plan_forward_fp8(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None,
                     seqused_q=None, seqused_k=None, out_dtype=None, page_table=None,
                     block_scales: bool = False, schedule=None) -> launch_fwd.ForwardLaunch:
    """The FP8 forward's launch (`HopperFwdFp8`): e4m3 q, k, v, an `out_dtype` O (bf16 or
    fp16), FA3's descales (or `block_scales`, per 128 tokens) passed per call; split-KV as
    the problem asks (merged in the kernel), paged K/V read by the kernel (pages of a power
    of two, at least 8 rows)."""
    import torch

    from flash_cute.runtime.jit import current_target

    target = current_target()
    if target != "sm_90a":
        raise NotImplementedError(f"the FP8 forward runs on sm_90a only, not {target}")
    launch.check_head_dims("hopper FP8 forward", problem, FP8_SUPPORTED_HDIMS)
    if page_table is not None and not pages_in_kernel(k.shape[1]):
        raise NotImplementedError(f"the FP8 forward reads pages of a power of two of at least "
                                  f"{MIN_PAGE_ROWS} rows, not {k.shape[1]}")
    chosen = tuple(schedule or FP8_SCHEDULES[problem.hdim])
    pack = launch.packed_heads(problem, PACK_ROWS, chosen[0])
    splits = plan_splits(problem, chosen[0], chosen[1], pack, launch.device_sms(q.device))
    out_dtype = out_dtype or torch.bfloat16
    fp16 = out_dtype == torch.float16

    def make_kernel(*args, **kwargs):
        return _FP8_KERNEL(*args, out_dtype="fp16" if fp16 else "bf16",
                           block_scales=block_scales, **kwargs)

    name = "hopper.fwd_fp8" + (".fp16" if fp16 else "") + (".block" if block_scales else "")
    return launch_fwd.ForwardLaunch(name, make_kernel,
                                    q, k, v, problem, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                    seqused_k, chosen, COMPILE_OPTIONS, target,
                                    prepare=tma_ready, pack_gqa=pack, splits=splits,
                                    page_table=page_table, merge_in_kernel=True, ex2_per16=0,
                                    out_dtype=out_dtype, descales=3 if block_scales else 2)


def pages_in_kernel(page_size: int) -> bool:
    """Whether the forward reads pages of `page_size` rows itself (every schedule's tile_n
    then splits into boxes of whole swizzle atoms, `paged.page_chunk`)."""
    return page_size & (page_size - 1) == 0 and page_size >= MIN_PAGE_ROWS


def backward(dout, dlse, q, k, v, out, lse, problem: AttentionProblem, cu_seqlens_q=None,
             cu_seqlens_k=None, seqused_q=None, seqused_k=None, deterministic: bool = False,
             schedule=None, rng_seed=None):
    """(dq, dk, dv) through `HopperBwd` (see `flash_cute.runtime.launch_bwd.BackwardLaunch`);
    `deterministic` makes dQ bitwise reproducible. `schedule` overrides the `config.BwdSchedule` for
    ablations."""
    lengths = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    return plan_backward(dout, dlse, q, k, v, out, lse, problem, *lengths, deterministic,
                         schedule)(dout, dlse, q, k, v, out, lse, *lengths, rng_seed=rng_seed)


def plan_backward(dout, dlse, q, k, v, out, lse, problem: AttentionProblem, cu_seqlens_q=None,
                  cu_seqlens_k=None, seqused_q=None, seqused_k=None, deterministic: bool = False,
                  schedule=None, timeline=None) -> launch_bwd.BackwardLaunch:
    """The `launch_bwd.BackwardLaunch` of `backward`'s call configuration (`timeline`: the
    measured timeline's record buffer, `python -m flash_cute profile --backward`)."""
    from flash_cute.runtime.jit import current_target

    target = current_target()
    if target != "sm_90a":
        raise NotImplementedError(f"the hopper backward runs on sm_90a only, not {target}")
    launch.check_head_dims("hopper backward", problem, BWD_SUPPORTED_HDIMS)
    plan = _bwd_plan(problem.hdim, problem.hdim_v, problem.varlen,
                     short_causal(problem.causal, problem.max_seqlen_q, problem.max_seqlen_k,
                                  SHORT_CAUSAL_BWD_ROWS),
                     None if schedule is None else tuple(schedule), target,
                     problem.dropout_p > 0, problem.mods is not None)
    return launch_bwd.BackwardLaunch(plan, dout, dlse, q, k, v, out, lse, problem, cu_seqlens_q,
                                 cu_seqlens_k, seqused_q, seqused_k, deterministic,
                                 timeline=timeline)


@functools.lru_cache(maxsize=None)
def _bwd_plan(hdim: int, hdim_v: int, varlen: bool, short: bool, schedule, target: str,
              dropout: bool = False, mods: bool = False):
    """The `launch_bwd.BackwardPlan` of a backward configuration, worked out once: the schedule
    (`schedule` or the head dim's default, `short`: `config.short_causal`), where the dQ tile
    fits in shared memory the fragment-order dQaccum (`TiledDqAccum`), else one laid out like
    q, and `config.bwd_compile_options`; LSE₂ and Δ rows 16-byte aligned for their TMA."""
    from flash_cute.arch.hopper.host_dq_layout import TiledDqAccum

    schedule = BwdSchedule(*(schedule or bwd_schedule(hdim, varlen, short, dropout, mods)))
    dq_accum = (TiledDqAccum.of(schedule, hdim)
                if bwd_smem_plan(hdim, hdim_v, schedule).dq_tma else launch_bwd.RowDqAccum(16))
    return launch_bwd.BackwardPlan("hopper.bwd", _BWD_KERNEL, tuple(schedule),
                               bwd_compile_options(schedule), target, prepare=tma_ready,
                               dq_accum=dq_accum, row_stats_align=16)


# The pipeline dispatch runs: the descriptor joined to this planner's entry points.
PIPELINE = Pipeline.of(HOPPER, plan_forward=plan_forward, plan_backward=plan_backward,
                       check_supported=check_supported)
