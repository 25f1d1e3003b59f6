"""The blackwell backward's kernel, cross-compiled for sm_100a on the CPU: tcgen05 MMAs (the
pair's cta_group::2 forms from hdim 128), tensor memory allocated and freed once, its
declared pipeline against the SASS, and a static check of its synchronization per role
(`check_bwd_pipeline`). Nothing here has run on Blackwell hardware; its design is checked by
`tests/test_blackwell_bwd_model.py`."""

import re

import pytest

from flash_cute.arch.blackwell.config import folds
from flash_cute.arch.blackwell.inspect_configs import CONFIGS

BWD = [c for c in CONFIGS if c.kernel == "blackwell.bwd"]
_ROLES = ("dQ reduce", "compute", "mma, load, relay")


def _ops(sass: str) -> list:
    lines = [ln.split(";")[0].strip() for ln in sass.splitlines()]
    ops = [re.sub(r"^/\*[0-9a-f]+\*/\s*", "", ln) for ln in lines]
    return [op for op in ops if op and not op.startswith(("//", ".", "{", "}"))]


def check_bwd_pipeline(sass: str, pair: bool, tails: bool = False, folded: bool = False) -> dict:
    """Static checks of the backward's synchronization (none needs hardware); returns the
    opcodes of each role's section.

    * Tensor memory is allocated (with the pair UTCATOMSWS.2CTA.FIND_AND_SET, both CTAs as
      one) after the barriers are initialized and before the roles split (USETMAXREG), and a
      named barrier over all 512 threads publishes it.
    * No thread exits before the roles join (the pair: the cluster barrier UCGABAR; one CTA:
      BAR.SYNC 0); after the join the memory is freed (UTCATOMSWS.AND) exactly once, before
      the last EXIT.
    * Each role's waits have a signalling role: the reduce and compute warps wait for MMA
      results (a tcgen05.commit, UTCBAR, in the MMA warp's section) and arrive on barriers
      the MMA warp waits for; the MMA section waits for TMA bytes (UTMALDG there too) and
      for those arrivals. With the pair every section that writes into the peer CTA's shared
      memory (a bulk copy, UBLKCP.S.S) also signals the peer (a remote arrive that carries
      the expected bytes, SYNCS.ARRIVE.TRANS64.RED with no .A1T0 / .ART0), and the relay's
      remote arrival is in the last section; every MMA and TMA load is the pair's form.
    * `tails` (varlen, seqused): the last section also zeroes rows in shared memory (the tail
      warp's STS) and fences them to the async proxy before its arrivals.
    * The compute warps store Pᵀ and dSᵀ into TMEM (STTM), or `folded` (`config.folds`) into
      shared memory with no TMEM store, fenced to the async proxy.

    It does not prove that the phases agree: that rests on every role walking the same query
    tiles (`BlackwellBwd` docstring), the protocol model
    (`tests/test_blackwell_bwd_protocol.py`) and the TMEM replay of the model file."""
    ops = _ops(sass)

    def where(pattern):
        return [i for i, op in enumerate(ops) if re.search(pattern, op)]
    roles = where("USETMAXREG")
    assert len(roles) == 3, "three setmaxnreg roles: dQ reduce, compute, MMA / load / relay"
    join = where(r"^UCGABAR_WAIT" if pair else r"BAR\.SYNC\S* 0x0\b")
    assert join and join[-1] > roles[-1] and join[0] < roles[0]
    inits = where(r"SYNCS\.EXCH\.64")
    assert inits and max(inits) < join[0], "the barriers are set up before the first join"
    allocs = where(r"UTCATOMSWS\.2CTA\.FIND_AND_SET" if pair else r"UTCATOMSWS\.FIND_AND_SET")
    assert allocs and join[0] < min(allocs) and max(allocs) < roles[0]
    published = where(r"BAR\.SYNC\S* 0x1, 0x200")
    assert published and max(allocs) < published[0] < roles[0]
    exits = where(r"\bEXIT\b")
    assert exits and min(exits) > join[-1], "no thread leaves before the roles join"
    frees = where(r"UTCATOMSWS\.AND")
    assert len(frees) == 1 and join[-1] < frees[0] < exits[-1]
    bounds = roles + [join[-1]]
    sections = {name: ops[lo:hi] for name, lo, hi in zip(_ROLES, bounds, bounds[1:])}

    def has(section, pattern):
        return any(re.search(pattern, op) for op in sections[section])
    wait, arrive, commit = r"SYNCS\.PHASECHK", r"SYNCS\.ARRIVE", r"^UTCBAR"
    remote = r"SYNCS\.ARRIVE\.TRANS64\.RED"
    # A remote arrival that carries expected bytes (no .A1T0 / .ART0 form): the peer's arm.
    armed = r"SYNCS\.ARRIVE\.TRANS64\.RED\s"
    tma = r"^UTMALDG\.\S*2CTA" if pair else r"^UTMALDG"
    assert has("dQ reduce", wait) and has("dQ reduce", arrive)
    # fp32 atomics (ATOMG where the deterministic fence keeps their completion in order).
    assert has("dQ reduce", "^LDTM") and has("dQ reduce", r"^(REDG|ATOMG)\.E\.ADD\.F32")
    assert has("compute", wait) and has("compute", arrive)
    assert has("compute", "^LDTM") and has("compute", "^STS")
    assert has("compute", "^STTM") != folded, "Pᵀ and dSᵀ into TMEM, or folded not"
    if folded:
        assert has("compute", r"^FENCE\.VIEW\.ASYNC\.S"), "Pᵀ, dSᵀ fenced to the MMAs"
    last = _ROLES[2]
    assert has(last, wait) and has(last, commit) and has(last, tma)
    assert has(last, r"^UTCHMMA\.2CTA" if pair else r"^UTCHMMA")
    for name in _ROLES[:2]:
        assert not has(name, r"^UTCHMMA") and not has(name, r"^UTMALDG"), name
    if tails:
        assert has(last, r"\bSTS") and has(last, r"^FENCE\.VIEW\.ASYNC\.S"), \
            "the tail warp's zeros, fenced to the tensor cores"
    if pair:
        assert not any(re.match(r"^UTCHMMA(?!\.2CTA)", op) for op in ops), "one-CTA MMA"
        assert all(re.search("2CTA", op) for op in ops if op.startswith("UTMALDG"))
        for name in _ROLES:
            if has(name, r"^UBLKCP\.S\.S"):
                assert has(name, armed), f"{name} writes the peer's shared memory unsignalled"
        assert has("compute", r"^UBLKCP\.S\.S"), "the peer's dS goes by bulk copy"
        assert has(last, remote), "the relay's arrival on the leader"
        assert has("dQ reduce", remote) and has("compute", remote), "arrivals on the leader"
    else:
        assert not has("compute", r"^UBLKCP")
    return {name: len(sec) for name, sec in sections.items()}


