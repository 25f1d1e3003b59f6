"""CPU checks of the Hopper backward's host-side choices: its shared-memory plan, the
deterministic dQ order (a model of the semaphore protocol on `block_range`/`m_block_range`),
and the compile key and semaphores of `launch_bwd.BackwardLaunch`."""

import random
from types import SimpleNamespace

import pytest
import torch

from flash_cute.arch.hopper.config import (
    BWD_SCHEDULES,
    BWD_SUPPORTED_HDIMS,
    SMEM_CAPACITY,
    BwdSchedule,
    bwd_mma_splits,
    bwd_smem_plan,
    do_stages,
)
from flash_cute.contract.block_range import block_range, m_block_range
from flash_cute.runtime.launch_bwd import backward_compile_key, dq_semaphores


@pytest.mark.parametrize("hdim,hdim_v", sorted(BWD_SUPPORTED_HDIMS))
def test_bwd_smem_plan_fits_and_keeps_dq_out_of_atomics(hdim, hdim_v):
    tile = BWD_SCHEDULES[hdim]
    plan = bwd_smem_plan(hdim, hdim_v, tile)
    assert plan.smem_bytes <= SMEM_CAPACITY
    assert plan.dq_tma
    # P/dS follow the rings' stages only where Q and dO have as many (else one buffer).
    assert plan.pds_stages == (tile.q_stages if do_stages(tile) == tile.q_stages else 1)


def test_bwd_smem_plan_falls_back_to_atomics_where_the_dq_tile_does_not_fit():
    plan = bwd_smem_plan(256, 256, BwdSchedule(64, 64, 2))
    assert not plan.dq_tma and plan.smem_bytes <= SMEM_CAPACITY


