"""CPU checks of the Hopper forward's host-side choices: the schedule per head dim and packing
(`config.fwd_schedule`, `config.with_switches`), the register split per number of consumer
warpgroups, and what `HopperFwd` refuses before any compile."""

import pytest

from flash_cute.arch.hopper.config import (
    CTA_PAIR_SMEM,
    CTAS_PER_SM,
    DECODE_PAIR,
    FWD_SCHEDULES,
    PACK_ROWS,
    ROLE_REGISTERS,
    SMEM_CAPACITY,
    SUPPORTED_HDIMS,
    FwdSchedule,
    fwd_schedule,
    smem_bytes,
    with_switches,
)


@pytest.mark.parametrize("consumers", sorted(ROLE_REGISTERS))
def test_role_registers_give_the_launch_budget_to_the_roles(consumers):
    """setmaxnreg moves registers, it does not create them: the producer's 128 threads and the
    consumers' together hold what the CTA gets at launch (65536 / threads / CTAs per SM,
    rounded down to 8)."""
    producer, consumer = ROLE_REGISTERS[consumers]
    threads = 128 * (1 + consumers)
    at_launch = 65536 // (threads * CTAS_PER_SM.get(consumers, 1)) // 8 * 8
    assert producer % 8 == 0 and consumer % 8 == 0
    assert 128 * producer + 128 * consumers * consumer == threads * at_launch


def test_the_decode_pair_fits_two_ctas_per_sm():
    """`DECODE_PAIR`: one consumer warpgroup, so two CTAs per SM, each within half the shared
    memory with its split partials stored by rows."""
    assert DECODE_PAIR.tile_m == 64 and CTAS_PER_SM[DECODE_PAIR.tile_m // 64] == 2
    assert smem_bytes(128, 128, DECODE_PAIR, True) <= CTA_PAIR_SMEM


def test_the_decode_pair_keeps_seqlen_k_per_split_batch_invariant():
    """The pair runs for one sequence only; where the caller fixed the split length, which
    promises a sequence's bits whatever batch it is in, it does not run even then."""
    import torch

    from flash_cute.arch.hopper.planner import takes_decode_pair
    from flash_cute.runtime.problem import validate_attention_inputs

    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 8192, 8, 128, dtype=torch.bfloat16)

    def problem(batch, **kw):
        return validate_attention_inputs(q.expand(batch, -1, -1, -1),
                                         k.expand(batch, -1, -1, -1),
                                         k.expand(batch, -1, -1, -1), require_cuda=False,
                                         num_splits=0, **kw)
    assert takes_decode_pair(problem(1), 4, False)
    assert not takes_decode_pair(problem(3), 4, False)
    assert not takes_decode_pair(problem(1, seqlen_k_per_split=1024), 4, False)


@pytest.mark.parametrize("hdim,hdim_v", sorted(SUPPORTED_HDIMS))
@pytest.mark.parametrize("rows_past_sequence", [False, True])
def test_every_schedule_fits_shared_memory(hdim, hdim_v, rows_past_sequence):
    for pack in (1, 2, 8, PACK_ROWS):
        tile = fwd_schedule(hdim, pack, rows_past_sequence)
        assert tile.tile_m % pack == 0 or pack == 1
        assert smem_bytes(hdim, hdim_v, tile, rows_past_sequence) <= SMEM_CAPACITY


def test_fwd_schedule_keeps_192_rows_only_where_they_compile_without_spills():
    assert FWD_SCHEDULES[64].tile_m == 192 and FWD_SCHEDULES[64].persistent
    assert fwd_schedule(64) == FWD_SCHEDULES[64]
    assert fwd_schedule(64, 8) == FWD_SCHEDULES[64]                        # padded packed: O by TMA
    assert fwd_schedule(64, 8, rows_past_sequence=True).tile_m == 128
    assert fwd_schedule(64, PACK_ROWS).tile_m == 128               # 128 heads do not divide 192
    assert fwd_schedule(128, 8, rows_past_sequence=True) == FWD_SCHEDULES[128]


def test_short_causal_problems_take_128_rows():
    """Causal problems up to SHORT_CAUSAL_ROWS query rows (a head's, times the packing) run
    hdim 64 on 128-row tiles and hdim 256 on 64 key columns; longer ones, or without the
    mask, the head dim's tile; other head dims keep theirs."""
    from flash_cute.arch.hopper.config import SHORT_CAUSAL_ROWS, short_causal

    assert short_causal(True, 512, 512) and short_causal(True, SHORT_CAUSAL_ROWS, 300)
    assert not short_causal(True, SHORT_CAUSAL_ROWS + 1, 512)
    assert not short_causal(False, 512, 512) and not short_causal(True, 0, 512)
    assert not short_causal(True, 512, SHORT_CAUSAL_ROWS + 1)   # keys far past the queries
    assert fwd_schedule(64, short=True) == FWD_SCHEDULES[64]._replace(tile_m=128)
    assert fwd_schedule(64) == FWD_SCHEDULES[64]
    assert fwd_schedule(128, short=True) == FWD_SCHEDULES[128]
    assert fwd_schedule(256, short=True) == FWD_SCHEDULES[256]._replace(tile_n=64)
    assert fwd_schedule(256) == FWD_SCHEDULES[256]