def _check(entry, art):
    from test_inspect import known_spill  # the pinned spills, one list for every kernel

    from flash_cute.tools.pipelines import check as check_declared
    from flash_cute.tools.sass import opcode_counts

    ops = opcode_counts(art.sass)
    pair = entry.schedule.cta_group == 2
    assert ops.get("UTCHMMA", 0) > 0 and ops.get("HGMMA", 0) == 0 and ops.get("HMMA", 0) == 0
    assert ops.get("UTCATOMSWS.AND", 0) == 1
    if pair:
        assert entry.config_dict()["cta_group"] == 2
        assert entry.config_dict()["cluster"] == (2, 1, 1)
        assert ops.get("UTCHMMA.2CTA", 0) == ops["UTCHMMA"] > 0
        assert ops.get("UTCATOMSWS.2CTA.FIND_AND_SET", 0) > 0
    else:
        assert ops.get("UTCHMMA.2CTA", 0) == 0 and ops.get("UTCATOMSWS.FIND_AND_SET", 0) > 0
    spill = known_spill({"kernel": entry.kernel, "target": "sm_100a",
                         "config": entry.config_dict()})
    summary = art.summary()
    assert summary["spill_bytes"] == (spill or 0), (entry.label, summary["spill_bytes"])
    kernel = entry.builder(entry).fn
    assert check_declared(kernel.pipeline(), art.sass, summary["registers"]) == []
    flags = entry.flag_dict
    check_bwd_pipeline(art.sass, pair, any(flags.get(f) for f in ("varlen", "seqused_q",
                                                                    "seqused_k")),
                       folds(entry.schedule))