def test_varlen_dq_accum_tiles_of_different_sequences_never_overlap():
    """Every query tile of every sequence (lengths 0 to a few tiles, any packing) gets its
    own fragment-order dQaccum tile inside the allocation, so a tile's rows past its sequence
    (added as ±0) never land in another sequence's tile."""
    from flash_cute.arch.hopper.dq_accum import varlen_first_tile
    from flash_cute.arch.hopper.host_dq_layout import accum_shape

    rng = random.Random(5)
    for _ in range(500):
        tm = rng.choice([64, 128])
        lens = [rng.choice([0, 1, tm - 1, tm, tm + 1, rng.randint(0, 4 * tm)])
                for _ in range(rng.randint(1, 6))]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        total_q = cu[-1] + rng.choice([0, 0, 3])
        blocks = accum_shape(len(lens), 0, 1, tm, 64, total_q=total_q)[0]
        owner = {}
        for b, n in enumerate(lens):
            for m in range(-(-n // tm)):
                idx = varlen_first_tile(cu[b], b, tm) + m
                assert 0 <= idx < blocks and idx not in owner, (lens, tm, b, m, owner.get(idx))
                owner[idx] = b


def _n_blocks_that_visit(m, tm, tn, sq, sk, causal, left, right):
    """K/V blocks whose CTA walks query block m (the backward's loop over `m_block_range`)."""
    return [n for n in range(-(-sk // tn))
            if m in range(*m_block_range(n, tm, tn, sq, sk, causal, left, right))]


def test_deterministic_turns_are_0_to_count_minus_1_in_increasing_n():
    """Each query block's semaphore is bumped once by every K/V block that visits it, and the
    turn a block waits for (n - block_range(m).n_block_min, `bwd_blocks.dq_turn`) is its place
    among them: no block waits for a turn nobody gives (deadlock) or two share one."""
    rng = random.Random(11)
    for _ in range(300):
        sq, sk = rng.randint(1, 400), rng.randint(1, 400)
        tm, tn = 64, rng.choice([64, 128])
        causal = rng.random() < 0.4
        left = rng.choice([None, 0, 7, 100, 500])
        right = None if causal else rng.choice([None, 0, 13, 200])
        for m in range(-(-sq // tm)):
            visitors = _n_blocks_that_visit(m, tm, tn, sq, sk, causal, left, right)
            rng_m = block_range(m, tm, tn, sq, sk, causal, left, right)
            turns = [n - rng_m.n_block_min for n in visitors]
            assert turns == list(range(len(visitors))), (sq, sk, tn, causal, left, right, m)


def _problem(**kw):
    base = dict(causal=False, window_left=None, window_right=None, softcap=0.0, varlen=False,
                nheads=8, nheads_kv=8, hdim=128, hdim_v=128, batch=3, max_seqlen_q=1000,
                has_seqused_q=False, has_seqused_k=False, dropout_p=0.0)
    base.update(kw)
    p = SimpleNamespace(**base)
    p.qheads_per_kvhead = p.nheads // p.nheads_kv
    return p


def test_backward_compile_key_tells_deterministic_and_gqa_apart():
    p = _problem()
    det = backward_compile_key("hopper.bwd", "sm_90a", "bf16", p, (64, 128, 2), True)
    nondet = backward_compile_key("hopper.bwd", "sm_90a", "bf16", p, (64, 128, 2), False)
    assert det != nondet and ("deterministic", True) in det.flags
    ampere = backward_compile_key("ampere.bwd", "sm_80", "bf16", p, (64, 128, 8))
    assert ("deterministic", False) in ampere.flags
    gqa = backward_compile_key("hopper.bwd", "sm_90a", "bf16", _problem(nheads_kv=2),
                               (64, 128, 2), False)
    assert ("dkv_fp32", True) in gqa.flags and ("dkv_fp32", False) in nondet.flags


def test_dq_semaphores_one_zeroed_int32_per_query_tile_head_and_batch():
    sem = dq_semaphores(_problem(batch=3, nheads=5, max_seqlen_q=129), 64, "cpu")
    assert sem.shape == (3, 5, 3) and sem.dtype == torch.int32 and not sem.any()


def test_lse_and_delta_stages_start_128_byte_aligned():
    """A TMA destination must be 128-byte aligned: each stage of the LSE₂/Δ rings is padded
    to a multiple of 32 floats (80 query rows: 96), and the shared-memory plan counts that."""
    from flash_cute.arch.hopper.config import BwdSchedule, bwd_smem_plan, stats_stage_rows

    assert [stats_stage_rows(m) for m in (64, 80, 128)] == [64, 96, 128]
    plan = bwd_smem_plan(128, 128, BwdSchedule(80, 128, 2, True))
    assert plan.dq_tma and plan.pds_stages == 2 and plan.smem_bytes <= 227 * 1024


def test_bwd_smem_plan_fits_fa4_hdim_256_schedule_with_two_q_stages():
    """48 keys with dK/dV transposed (FA4's hdim-256 schedule): two Q stages, one dO stage and
    the dQ tile fit, with one P/dS buffer; two dO stages would not leave room for the tile."""
    plan = bwd_smem_plan(256, 256, BwdSchedule(64, 48, 2, swap_dkv=True, do_stages=1))
    assert plan.dq_tma and plan.pds_stages == 1 and plan.smem_bytes <= SMEM_CAPACITY
    assert not bwd_smem_plan(256, 256, BwdSchedule(64, 48, 2, swap_dkv=True)).dq_tma


def test_bwd_mma_splits_of_transposed_dkv():
    """swap_dkv: the head dim on WGMMA's M, split by warpgroup where it is a multiple of 128,
    else the keys; separate Q/dO stage counts and odd key tiles only with it."""
    assert bwd_mma_splits(BwdSchedule(64, 48, 2, swap_dkv=True), 256)["dkv"] == (2, 1)
    assert bwd_mma_splits(BwdSchedule(64, 96, 2, swap_dkv=True), 192)["dkv"] == (1, 2)
    for bad in (BwdSchedule(64, 48, 2), BwdSchedule(64, 64, 2, do_stages=1),
                BwdSchedule(64, 40, 2, swap_dkv=True), BwdSchedule(80, 48, 2, swap_dkv=True)):
        with pytest.raises(ValueError):
            bwd_mma_splits(bad, 256)


def test_short_causal_backward_takes_64_rows_at_hdim_128(monkeypatch):
    """hdim 128's 80-row tile takes 64 rows (still transposed scores) for causal problems up to
    SHORT_CAUSAL_BWD_ROWS query rows and keys; other head dims, varlen, longer and
    non-causal problems keep theirs; `api.plan_backward` hands the launcher a plan with that tile
    and the dQaccum layout of it."""
    from flash_cute.arch.hopper import planner as api
    from flash_cute.arch.hopper.config import bwd_schedule
    from flash_cute.runtime import jit, launch_bwd
    from flash_cute.runtime.problem import validate_attention_inputs

    assert bwd_schedule(128, short=True) == BWD_SCHEDULES[128]._replace(tile_m=64)
    assert bwd_schedule(128) == BWD_SCHEDULES[128]
    assert bwd_schedule(64, short=True) == BWD_SCHEDULES[64]
    assert bwd_schedule(256, short=True) == BWD_SCHEDULES[256]
    assert bwd_schedule(128, varlen=True, short=True) == BwdSchedule(64, 128, 2, dq_per_wg=True)

    seen = []
    monkeypatch.setattr(jit, "current_target", lambda: "sm_90a")
    monkeypatch.setattr(launch_bwd, "BackwardLaunch", lambda plan, *a, **k: seen.append(plan))
    for sq, sk, causal in [(512, 512, True), (513, 513, True), (500, 500, False),
                           (500, 2000, True)]:
        q = torch.randn(1, sq, 2, 128, dtype=torch.bfloat16)
        k = torch.randn(1, sk, 2, 128, dtype=torch.bfloat16)
        problem = validate_attention_inputs(q, k, k, causal=causal, require_cuda=False)
        api.plan_backward(q, None, q, k, k, q, None, problem)
    assert [plan.schedule[0] for plan in seen] == [64, 80, 80, 80]
    # The dQ postprocess reads the tiles the main kernel wrote: 64 rows, dQ not transposed,
    # for the short problem; 80 rows of dQᵀ otherwise.
    layouts = [(plan.dq_accum.tile_m, plan.dq_accum.swapped) for plan in seen]
    assert layouts == [(64, False)] + [(80, True)] * 3