def test_hopper_forward_dispatch_picks_the_short_causal_tile(monkeypatch):
    """`api.plan_forward` hands the launcher 128 rows for a 1k causal hdim-64 problem (and for a
    packed one whose packed rows stay short), 192 for 4k causal, 1k without the mask, 1k
    causal with 4 heads packed per tile (4k packed rows), or 1k queries on 4k keys."""
    import torch

    from flash_cute.arch.hopper import planner as api
    from flash_cute.runtime import jit, launch_fwd
    from flash_cute.runtime.problem import validate_attention_inputs

    seen = []
    monkeypatch.setattr(jit, "current_target", lambda: "sm_90a")
    monkeypatch.setattr(launch_fwd, "ForwardLaunch",
                        lambda *a, **kw: seen.append((a[10][0], kw["pack_gqa"])))
    for sq, sk, causal, heads_kv, pack in [(1024, 1024, True, 4, None),
                                           (4096, 4096, True, 4, None),
                                           (1024, 1024, False, 4, None),
                                           (200, 200, True, 1, None),
                                           (1024, 1024, True, 1, True),
                                           (1024, 4096, True, 4, None)]:
        q = torch.randn(1, sq, 4, 64, dtype=torch.bfloat16)
        k = torch.randn(1, sk, heads_kv, 64, dtype=torch.bfloat16)
        problem = validate_attention_inputs(q, k, k.clone(), causal=causal, pack_gqa=pack,
                                            require_cuda=False)
        api.plan_forward(q, k, k.clone(), problem)
    assert seen == [(128, 1), (192, 1), (192, 1), (128, 4), (192, 4), (192, 1)]


def test_with_switches_runs_192_rows_persistent_only():
    base = FWD_SCHEDULES[64]
    assert with_switches(base, pingpong=False) == base._replace(pingpong=False)
    assert with_switches(base, persistent=False) == base._replace(tile_m=128, persistent=False)
    assert with_switches(FWD_SCHEDULES[128], persistent=False).tile_m == 128


def test_hopper_fwd_refuses_schedules_it_cannot_run():
    from cutlass import BFloat16

    from flash_cute.arch.hopper.fwd import HopperFwd
    from flash_cute.contract.variant import Variant

    with pytest.raises(ValueError, match="192-row tiles run persistent only"):
        HopperFwd(BFloat16, 64, schedule=FwdSchedule(192, 128, 2, persistent=False))
    with pytest.raises(ValueError, match="tile_m must be 64 x"):
        HopperFwd(BFloat16, 64, schedule=FwdSchedule(256, 128, 2, persistent=True))
    with pytest.raises(ValueError, match="pack_gqa 3 must divide tile_m 128"):
        HopperFwd(BFloat16, 128, variant=Variant(pack_gqa=3))
    kernel = HopperFwd(BFloat16, 64)
    assert (kernel.num_wg, kernel.num_threads) == (3, 512)
    assert (kernel.producer_registers, kernel.consumer_registers) == ROLE_REGISTERS[3]


def test_decode_dispatch_takes_the_two_cta_pair_where_it_was_measured(monkeypatch):
    """`plan_forward` gives `DECODE_PAIR` to split decode of one sequence at hdim 128 (one
    query, 32 heads on 8: 4 packed rows; also causal, and 2 queries), and the head dim's own
    schedule to what the pair was not measured with: no split (num_splits 1), a batch of
    2 or 64, more than 8 packed rows, softcap, a window, hdim 64."""
    import torch

    from flash_cute.arch.hopper import planner as api
    from flash_cute.runtime import jit, launch_fwd
    from flash_cute.runtime.problem import validate_attention_inputs

    seen = []
    monkeypatch.setattr(jit, "current_target", lambda: "sm_90a")
    monkeypatch.setattr(launch_fwd, "ForwardLaunch",
                        lambda *a, **kw: seen.append(tuple(a[10]) == tuple(DECODE_PAIR)))
    cases = [(1, 1, 128, {}, True), (1, 2, 128, {"causal": True}, True),
             (1, 1, 128, {"num_splits": 1}, False), (64, 1, 128, {}, False),
             (2, 1, 128, {}, False), (1, 3, 128, {}, False),
             (1, 1, 128, {"softcap": 30.0}, False),
             (1, 1, 128, {"window_size": (1024, 0)}, False), (1, 1, 64, {}, False)]
    for batch, sq, d, kw, _ in cases:
        q = torch.randn(batch, sq, 32, d, dtype=torch.bfloat16)
        k = torch.randn(batch, 8192, 8, d, dtype=torch.bfloat16)
        kw = {"num_splits": 0, **kw}
        problem = validate_attention_inputs(q, k, k.clone(), require_cuda=False, **kw)
        api.plan_forward(q, k, k.clone(), problem)
    assert seen == [want for *_, want in cases]