@pytest.mark.slow
@pytest.mark.parametrize("hdim", [64, 128])
def test_the_causal_backward_cross_compiles_with_its_pipeline_intact(hdim, tmp_path):
    """One CTA at hdim 64, the pair at 128 (every config: the sweep below)."""
    from flash_cute.tools.xcompile import compile_for_target

    entry = next(c for c in BWD if c.hdim == hdim and c.flag_dict.get("causal")
                 and not any(c.flag_dict.get(k) for k in ("varlen", "deterministic",
                                                          "dkv_fp32", "mods")))
    _check(entry, compile_for_target(entry, "sm_100a", out_dir=tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("entry", BWD, ids=lambda e: e.label)
def test_every_backward_config_has_its_pipeline_intact(entry, tmp_path):
    from flash_cute.tools.xcompile import compile_for_target

    _check(entry, compile_for_target(entry, "sm_100a", out_dir=tmp_path))


def test_the_configs_cover_every_head_dim_and_feature():
    dims = {(c.hdim, c.hdim_v) for c in BWD}
    assert dims == {(64, 64), (128, 128), (192, 128), (256, 256)}
    flags = set().union(*({k for k, v in c.flag_dict.items() if v} for c in BWD))
    assert flags >= {"causal", "local", "softcap", "varlen", "seqused_q", "seqused_k",
                     "deterministic", "dkv_fp32", "mods"}
    assert {c.flag_dict.get("mods") for c in BWD} >= {"alibi", "document", "fa4_softcap_causal",
                                                      "document+blocks"}


_FOLD_PROBE = """
import json
import cutlass.cute as cute
from cutlass import BFloat16
from flash_cute.arch.blackwell.bwd import BlackwellBwd
out = {}

@cute.jit
def probe():
    kernel = BlackwellBwd(BFloat16, 256, 256)
    mmas, t = kernel._tiled_mmas(), kernel._tilers()
    for name in ("s", "dv"):
        thr = mmas[name].get_slice(0)
        layout = cute.get(thr.make_fragment_C(thr.partition_shape_C(t[name][:2])).layout,
                          mode=[0])
        out[name] = [[int(cute.crd2idx((r, c), layout)) for c in range(t[name][1])]
                     for r in range(t[name][0] // 2)]
probe()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_folded_thread_map_is_the_mmas_tmem_layout(tmp_path):
    """hdim 256's pair MMAs at M = 128: the DSL's accumulator layouts (this CTA's 64 keys x N,
    as TMEM addresses lane << 16 | column) put Sᵀ's (key, query) where the compute threads
    read it (`compute_thread`, `compute_query`) and dV's (key, head-dim column) where the
    epilogue reads it: lane = key + 64 x (column // (N / 2)), column % (N / 2)."""
    import json
    import os
    import subprocess
    import sys

    from flash_cute.arch.blackwell import config

    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a"}
    script = tmp_path / "fold_probe.py"  # the DSL traces functions from their source file
    script.write_text(_FOLD_PROBE)
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    schedule = config.BWD_SCHEDULES[(256, 256)]
    assert config.folds(schedule)
    reads = {}
    for wg in (0, 1):
        for lane in range(128):
            key, part = config.compute_thread(lane, schedule)
            for c in range(config.wg_query_columns(schedule) // 8):
                first = config.compute_query(wg, part, c, schedule, 8)
                for j in range(8):
                    column = first + j - part * (schedule.tile_m // 2)
                    reads[(key, first + j)] = (lane << 16) | column
    assert len(reads) == 64 * 128
    assert all(got["s"][k][q] == addr for (k, q), addr in reads.items())
    half = 256 // 2
    assert all(got["dv"][k][d] == ((k + 64 * (d // half)) << 16 | d % half)
               for k in range(64) for d in range(256))


def test_check_bwd_pipeline_catches_an_early_exit_a_missing_free_and_an_unsignalled_copy():
    """The pair at hdim 128 passes the static check, which fails on the faults it is for
    (SASS edited by hand). The default run's one cross-compile of the backward."""
    from flash_cute.tools.xcompile import compile_for_target

    entry = next(c for c in BWD if c.hdim == 128 and not any(c.flag_dict.values()))
    sass = compile_for_target(entry, "sm_100a").sass
    check_bwd_pipeline(sass, True)
    with pytest.raises(AssertionError, match="tail warp's zeros"):
        check_bwd_pipeline(sass, True, tails=True)   # compiled without varlen or seqused
    lines = sass.splitlines()
    first_role = next(i for i, ln in enumerate(lines) if "USETMAXREG" in ln)
    early = "\n".join(lines[:first_role + 1] + ["        /*0000*/   EXIT ;"]
                      + lines[first_role + 1:])
    with pytest.raises(AssertionError, match="leaves before"):
        check_bwd_pipeline(early, True)
    with pytest.raises(AssertionError):
        check_bwd_pipeline("\n".join(ln for ln in lines if "UTCATOMSWS.AND" not in ln), True)
    roles = [i for i, ln in enumerate(lines) if "USETMAXREG" in ln]
    arm = re.compile(r"SYNCS\.ARRIVE\.TRANS64\.RED\s")
    unsignalled = "\n".join(ln for i, ln in enumerate(lines)
                            if not (roles[1] < i < roles[2] and arm.search(ln)))
    assert unsignalled != sass
    with pytest.raises(AssertionError, match="unsignalled"):
        check_bwd_pipeline(unsignalled, True)
