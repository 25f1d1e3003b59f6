"""The blackwell forward on the CPU: its budgets against sm100's limits, its dispatch (opt-in:
compile-verified only), and its SASS, cross-compiled for sm_100a: tcgen05 MMAs, tensor memory
allocated and freed, no spill, the software exp2's share, and a static check of its
synchronization (`check_pipeline`)."""

import re

import pytest
import torch

from flash_cute.arch.blackwell import config
from flash_cute.arch.blackwell.inspect_configs import CONFIGS as ALL_CONFIGS
from flash_cute.runtime import dispatch

# The forward's configs (the backward's are `tests/test_blackwell_bwd.py`'s).
CONFIGS = [c for c in ALL_CONFIGS if c.kernel == "blackwell.fwd"]


def test_every_schedule_fits_tensor_and_shared_memory():
    """Two S buffers and O per Q tile within 512 TMEM columns (P in S's upper half); the
    rings, the Q tiles, the barriers and the 1 KiB static within 227 KiB; registers at most
    4 x 128 per thread across the warpgroups, each a multiple of 8 from 24 to 256. One Q
    tile only where two do not fit (hdim 256)."""
    for (hdim, hdim_v), schedule in config.FWD_SCHEDULES.items():
        qt = schedule.q_tiles
        plan = config.tmem_plan(schedule.tile_n, hdim_v, qt)
        assert plan.s == (0, schedule.tile_n) and plan.o[0] == 2 * schedule.tile_n
        assert plan.p == (schedule.tile_n // 2, schedule.tile_n * 3 // 2)
        assert len(plan.o) == qt and plan.o[-1] + hdim_v <= plan.columns <= config.TMEM_COLUMNS
        assert plan.columns & (plan.columns - 1) == 0 and plan.columns >= 32
        total = config.smem_bytes(hdim, hdim_v, schedule) + config.STATIC_SMEM
        assert total <= config.SMEM_CAPACITY, (hdim, hdim_v, total)
        assert schedule.k_stages >= 2 and schedule.v_stages >= 1
        if qt == 1:
            with pytest.raises(ValueError, match="tensor memory"):
                config.tmem_plan(schedule.tile_n, hdim_v, 2)
    for registers in (config.ROLE_REGISTERS, config.ROLE_REGISTERS_ONE_TILE):
        assert sum(registers) <= 4 * 128
        assert all(r % 8 == 0 and 24 <= r <= 256 for r in registers)
    assert sum(config.ROLE_REGISTERS) == 4 * 128
    with pytest.raises(ValueError, match="tensor memory"):
        config.tmem_plan(128, 256)


def test_default_exp2_share_is_fa4s_per_case():
    assert config.default_ex2_per16(128, True) == config.default_ex2_per16(64, False) == 2
    assert config.default_ex2_per16(192, True) == 1 and config.default_ex2_per16(192, False) == 2


def test_blackwell_runs_only_when_named(capability):
    """Not hardware-tested: on a 10.x device dispatch picks the ampere code unless
    arch="blackwell" names it; its backward then runs in its own backward."""
    from flash_cute.runtime.dispatch import AMPERE, BLACKWELL
    from flash_cute.runtime.problem import validate_attention_inputs

    capability(10, 0)
    device = torch.device("cuda")
    q = torch.randn(1, 300, 4, 128, dtype=torch.bfloat16)
    problem = validate_attention_inputs(q, q, q, causal=True, require_cuda=False)
    assert not BLACKWELL.hardware_tested
    assert dispatch.select_pipeline(device, None, problem) is AMPERE
    assert dispatch.select_pipeline(device, "blackwell", problem) is BLACKWELL
    assert dispatch.select_backward_pipeline(device, BLACKWELL, problem) is BLACKWELL
    assert dispatch.select_backward_pipeline(device, AMPERE, problem) is AMPERE
    capability(9, 0)
    with pytest.raises(ValueError, match="runs on compute capability 10"):
        dispatch.select_pipeline(device, "blackwell", problem)


def test_an_environment_switch_admits_it_where_it_takes_the_problem(capability, monkeypatch):
    """FLASH_CUTE_ALLOW_UNTESTED=blackwell: dispatch picks it on 10.x for the head dims it
    has, and the ampere code for the others."""
    from flash_cute.runtime.dispatch import AMPERE, BLACKWELL
    from flash_cute.runtime.problem import validate_attention_inputs

    capability(10, 0)
    monkeypatch.setenv(dispatch.ALLOW_UNTESTED_ENV, "blackwell")
    device = torch.device("cuda")
    for hdim, chosen in ((128, BLACKWELL), (64, BLACKWELL), (96, AMPERE), (256, BLACKWELL)):
        q = torch.randn(1, 100, 2, hdim, dtype=torch.bfloat16)
        problem = validate_attention_inputs(q, q, q, require_cuda=False)
        assert dispatch.select_pipeline(device, None, problem) is chosen
    # Every head dim it takes has its backward too: a call that needs one stays with it.
    assert config.BWD_HDIMS == config.SUPPORTED_HDIMS
    q = torch.randn(1, 100, 2, 256, dtype=torch.bfloat16)
    problem = validate_attention_inputs(q, q, q, require_cuda=False)
    assert dispatch.select_pipeline(device, None, problem, backward=True) is BLACKWELL


def test_takes_refuses_a_backward_its_schedules_lack(monkeypatch):
    """A head dim with a forward schedule and no backward one goes to another pipeline when
    the call needs the backward (its forward included: one pipeline for both directions)."""
    from flash_cute.arch.blackwell import planner
    from flash_cute.runtime.problem import validate_attention_inputs

    q = torch.randn(1, 100, 2, 256, dtype=torch.bfloat16)
    problem = validate_attention_inputs(q, q, q, require_cuda=False)
    assert planner.takes(problem) and planner.takes(problem, backward=True)
    monkeypatch.setattr(planner, "BWD_HDIMS", tuple(d for d in config.BWD_HDIMS
                                                    if d != (256, 256)))
    assert planner.takes(problem) and not planner.takes(problem, backward=True)


def test_blackwell_refuses_what_it_lacks_before_any_launch():
    from flash_cute.arch.blackwell.planner import check_supported
    from flash_cute.runtime.problem import validate_attention_inputs

    q = torch.randn(1, 64, 4, 96, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"head dims \(96, 96\)"):
        check_supported(validate_attention_inputs(q, q, q, require_cuda=False))
    q = torch.randn(1, 64, 6, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="pack_gqa=True: 3 query heads"):
        check_supported(validate_attention_inputs(q, k, k, pack_gqa=True, require_cuda=False))


# ---------------------------------------------------------------- SASS

_ROLES = ("softmax 0", "softmax 1", "correction", "mma, load")


def check_pipeline(sass: str, q_tiles: int = 2) -> dict:
    """Static checks of the kernel's synchronization that make a silent hang or a leak of
    tensor memory unlikely (none needs hardware); returns the opcodes of each role.

    * Tensor memory is allocated (UTCATOMSWS.FIND_AND_SET) after the barriers are set up and
      before the roles split (USETMAXREG), then every thread meets at a named barrier over
      all 512 threads, so no role reads the address before it exists.
    * No thread exits before the roles join (the last BAR.SYNC 0): a role that left early
      would leave the others waiting at the join, or the allocation unfreed. After the join
      the tensor memory is freed (UTCATOMSWS.AND) exactly once, before the kernel's last EXIT.
    * Each role's waits have a signaller: the softmax warpgroups (one with `q_tiles` 1, the
      other idle: no wait, arrive or TMEM access in its section) wait for S (a tcgen05.commit,
      UTCBAR, in the MMA warp) and for the correction's release of their hand-over slot (an
      arrive there); the correction waits for the softmax's hand-over (arrives there) and for
      O (UTCBAR); the MMA warp waits for TMA bytes (UTMALDG in the load warp) and for P (arrives
      in both the softmax and correction warpgroups). Every mbarrier the kernel waits on is
      initialized (SYNCS.EXCH.64) before the first barrier over the CTA.

    It does not prove that the phases agree: that rests on every role walking the same tiles
    and block counts (`BlackwellFwd` docstring), on the protocol model
    (`tests/test_blackwell_protocol.py`) and on the hardware runs still to come."""
    lines = [ln.split(";")[0].strip() for ln in sass.splitlines()]
    ops = [re.sub(r"^/\*[0-9a-f]+\*/\s*", "", ln) for ln in lines]
    ops = [op for op in ops if op and not op.startswith(("//", ".", "{", "}"))]
    index = {name: [i for i, op in enumerate(ops) if re.search(name, op)]
             for name in ("USETMAXREG", r"UTCATOMSWS\.FIND_AND_SET", r"UTCATOMSWS\.AND",
                          r"BAR\.SYNC\S* 0x0\b", r"BAR\.SYNC\S* 0x1, 0x200", r"\bEXIT\b",
                          r"SYNCS\.EXCH\.64")}
    roles = index["USETMAXREG"]
    assert len(roles) == 4, "four warpgroup roles"
    joins = index[r"BAR\.SYNC\S* 0x0\b"]
    assert len(joins) >= 2 and joins[-1] > roles[-1] and joins[0] < roles[0]
    assert index[r"SYNCS\.EXCH\.64"] and max(index[r"SYNCS\.EXCH\.64"]) < joins[0]
    allocs = index[r"UTCATOMSWS\.FIND_AND_SET"]
    assert allocs and joins[0] < min(allocs) and max(allocs) < roles[0]
    assert index[r"BAR\.SYNC\S* 0x1, 0x200"], "the allocation is published to all 512 threads"
    assert max(allocs) < index[r"BAR\.SYNC\S* 0x1, 0x200"][0] < roles[0]
    exits = index[r"\bEXIT\b"]
    assert exits and min(exits) > joins[-1], "no thread leaves before the roles join"
    frees = index[r"UTCATOMSWS\.AND"]
    assert len(frees) == 1 and joins[-1] < frees[0] < exits[-1]
    sections = {}
    bounds = roles + [joins[-1]]
    for name, lo, hi in zip(_ROLES, bounds, bounds[1:]):
        sections[name] = ops[lo:hi]

    def has(section, pattern):
        return any(re.search(pattern, op) for op in sections[section])

    wait, arrive, commit, tma = r"SYNCS\.PHASECHK", r"SYNCS\.ARRIVE", r"^UTCBAR", r"^UTMALDG"
    for s in ("softmax 0", "softmax 1")[:q_tiles]:
        assert has(s, wait) and has(s, arrive) and has(s, "^LDTM") and has(s, "^STTM")
    if q_tiles == 1:
        assert not any(has("softmax 1", p) for p in (wait, arrive, "^LDTM", "^STTM")), \
            "the idle warpgroup takes part in no handshake"
    assert has("correction", wait) and has("correction", arrive)
    assert has("mma, load", wait) and has("mma, load", commit) and has("mma, load", tma)
    assert has("mma, load", r"^UTCHMMA")
    assert not any(has(s, r"^UTCHMMA") or has(s, tma) for s in _ROLES[:3])
    return {name: len(sec) for name, sec in sections.items()}


def mufu_ex2_expected(entry) -> int:
    """MUFU.EX2 of a config: each softmax warpgroup's row of tile_n scores less the emulated
    share, plus its one rescale factor; the warpgroups' (one per Q tile) code is separate."""
    per16 = entry.flag_dict.get("ex2_emu", 0)
    tile_n = entry.schedule.tile_n
    return entry.schedule.q_tiles * (tile_n - tile_n * per16 // 16 + 1)


def _has_score_mod(entry) -> bool:
    from flash_cute.tools.kernel_config import example_spec

    name = entry.flag_dict.get("mods")
    if name is None:
        return False
    spec = example_spec(name)
    return getattr(spec, "score", None) is not None or getattr(spec, "score_mod", None) \
        is not None


def _inspect_entry(entry) -> dict:
    """The fields of an `inspect` entry that `test_inspect.known_spill` reads."""
    return {"kernel": entry.kernel, "target": "sm_100a", "config": {**entry.flag_dict,
                                                                    "hdim": entry.hdim}}


def _check_sass(entry, art):
    from flash_cute.tools.sass import opcode_counts

    ops = opcode_counts(art.sass)
    assert ops.get("UTCHMMA", 0) > 0, "QKᵀ and PV on tcgen05"
    assert ops.get("UTCATOMSWS.FIND_AND_SET", 0) > 0 and ops.get("UTCATOMSWS.AND", 0) == 1
    assert ops.get("UTMALDG", 0) > 0 and ops.get("LDTM", 0) > 0 and ops.get("STTM", 0) > 0
    assert ops.get("HGMMA", 0) == 0 and ops.get("HMMA", 0) == 0
    from test_inspect import known_spill  # the pinned spills, one list for every kernel

    if known_spill(_inspect_entry(entry)) is None:
        assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0
    mods = "mods" in entry.flag_dict
    # A mod's own exp or tanh (FA4's softcap) takes MUFU.EX2 too.
    ex2 = ops.get("MUFU.EX2", 0)
    assert ex2 >= mufu_ex2_expected(entry) if mods else ex2 == mufu_ex2_expected(entry), (
        entry.flag_dict, ops)
    # The emulated share by packed pairs (scalar beside softcap or a score mod): one
    # round-down FADD2 per pair of each row.
    tile_n, per16 = entry.schedule.tile_n, entry.flag_dict.get("ex2_emu", 0)
    scalar = entry.flag_dict["softcap"] or _has_score_mod(entry)
    pairs = 0 if scalar else entry.schedule.q_tiles * (tile_n * per16 // 16) // 2
    assert ops.get("FADD2.FTZ.RM", 0) == pairs, ops
    # The mods' pass over S in tensor memory writes 32 columns at a time (D-BW-MODS); P
    # goes out 16 words at a time.
    assert bool(re.search(r"STTM\.x32\b", art.sass)) == mods
    check_pipeline(art.sass, entry.schedule.q_tiles)


def test_the_causal_hdim128_forward_cross_compiles_with_its_pipeline_intact(tmp_path):
    """One config in the default run (the rest in the `slow` sweep)."""
    from flash_cute.tools.xcompile import compile_for_target

    entry = next(c for c in CONFIGS if c.hdim == 128 and c.flag_dict == {
        **c.flag_dict, "causal": True, "varlen": False, "ex2_emu": 2})
    _check_sass(entry, compile_for_target(entry, "sm_100a", out_dir=tmp_path))


@pytest.mark.slow   # one of the slow forward sweep's configs, checked alone
def test_the_document_mask_cross_compiles_spill_free_with_its_pipeline_intact(tmp_path):
    """A mask mod that loads per key (a document id): its values beside a 32-column chunk of
    S in the pass over tensor memory, not beside the 128-column row (D-BW-MODS)."""
    from flash_cute.tools.xcompile import compile_for_target

    entry = next(c for c in CONFIGS if c.flag_dict.get("mods") == "document")
    _check_sass(entry, compile_for_target(entry, "sm_100a", out_dir=tmp_path))


def test_blackwell_takes_mods_and_block_masks():
    """Dispatch: mods and a block mask's sparsity are capabilities of the blackwell forward
    (which still runs only when named: compile-verified only)."""
    import dataclasses

    from flash_cute import create_block_mask
    from flash_cute.contract.descriptor import required_capabilities
    from flash_cute.runtime.dispatch import BLACKWELL
    from flash_cute.runtime.problem import validate_attention_inputs
    from flash_cute.variants import registry

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    q = torch.randn(1, 256, 4, 128, dtype=torch.bfloat16)
    base = validate_attention_inputs(q, q, q, require_cuda=False)
    mods = dataclasses.replace(base, mods=registry.lookup(registry.register(None, causal)))
    assert BLACKWELL.missing(required_capabilities(mods)) is None
    block_mask = create_block_mask(causal, 1, 1, 256, 256, device="cpu")
    sparse = dataclasses.replace(base, mods=registry.lookup(
        registry.register(None, causal, block_mask)))
    assert BLACKWELL.missing(required_capabilities(sparse)) is None
    assert not BLACKWELL.hardware_tested


def _causal_block_mask_tiles(backward: bool, **pad):
    """A causal block mask over 300 x 300 (3 tiles of 128 each way) as `SparseTiles` gives
    it, plain and padded by `pad` (`q_tiles_per_cta` or `key_tiles_per_cta`)."""
    import dataclasses

    from flash_cute import create_block_mask
    from flash_cute.runtime import launch
    from flash_cute.runtime.problem import validate_attention_inputs
    from flash_cute.variants import registry

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    q = torch.randn(1, 300, 2, 128, dtype=torch.bfloat16)
    block_mask = create_block_mask(causal, 1, 1, 300, 300, device="cpu")
    problem = dataclasses.replace(
        validate_attention_inputs(q, q, q, require_cuda=False),
        mods=registry.lookup(registry.register(None, causal, block_mask)))
    return (launch.SparseTiles(problem, (128, 128), backward=backward).tensors,
            launch.SparseTiles(problem, (128, 128), backward=backward, **pad).tensors)


def test_a_block_mask_reaches_the_256_row_tiles_padded_with_empty_query_tiles():
    """The blackwell CTA walks two 128-row Q tiles: a block mask's tiles come padded to whole
    CTA tiles, the padding empty (its rows are past every sequence), so the kernel's reads of
    a second Q tile's state and range stay inside the tensors."""
    from flash_cute.variants.block_mask import EMPTY

    plain, (states, ranges) = _causal_block_mask_tiles(False, q_tiles_per_cta=2)
    assert plain[0].shape[2] == 3 and states.shape[2] == 4 and ranges.shape[2] == 4
    assert torch.equal(states[:, :, :3], plain[0]) and torch.equal(ranges[:, :, :3], plain[1])
    assert (states[:, :, 3] == EMPTY).all() and (ranges[:, :, 3] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("entry", CONFIGS, ids=lambda e: e.label)
def test_every_blackwell_config_has_its_pipeline_intact(entry, tmp_path):
    from flash_cute.tools.xcompile import compile_for_target

    _check_sass(entry, compile_for_target(entry, "sm_100a", out_dir=tmp_path))


def test_check_pipeline_catches_an_early_exit_and_a_missing_free():
    """The static check fails on the faults it is for (SASS edited by hand)."""
    from flash_cute.tools.xcompile import compile_for_target

    entry = next(c for c in CONFIGS if c.hdim == 64)
    sass = compile_for_target(entry, "sm_100a").sass
    check_pipeline(sass)
    lines = sass.splitlines()
    first_role = next(i for i, ln in enumerate(lines) if "USETMAXREG" in ln)
    early = "\n".join(lines[:first_role + 1] + ["        /*0000*/   EXIT ;"]
                      + lines[first_role + 1:])
    with pytest.raises(AssertionError, match="leaves before"):
        check_pipeline(early)
    leak = "\n".join(ln for ln in lines if "UTCATOMSWS.AND" not in ln)
    with pytest.raises(AssertionError):
        check_pipeline(leak)


# ---------------------------------------------------------------- the backward's host side

def test_compute_capability_10_3_compiles_for_the_family_target():
    """sm_100a cubins do not load on 10.3 (B300): its kernels compile for sm_100f, which the
    blackwell planners take beside sm_100a."""
    from flash_cute.arch.blackwell.planner import TARGETS
    from flash_cute.runtime.jit import target_of

    assert target_of(10, 0) == "sm_100a" and target_of(10, 3) == "sm_100f"
    assert target_of(9, 0) == "sm_90a" and target_of(8, 6) == "sm_80"
    assert set(TARGETS) == {"sm_100a", "sm_100f"}


def test_every_capability_the_descriptor_claims_reaches_a_backward_that_takes_it():
    """One capability set for both directions: each feature a call can bring to the
    blackwell backward builds its kernel (no ValueError), and what it refuses is refused by
    the planner first, by name."""
    import cutlass

    from flash_cute.arch.blackwell.bwd import BlackwellBwd
    from flash_cute.contract import descriptor as caps
    from flash_cute.contract.variant import Variant
    from flash_cute.runtime.dispatch import BLACKWELL
    from flash_cute.variants import registry
    from flash_cute.variants.kernel_view import kernel_mods

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    mods = kernel_mods(registry.lookup(registry.register(None, causal)), False)[0]
    variants = {caps.CAUSAL: Variant(causal=True), caps.LOCAL: Variant(window_left=True,
                                                                       window_right=True),
                caps.SOFTCAP: Variant(softcap=True), caps.VARLEN: Variant(varlen=True),
                caps.SEQUSED: Variant(seqused_q=True, seqused_k=True),
                caps.MODS: Variant(mods=mods)}
    assert caps.BACKWARD in BLACKWELL.capabilities and BLACKWELL.has_backward
    for cap, variant in variants.items():
        for dims in ((64, 64), (128, 128), (192, 128)):
            BlackwellBwd(cutlass.BFloat16, *dims, variant)
    BlackwellBwd(cutlass.Float16, 128, 128, Variant(causal=True), deterministic=True)
    for refused in (Variant(dropout=True), Variant(pack_gqa=4)):
        with pytest.raises(ValueError, match="no .* yet"):
            BlackwellBwd(cutlass.BFloat16, 128, 128, refused)
    assert caps.DROPOUT not in BLACKWELL.capabilities


def test_the_backward_refuses_learnable_captured_tensors_by_name():
    import dataclasses

    from flash_cute.arch.blackwell.planner import check_supported
    from flash_cute.runtime.problem import validate_attention_inputs

    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    problem = validate_attention_inputs(q, q, q, require_cuda=False)
    check_supported(problem, backward=True)
    with pytest.raises(NotImplementedError, match="learnable captured tensors"):
        check_supported(dataclasses.replace(problem, mod_grads=True), backward=True)
    q = torch.randn(1, 64, 2, 96, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="head dims"):
        check_supported(validate_attention_inputs(q, q, q, require_cuda=False), backward=True)


def test_a_block_mask_reaches_the_pair_padded_with_empty_key_tiles():
    """The pair reads the block-mask ranges and states of two 128-key tiles: a backward's key
    tiles come padded to whole clusters, the padding empty, so those reads stay inside."""
    from flash_cute.variants.block_mask import EMPTY

    plain, (states, ranges) = _causal_block_mask_tiles(True, key_tiles_per_cta=2)
    assert plain[0].shape[3] == 3 and states.shape[3] == 4 and ranges.shape[2] == 4
    assert torch.equal(states[..., :3], plain[0]) and torch.equal(ranges[:, :, :3], plain[1])
    assert (states[..., 3] == EMPTY).all() and (ranges[:, :, 3] == 0).all()


@pytest.mark.slow
def test_the_family_target_cross_compiles_what_runs_on_10_3(tmp_path):
    """sm_100f: the blackwell forward and backward (and the ampere code dispatch runs by
    default on 10.x) cross-compile for the family target, on tcgen05 where they were (the
    registry's configs, compiled by its worker for a target they do not list)."""
    from pathlib import Path

    from test_inspect import known_spill

    from flash_cute.tools.registry import CONFIGS as ALL
    from flash_cute.tools.sass import opcode_counts
    from flash_cute.tools.xcompile import _run_worker

    picks = [next(i for i, c in enumerate(ALL) if c.kernel == kernel and c.hdim == 128)
             for kernel in ("blackwell.fwd", "blackwell.bwd", "ampere.fwd")]
    results = _run_worker("sm_100f", picks, tmp_path, 900, lambda r: None)
    assert len(results) == 3 and not any("error" in r for r in results), results
    for r in results:
        ops = opcode_counts(Path(r["artifacts"]["sass"]).read_text())
        assert (ops.get("UTCHMMA", 0) > 0) == r["kernel"].startswith("blackwell"), r["kernel"]
        # The spills pinned for sm_100a hold on the family target too.
        assert r["spill_bytes"] == (known_spill({**r, "target": "sm_100a"}) or 0), r["kernel"]
