"""Cross-compiling kernels on the CPU and reading the results: the representative ones and the
CLI in the default run; every registered config, for each of its targets, in the `slow` sweep."""

import json
import re
import struct
import subprocess
import sys

import pytest

# pyelftools is a dependency of the project (pyproject); the GPU host's bundle lacks it, and
# there this file, which has no GPU test, would otherwise stop `pytest -m gpu` at collection.
pytest.importorskip("elftools", reason="pyelftools (a project dependency) is not installed")

from flash_cute.tools.registry import CONFIGS, TARGETS, registered_configs  # noqa: E402
from flash_cute.tools.sass import _sval_attrs, loop_bodies, opcode_counts  # noqa: E402


@pytest.fixture(scope="module")
def inspected():
    """`inspect --all --json` over all registered kernels and targets, run as users run it."""
    proc = subprocess.run([sys.executable, "-m", "flash_cute", "inspect", "--all", "--json"],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_every_config_compiles_for_each_of_its_archs(inspected):
    want = sorted((c.kernel, json.dumps(c.config_dict(), sort_keys=True), a)
                  for c in CONFIGS for a in c.targets)
    got = sorted((e["kernel"], json.dumps(e["config"], sort_keys=True), e["target"]) for e in inspected)
    assert got == want
    assert all("error" not in e for e in inspected)


@pytest.mark.slow
def test_each_arch_has_a_kernel_with_sass(inspected):
    for target in TARGETS:
        entries = [e for e in inspected if e["target"] == target]
        assert entries, f"no kernel for {target}"
        assert all(sum(e["sass"].values()) > 0 for e in entries)


@pytest.mark.slow
def test_json_schema(inspected):
    for e in inspected:
        assert set(e) >= {"kernel", "target", "config", "registers", "smem_bytes", "spill_bytes", "sass"}
        assert set(e["config"]) >= {"dtype", "hdim", "hdim_v", "schedule"}
        assert "." in e["kernel"]
        assert 0 < e["registers"] <= 255


def _does_softmax(kernel: str) -> bool:
    """Kernels that exponentiate scores or LSEs (the bwd pre/postprocess kernels do not)."""
    return kernel in ("blocks.softmax_rows", "blocks.lse_merge") or kernel.endswith((".fwd", ".bwd"))


# Spills known and accepted, exactly: the sm80 forward compiled for sm_100a (what runs on
# Blackwell until its own pipeline exists) spills at hdim 128.
KNOWN_SPILLS = {("ampere.fwd", "sm_100a", 128): 32}
# The hdim-128 backward of a mod whose derivative is not 1 (softcap, also in FA4's form, and
# the ampere backward there), whose derivative takes a fragment of its own (D-MODS-KERNEL);
# the ampere hdim-128 backward that also sums learnable ALiBi slopes' gradient (D-MOD-GRADS).
KNOWN_MOD_SPILLS = {("hopper.bwd", "sm_90a", "softcap", 128): 48,
                    ("hopper.bwd", "sm_90a", "fa4_softcap_causal", 128): 32,
                    ("ampere.bwd", "sm_80", "fa4_softcap_causal", 128): 72,
                    ("ampere.bwd", "sm_80", "alibi+grads", 128): 88}


# The backward compiled to record its timeline (a measurement build, `Variant.timeline`): its
# consumers, at 240 registers, spill the recorder's state (D-TIMELINE); causal, then not.
KNOWN_TIMELINE_SPILLS = {("hopper.bwd", True): 16, ("hopper.bwd", False): 24}


# Dropout at a ring step's coordinates (D-CP-DROPOUT): the hopper hdim-128 causal forward
# spills 8 B with a plain seed too; a shift's two starts in registers cost the ampere backward
# 8 B; any frame's element-at-a-time draws cost the hopper backward's consumers a few.
KNOWN_FRAME_SPILLS = {("hopper.fwd", 128, "shift"): 8, ("hopper.fwd", 128, "frame"): 8,
                      ("ampere.bwd", 128, "shift"): 8,
                      ("hopper.bwd", 128, "frame"): 32, ("hopper.bwd", 64, "frame"): 64}


def known_spill(e: dict):
    """The accepted spill bytes of an inspected entry (None: none accepted)."""
    frame = e["config"].get("dropout")
    if frame in ("shift", "frame"):
        return KNOWN_FRAME_SPILLS.get((e["kernel"], e["config"]["hdim"], frame), 0)
    if e["config"].get("timeline"):
        return KNOWN_TIMELINE_SPILLS.get((e["kernel"], e["config"]["causal"]), 0)
    mods = e["config"].get("mods")
    if mods is not None:
        return KNOWN_MOD_SPILLS.get((e["kernel"], e["target"], mods, e["config"]["hdim"]))
    return KNOWN_SPILLS.get((e["kernel"], e["target"], e["config"]["hdim"]))


@pytest.mark.slow
def test_blocks_use_exp2_and_do_not_spill(inspected):
    """No local memory anywhere up to hdim 128 but the known spills; beyond that a spill is
    reported, not hidden."""
    for e in inspected:
        hdim = e["config"]["hdim"] or 0
        known = known_spill(e)
        if known is not None:
            assert e["spill_bytes"] == known, e
        elif hdim <= 128:
            assert e["spill_bytes"] == 0, e
            assert e["sass"].get("LDL", 0) == 0 and e["sass"].get("STL", 0) == 0
        if _does_softmax(e["kernel"]):
            assert e["sass"].get("MUFU.EX2", 0) > 0, f"{e['kernel']} on {e['target']} has no MUFU.EX2"


@pytest.mark.slow
def test_softmax_rows_reduces_over_quads(inspected):
    """The online softmax reduces max and sum across the 4 threads of a row with shuffles."""
    for e in inspected:
        if e["kernel"] == "blocks.softmax_rows":
            assert e["sass"].get("SHFL", 0) >= 4


def test_inspect_filters_and_table():
    proc = subprocess.run([sys.executable, "-m", "flash_cute", "inspect", "--target", "sm_90a",
                           "--kernel", "blocks.lse_merge"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split()[:4] == ["target", "regs", "smem", "spill"]
    configs = registered_configs("blocks.lse_merge", "sm_90a")
    # A title line per config, then its row per target.
    assert len(lines) == 1 + 2 * len(configs)
    assert lines[1].startswith("blocks.lse_merge  bf16 d128/128")
    assert lines[2].split()[0] == "sm_90a"
    assert max(len(line) for line in lines) <= 100


@pytest.fixture(scope="module")
def representative(tmp_path_factory):
    """The main job on a machine without a GPU, as users run it (`python -m flash_cute`), in a
    folder of its own: its text, its PNG and its JSON (`inspect --json`)."""
    import os

    folder = tmp_path_factory.mktemp("main_job")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    text = subprocess.run([sys.executable, "-m", "flash_cute"], capture_output=True,
                          text=True, timeout=600, cwd=folder, env=env)
    assert text.returncode == 0, text.stderr[-3000:]
    js = subprocess.run([sys.executable, "-m", "flash_cute", "inspect", "--json"],
                        capture_output=True, text=True, timeout=600, env=env)
    assert js.returncode == 0, js.stderr[-3000:]
    return text.stdout, folder / "flash-cute-inspect.png", json.loads(js.stdout)


def test_main_job_tells_the_story_per_target(representative):
    """Each target's own pipeline, forward and (where it exists) backward, compared in at most
    100 columns: mma.sync and cp.async on sm_80, WGMMA and TMA on sm_90a, tcgen05 and tensor
    memory on sm_100a (the blackwell forward, not the ampere kernel compiled for it); the
    declared roles and residency; a PNG; the way to the full registry."""
    text, png, entries = representative
    by = {(e["kernel"], e["target"]): e for e in entries}
    assert {("ampere.fwd", "sm_80"), ("ampere.bwd", "sm_80"), ("hopper.fwd", "sm_90a"),
            ("hopper.bwd", "sm_90a"), ("blackwell.fwd", "sm_100a")} <= set(by)
    for kernel in ("ampere.fwd", "ampere.bwd"):
        ops = by[(kernel, "sm_80")]["sass"]
        assert ops.get("HMMA", 0) > 0 and ops.get("LDGSTS", 0) > 0 and ops.get("HGMMA", 0) == 0
    for kernel in ("hopper.fwd", "hopper.bwd"):
        ops = by[(kernel, "sm_90a")]["sass"]
        assert ops.get("HGMMA", 0) > 0 and ops.get("UTMALDG", 0) > 0
    blackwell = by[("blackwell.fwd", "sm_100a")]["sass"]
    assert blackwell.get("UTCHMMA", 0) > 0 and blackwell.get("LDTM", 0) > 0
    assert by[("hopper.fwd", "sm_90a")]["registers_per_role"] == {"producer": 24,
                                                                   "consumer": 240}
    assert all(e["sass"].get("MUFU.EX2", 0) > 0 for e in entries)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    pipelines = next(line for line in lines if line.startswith("pipeline"))
    assert "blackwell.fwd (sm_100a)" in pipelines and "ampere.fwd (sm_100a)" not in text
    assert any(line.startswith("MMA") and "HGMMA" in line and "HMMA" in line
               and "UTCHMMA" in line for line in lines)
    residency = next(line for line in lines if line.startswith("residency"))
    assert "S:T P:T O:T" in residency and "S:R P:R" in residency
    assert any("backward" in line for line in lines)
    assert "inspect --all" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_pipelines(configs):
    from pathlib import Path

    from flash_cute.contract.pipeline import from_dict
    from flash_cute.tools.pipelines import check, sass_facts
    from flash_cute.tools.xcompile import cross_compile

    checked = 0
    for e in cross_compile(configs):
        if e["kernel"].endswith((".fwd", ".bwd")) and "." not in e["kernel"].split(".", 1)[1]:
            assert "pipeline" in e, (e["kernel"], e["target"])
            sass = Path(e["artifacts"]["sass"]).read_text()
            problems = check(from_dict(e["pipeline"]), sass, e["registers"])
            assert not problems, (e["kernel"], e["target"], e["config"], problems)
            # A kernel reads the global timer exactly when compiled to record its timeline.
            assert sass_facts(sass)["global_timer"] == bool(e["config"].get("timeline")), \
                (e["kernel"], e["config"])
            checked += 1
    return checked


def test_the_kernel_docstrings_show_their_declared_budgets():
    """Each kernel class's role table (its docstring) shows the setmaxnreg budgets its
    declared pipeline has, for the representative configs: the docstring and the data agree."""
    from flash_cute.arch.blackwell.bwd import BlackwellBwd
    from flash_cute.arch.blackwell.fwd import BlackwellFwd
    from flash_cute.arch.hopper.bwd import HopperBwd
    from flash_cute.arch.hopper.fwd import HopperFwd
    from flash_cute.tools.inspection import representative_configs

    classes = {"hopper.fwd": HopperFwd, "hopper.bwd": HopperBwd, "blackwell.fwd": BlackwellFwd,
               "blackwell.bwd": BlackwellBwd}
    for entry in representative_configs(TARGETS):
        if entry.kernel not in classes:
            continue
        kernel = entry.builder(entry).fn
        table = classes[entry.kernel].__doc__.split("\n\n")[1]
        for role in kernel.pipeline().roles:
            assert f" {role.registers}" in table, (entry.kernel, role)


def test_the_declared_pipelines_agree_with_the_sass_of_the_representative_kernels():
    """setmaxnreg budgets, their count against the warpgroups, no setmaxnreg where all warps
    are one role, TMEM allocated where TMEM buffers are declared
    (`flash_cute.tools.pipelines.check`)."""
    from flash_cute.tools.inspection import representative_configs

    assert _check_pipelines(representative_configs(TARGETS)) >= 5


@pytest.mark.slow
def test_the_declared_pipelines_agree_with_the_sass_of_every_registered_config():
    configs = [c for c in CONFIGS if c.kernel in ("ampere.fwd", "ampere.bwd", "hopper.fwd",
                                                  "hopper.bwd", "blackwell.fwd",
                                                  "blackwell.bwd")]
    assert _check_pipelines(configs) >= len(configs)


@pytest.mark.slow
def test_no_kernel_reads_the_global_timer_unless_compiled_to_record_its_timeline():
    """Every registered config of every kernel (blocks, merges, pre/postprocess included) for
    each of its targets: SR_GLOBALTIMER in its SASS exactly when its timeline switch is on."""
    from pathlib import Path

    from flash_cute.tools.pipelines import sass_facts
    from flash_cute.tools.xcompile import cross_compile

    found = cross_compile(CONFIGS)
    assert len(found) == sum(len(c.targets) for c in CONFIGS)
    for e in found:
        sass = Path(e["artifacts"]["sass"]).read_text()
        assert sass_facts(sass)["global_timer"] == bool(e["config"].get("timeline")), \
            (e["kernel"], e["target"], e["config"])


def test_the_pipeline_check_catches_a_wrong_declaration():
    """Planted disagreements: a wrong budget, a missing USETMAXREG, TMEM declared but not
    allocated, two roles without setmaxnreg."""
    from dataclasses import replace

    from flash_cute.contract.pipeline import Buffer, Pipeline, Role
    from flash_cute.tools.pipelines import check

    sass = ("/*0520*/ USETMAXREG.DEALLOC.CTAPOOL 0x18 ;\n"
            "/*24e0*/ USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;\n")
    roles = (Role("producer", (0, 1, 2, 3), "loads", 24, 0),
             Role("consumer", (4, 5, 6, 7), "math", 240, 1))
    good = Pipeline("k", "sm_90a", roles, (Buffer("S", "RMEM", 1, "consumer", "consumer", "-"),))
    assert check(good, sass) == [] and check(good, sass, registers=132) == []
    # Budgets past the CTA's pool: the consumers' TRY_ALLOC would wait forever.
    assert check(good, sass, registers=128)
    assert check(replace(good, roles=(roles[0], replace(roles[1], registers=232))), sass)
    assert check(good, sass.splitlines()[0])
    assert check(replace(good, buffers=(Buffer("S", "TMEM", 1, "consumer", "consumer", "-"),)),
                 sass)
    plain = replace(good, roles=tuple(replace(r, registers=None, warpgroup=None)
                                      for r in roles))
    assert check(plain, "") and not check(replace(plain, roles=(
        Role("consumer", tuple(range(8)), "everything"),)), "")
    with pytest.raises(ValueError, match="two budgets"):
        Pipeline("k", "sm_90a", (roles[0], replace(roles[1], warpgroup=0)), ())


def test_a_second_cross_compile_is_served_from_the_disk_cache(tmp_path, monkeypatch):
    """The first run compiles and stores, the second finds every result (no worker runs), and
    no scratch folder is left behind."""
    import glob
    import tempfile

    from flash_cute.tools import xcompile

    monkeypatch.setenv("FLASH_CUTE_CACHE_DIR", str(tmp_path / "cache"))
    entry = registered_configs("blocks.lse_merge")[0]
    before = set(glob.glob(f"{tempfile.gettempdir()}/flash_cute_xcompile_*"))
    first = xcompile.cross_compile([entry], ["sm_80"])
    monkeypatch.setattr(xcompile, "_run_worker", lambda *a: pytest.fail("compiled again"))
    second = xcompile.cross_compile([entry], ["sm_80"])
    assert not first[0].get("cached") and second[0]["cached"]
    assert {k: first[0][k] for k in ("registers", "sass")} == \
        {k: second[0][k] for k in ("registers", "sass")}
    assert set(glob.glob(f"{tempfile.gettempdir()}/flash_cute_xcompile_*")) == before


def test_inspect_lists_kernels_and_names_them_on_a_miss():
    listed = subprocess.run([sys.executable, "-m", "flash_cute", "inspect", "--list"],
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "hopper.bwd" in listed.stdout
    miss = subprocess.run([sys.executable, "-m", "flash_cute", "inspect", "--kernel", "hoper"],
                          capture_output=True, text=True, timeout=120)
    assert miss.returncode == 2 and "kernels: ampere.bwd" in miss.stderr
    assert "hopper.fwd" in miss.stderr


def test_inspect_says_when_nvdisasm_is_missing(monkeypatch, capsys):
    import argparse

    from flash_cute.tools import inspection

    parser = argparse.ArgumentParser()
    inspection.add_arguments(parser)
    monkeypatch.setattr(inspection, "nvdisasm_found", lambda: False)
    assert inspection.run(parser.parse_args([])) == 2
    assert "nvidia-cuda-nvdisasm" in capsys.readouterr().err


def test_config_labels_tell_every_registered_config_apart():
    """Within a kernel and target, no two configs print the same label (the packing, the dO
    stages and the schedule switches show)."""
    from flash_cute.tools.inspection import config_label

    for target in TARGETS:
        labels = [(c.kernel, config_label(c.config_dict()))
                  for c in registered_configs(target=target)]
        assert len(labels) == len(set(labels)), target


def test_inspect_rejects_unknown_target():
    proc = subprocess.run([sys.executable, "-m", "flash_cute", "inspect", "--target", "sm_75"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown target" in proc.stderr


def test_compile_for_target_returns_ptx_cubin_sass(tmp_path):
    from flash_cute.tools.xcompile import compile_for_target

    entry = registered_configs("blocks.lse_merge")[0]
    art = compile_for_target(entry, "sm_80", out_dir=tmp_path)
    assert ".target sm_80" in art.ptx
    assert art.cubin[:4] == b"\x7fELF"
    assert "EF_CUDA_SM80" in art.sass


def test_opcode_counts_bare_and_full_forms():
    sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 MUFU.EX2 R9, R2 ;
        /*0020*/                   MUFU.RCP R3, R4 ;
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
        /*0040*/               @P1 UTCHMMA.2CTA gdesc[UR4], gdesc[UR6], tmem[UR8], idesc[UR9], UPT ;
        /*0050*/                   UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], idesc[UR9], UPT ;
        /*0060*/                   STL.64 [R1], R2 ;
    """
    counts = opcode_counts(sass)
    assert counts["MUFU"] == 2 and counts["MUFU.EX2"] == 1
    assert counts["HGMMA"] == 1 and counts["LDC"] == 1 and counts["STL"] == 1
    assert counts["UTCHMMA"] == 2 and counts["UTCHMMA.2CTA"] == 1


def test_nv_info_frame_size_record_is_read():
    """EIATTR_FRAME_SIZE (0x11) and REGCOUNT (0x2f) records, as ptxas writes them."""
    records = struct.pack("<BBHII", 0x04, 0x11, 8, 6, 48) + struct.pack("<BBH", 0x03, 0x1B, 0xFF)
    records += struct.pack("<BBHII", 0x04, 0x2F, 8, 6, 168)
    attrs = _sval_attrs(records, 0, len(records))
    assert attrs[(0x11, 6)] == 48 and attrs[(0x2F, 6)] == 168


def test_compile_key_has_no_batch_or_seqlen():
    from flash_cute.runtime.jit import CompileKey

    fields = set(CompileKey.__dataclass_fields__)
    assert not fields & {"batch", "seqlen", "seqlen_q", "seqlen_k", "total_q", "max_seqlen_q"}
    assert fields >= {"kernel", "target", "dtype", "hdim", "hdim_v", "schedule", "flags", "variant"}


def test_compile_cache_builds_once_per_key():
    from flash_cute.runtime.jit import CompileCache, CompileKey

    cache, built = CompileCache(), []
    key = CompileKey("blocks.lse_merge", "sm_90a", "bf16", 128, 128, (4, 128))
    for _ in range(3):
        cache.get(key, lambda: built.append(1) or "compiled")
    cache.get(CompileKey("blocks.lse_merge", "sm_80", "bf16", 128, 128, (4, 128)), lambda: "other")
    assert built == [1] and len(cache) == 2


@pytest.mark.slow
def test_ampere_fwd_is_an_sm80_mma_sync_pipeline(inspected):
    entries = [e for e in inspected if e["kernel"] == "ampere.fwd"]
    # sm100 runs the ampere pipeline until the blackwell one exists: one config shows it.
    assert {e["target"] for e in entries} == {"sm_80", "sm_100a"}
    hdims = {(e["config"]["hdim"], e["config"]["hdim_v"]) for e in entries}
    assert hdims >= {(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)}
    for e in entries:
        ops = e["sass"]
        assert ops.get("HMMA", 0) > 0, "QKᵀ and PV must run on mma.sync"
        assert ops.get("LDGSTS", 0) > 0, "K/V must be staged with cp.async"
        assert ops.get("LDSM", 0) > 0, "operands must come from shared memory through ldmatrix"
        assert ops.get("HGMMA", 0) == 0 and ops.get("UTMALDG", 0) == 0
        assert e["smem_bytes"] > 0
        known = known_spill(e)
        if e["config"]["hdim"] <= 128:
            assert e["spill_bytes"] == (known or 0)


@pytest.mark.slow
def test_ampere_bwd_uses_mma_sync_and_fp32_atomics(inspected):
    entries = [e for e in inspected if e["kernel"] == "ampere.bwd"]
    assert {e["target"] for e in entries} == {"sm_80"} and len(entries) >= 6
    for e in entries:
        ops = e["sass"]
        assert ops.get("HMMA", 0) > 0 and ops.get("LDSM", 0) > 0 and ops.get("LDGSTS", 0) > 0
        assert ops.get("RED", 0) + ops.get("ATOMG", 0) > 0, "dQ is accumulated with atomics"


@pytest.mark.slow
def test_hopper_fwd_is_a_warp_specialized_tma_wgmma_pipeline(inspected):
    entries = [e for e in inspected if e["kernel"] == "hopper.fwd"]
    assert {e["target"] for e in entries} == {"sm_90a"}
    hdims = {(e["config"]["hdim"], e["config"]["hdim_v"]) for e in entries}
    assert hdims >= {(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)}
    for e in entries:
        ops = e["sass"]
        assert ops.get("HGMMA", 0) > 0, "QKᵀ and PV must run on WGMMA"
        assert ops.get("UTMALDG", 0) > 0, "Q, K and V must be loaded with TMA"
        assert ops.get("USETMAXREG", 0) >= 2, "producer and consumers re-balance registers"
        assert ops.get("HMMA", 0) == 0 and ops.get("LDGSTS", 0) == 0
        assert ops.get("MUFU.EX2", 0) > 0
        assert e["spill_bytes"] == (known_spill(e) or 0), e
        # Every register the CTA gets at launch goes to a role: 128 producer threads, 64 rows
        # per consumer warpgroup.
        roles, consumers = e["registers_per_role"], e["config"]["schedule"][0] // 64
        assert roles["producer"] + consumers * roles["consumer"] \
            == (1 + consumers) * e["registers"], e
        assert 0 < e["smem_bytes"] <= 227 * 1024
        # When ptxas cannot keep WGMMAs in flight (C7512, e.g. too few registers) it waits
        # after every one of them: as many DEPBARs as HGMMAs. The kernel waits per GEMM.
        assert 2 * ops.get("WARPGROUP.DEPBAR", 0) <= ops["HGMMA"], (e["config"], ops)


@pytest.mark.slow
def test_hopper_split_kv_forwards_merge_their_splits_in_the_kernel(inspected):
    """A split-KV hopper forward counts each tile's finished splits with one atomic (the
    thread that counts for the CTA) between GPU-scope fences, and the merger loads the
    partials back; a forward without splits has neither."""
    entries = [e for e in inspected if e["kernel"] == "hopper.fwd"]
    split = [e for e in entries if e["config"].get("split_kv")]
    assert len(split) >= 5
    for e in entries:
        ops = e["sass"]
        if e["config"].get("split_kv"):
            assert ops.get("ATOMG", 0) == 1 and ops.get("MEMBAR", 0) >= 3, (e["config"], ops)
            assert ops.get("CCTL", 0) >= 1, "the acquire must invalidate L1 before the loads"
        else:
            assert ops.get("ATOMG", 0) == 0, e["config"]


@pytest.mark.slow
def test_learnable_tensors_gradients_take_atomics_by_how_their_index_varies(inspected):
    """The hopper backward's gradients of learnable captured tensors (its dQ leaves by a bulk
    reduce, so every fp32 atomic is theirs): ALiBi's slopes[h], an index uniform over the
    tile, one (the warp's sum, from its first lane); a relative-bias table[h, q_idx - kv_idx],
    one per element of a thread's tile_m x tile_n / 256; a bias per query and one per key, one
    per row and column of it (D-MOD-GRADS)."""
    entries = {e["config"]["mods"]: e for e in inspected if e["kernel"] == "hopper.bwd"
               and str(e["config"].get("mods", "")).endswith("+grads")}
    assert set(entries) == {"alibi+grads", "relative_bias+grads", "row_col_bias+grads"}
    for name, e in entries.items():
        tile_m, tile_n = e["config"]["schedule"][:2]
        per_element = tile_m * tile_n // 256
        atomics = e["sass"].get("REDG", 0) + e["sass"].get("ATOMG", 0)
        if name == "row_col_bias+grads":
            # One per row and one per column of a thread's fragment: far fewer than elements.
            assert 2 < atomics < per_element, (name, atomics)
        else:
            assert atomics == (1 if name == "alibi+grads" else per_element), name
        assert e["spill_bytes"] == 0, name


@pytest.mark.slow
def test_hopper_bwd_is_a_warp_specialized_tma_wgmma_kernel_with_a_bulk_dq_reduce(inspected):
    """16-bit dK and dV leave as 128-bit row stores. dQ leaves through one bulk reduce-add
    of a shared-memory tile (two, one per consumer warpgroup's half, with dq_per_wg), written
    by 128-bit stores in fragment order (`dq_accum`), wherever that tile fits (`bwd_smem_plan`;
    every default schedule), else through fp32 atomics (registered: hdim 256 with two Q/dO
    stages, plain and deterministic); a deterministic kernel adds one int32 semaphore
    increment."""
    from flash_cute.arch.hopper.config import BwdSchedule, bwd_smem_plan

    entries = [e for e in inspected if e["kernel"] == "hopper.bwd"]
    assert {e["target"] for e in entries} == {"sm_90a"}
    hdims = {(e["config"]["hdim"], e["config"]["hdim_v"]) for e in entries}
    assert hdims >= {(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)}
    assert any(e["config"]["deterministic"] for e in entries)
    atomic_configs = 0
    for e in entries:
        ops, config = e["sass"], e["config"]
        if config.get("timeline"):
            continue   # a measurement build: its records add global stores (checked apart)
        assert ops.get("HGMMA", 0) > 0, "S, dP, dV, dK and dQ must run on WGMMA"
        assert ops.get("UTMALDG", 0) > 0, "Q, dO, K and V must be loaded with TMA"
        assert ops.get("USETMAXREG", 0) >= 2, "producer and consumers re-balance registers"
        assert ops.get("STSM", 0) > 0, "P and dS go to shared memory by stmatrix"
        semaphore = 1 if config["deterministic"] else 0
        # dK and dV elements per consumer thread; 16-bit ones leave as 128-bit rows.
        dkv_elems = config["schedule"][1] * (config["hdim"] + config["hdim_v"]) // 256
        tile = BwdSchedule(*config["schedule"], **{f: config[f] for f in BwdSchedule._fields[3:] if f in config})
        # Through the freed rings where Q's holds tile_n rows (`HopperBwd.store_dkv`).
        rings_fit = tile.q_stages * tile.tile_m >= tile.tile_n
        if not config["dkv_fp32"] and rings_fit:
            assert ops.get("STG", 0) == dkv_elems // 8, "dK/dV: whole 128-bit row stores"
        atomics = ops.get("REDG", 0) + ops.get("ATOMG", 0) - semaphore
        if bwd_smem_plan(config["hdim"], config["hdim_v"], tile).dq_tma:
            # dq_per_wg: one bulk reduce per consumer warpgroup's half of the tile.
            assert ops.get("UBLKRED", 0) == (2 if tile.dq_per_wg else 1), \
                "dQ is added by one bulk reduce per tile (or per half)"
            # Varlen and seqused_k also zero tile tails; without the rings dK/dV skip smem.
            if not (config["varlen"] or config.get("seqused_k")) and rings_fit:
                per_thread = config["schedule"][0] * config["hdim"] // 256
                # 16-bit dK/dV go to shared memory too, one 32-bit store per column pair;
                # transposed (swap_dkv) a thread's pairs run down a column: one 16-bit store
                # per element.
                dkv = 0 if config["dkv_fp32"] else dkv_elems // (1 if config.get("swap_dkv") else 2)
                assert ops.get("STS", 0) == per_thread // 4 + dkv, "dQ: one 128-bit store per 4"
            if str(config.get("mods", "")).endswith("+grads"):
                continue   # the learnable tensors' gradients are fp32 atomics (below)
            assert atomics == 0, "no fp32 atomics where the bulk reduce adds dQ"
        else:
            assert ops.get("UBLKRED", 0) == 0 and atomics > 0, "dQ is added by fp32 atomics"
            atomic_configs += 1
        assert ops.get("HMMA", 0) == 0 and ops.get("LDGSTS", 0) == 0
        assert ops.get("MUFU.EX2", 0) > 0
        assert e["spill_bytes"] == (known_spill(e) or 0), e
        assert e["registers_per_role"] == {"producer": 24, "consumer": 240}
        assert 0 < e["smem_bytes"] <= 227 * 1024
        # When ptxas cannot keep WGMMAs in flight (C7512, e.g. too few registers) it waits
        # after every one of them: as many DEPBARs as HGMMAs. The kernel waits per GEMM.
        if (config["hdim"], config.get("dropout", False)) in KNOWN_SERIALIZED_BWD:
            # Known: the Philox rounds leave ptxas too few registers (docs/perf.md).
            assert ops.get("WARPGROUP.DEPBAR", 0) == ops["HGMMA"], (e["config"], ops)
        else:
            assert 2 * ops.get("WARPGROUP.DEPBAR", 0) <= ops["HGMMA"], (e["config"], ops)
    assert atomic_configs == 2, "the atomic dQ path is cross-compiled, plain and deterministic"


# Hopper backward configs whose WGMMAs ptxas serializes (hdim, dropout), exactly.
KNOWN_SERIALIZED_BWD = {(64, True)}


@pytest.mark.slow
def test_hopper_dq_postprocess_stores_whole_rows(inspected):
    """dQ leaves the fragment order through a shared tile: 128-bit global stores only (a
    fragment stored straight to global memory takes 32-bit pieces of 8 rows), after one
    barrier; a float32 dQ (a ring step's) twice as many as a 16-bit one."""
    entries = [e for e in inspected if e["kernel"] == "hopper.bwd.dq_postprocess"]
    assert entries and any(e["config"].get("fp32_out") for e in entries)
    for e in entries:
        tile_m, hdim = e["config"]["schedule"][0], e["config"]["hdim"]
        width = 4 if e["config"].get("fp32_out") else 2
        vectors = tile_m * hdim * width // 16 // 256  # 16-byte pieces of the tile per thread
        ops = e["sass"]
        assert ops["STG"] == ops["LDS"] == vectors and ops["BAR"] == 1 and ops["STS"] > 0, e


@pytest.mark.parametrize("tile, waits", [((64, 128, 2, False, False, None, True), (3, 1)),
                                         ((80, 128, 2, True, False, None, True), (2, 2))])
def test_hopper_bwd_waits_for_each_gemm_only_where_it_is_needed(tile, waits):
    """64 rows with P in shared memory: S runs under nothing but dP is issued before S is
    waited for (P's exp2 overlaps dP), dV under dS, dK under dQ's way out: `wgmma.wait_group 1`
    three times per query tile. 80 rows (transposed scores, dS before dV is issued, so the
    fp32 P, dP and 16-bit P are never all live): S and dP are waited for before P's exp2 (at
    80 and 128 rows the other warpgroup's GEMMs fill that wait; session 14 in the archived log),
    and dK runs under dQ's way out."""
    from flash_cute.arch.hopper.config import BwdSchedule
    from flash_cute.tools.xcompile import compile_for_target

    entry = next(c for c in registered_configs("hopper.bwd")
               if c.hdim == 128 and c.dtype == "bf16" and c.schedule == BwdSchedule(*tile)
               and not any(c.flag_dict.values()))
    sass = compile_for_target(entry, "sm_90a").sass
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == waits[0]
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == waits[1]
    assert sass.count("WARPGROUP.ARRIVE") == 5


_PV_WGMMA = re.compile(r"HGMMA\.\S+ R\d+, R\d+, gdesc")  # A (P) from registers


def _inner_loops(sass: str, issues: str) -> list:
    """The loops that run exp2 and issue the fewest WGMMAs matching `issues`: one iteration's
    worth. (Tile loops issue more, and so do the spans that ptxas's out-of-line blocks, such
    as an mbarrier wait's retry, close with a branch back.)"""
    count = lambda body: sum(bool(re.search(issues, x)) for x in body)  # noqa: E731
    loops = [b for b in loop_bodies(sass) if any("MUFU.EX2" in x for x in b) and count(b)]
    fewest = min(map(count, loops), default=0)
    return [b for b in loops if count(b) == fewest]


def _hopper_config(kernel: str, hdim: int, **flags):
    """The registered config of the head dim's default tile with exactly these flags on."""
    from flash_cute.arch.hopper.config import BWD_SCHEDULES, FWD_SCHEDULES

    tile = (FWD_SCHEDULES if kernel == "hopper.fwd" else BWD_SCHEDULES)[hdim]
    return next(c for c in registered_configs(kernel)
                if c.hdim == hdim and c.hdim_v == hdim and c.dtype == "bf16"
                and tuple(c.schedule) == tuple(tile)
                and {k: v for k, v in c.flag_dict.items() if v} == flags)


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_fwd_softmax_runs_under_the_pv_wgmma(causal):
    """The loop over blocks that need no mask waits for the PV WGMMA inside the softmax (after
    some of its exp2s), not before it, and builds no WGMMA descriptor in vector registers
    (R2UR; docs/decisions.md, D-HF-SPLIT and D-WGMMA-SLICE). Causal also has a loop for its
    masked blocks, which waits for both WGMMAs before masking (`drain`)."""
    from flash_cute.tools.xcompile import compile_for_target

    entry = _hopper_config("hopper.fwd", 128, **({"causal": True} if causal else {}))
    masking = re.compile(r"FSEL R\d+, R\d+, -INF")
    inner = _inner_loops(compile_for_target(entry, "sm_90a").sass, _PV_WGMMA.pattern)
    loops = [b for b in inner if not any(masking.search(x) for x in b)]
    masked = [b for b in inner if any(masking.search(x) for x in b)]
    assert len(loops) == 1 and len(masked) == int(causal), ([len(b) for b in loops],
                                                            [len(b) for b in masked])
    for body in masked:
        waits = [x for x in body if "WARPGROUP.DEPBAR.LE" in x]
        assert waits == ["WARPGROUP.DEPBAR.LE gsb0, 0x0"], waits
    body = loops[0]
    exp2 = [i for i, x in enumerate(body) if "MUFU.EX2" in x]
    wait_pv = [i for i, x in enumerate(body) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in x]
    assert len(wait_pv) == 1 and sum(i < wait_pv[0] for i in exp2) >= 8, (wait_pv, exp2[:12])
    assert not any(x.startswith("R2UR") for x in body)


def test_hopper_bwd_builds_wgmma_descriptors_in_uniform_registers():
    """Shared-memory operands partitioned per warpgroup (`wgmma.wgmma_slice`): no R2UR in the
    query-tile loop (there were 64 per iteration at hdim 128; D-WGMMA-SLICE)."""
    from flash_cute.tools.xcompile import compile_for_target

    sass = compile_for_target(_hopper_config("hopper.bwd", 128), "sm_90a").sass
    loops = _inner_loops(sass, r"HGMMA")
    assert loops and all(not any(x.startswith("R2UR") for x in b) for b in loops)


def test_loop_bodies_finds_backward_branches():
    sass = """
        /*0000*/                   MOV R1, R2 ;
        .L_x_1:
        /*0010*/                   IADD3 R1, R1, 0x1, RZ ;
        .L_x_2:
        /*0020*/                   MUFU.EX2 R3, R1 ;
        /*0030*/              @P0 BRA `(.L_x_2) ;
        /*0040*/              @P1 BRA `(.L_x_1) ;
        /*0050*/                   BRA `(.L_x_3) ;
        .L_x_3:
        /*0060*/                   EXIT ;
    """
    inner, outer = loop_bodies(sass)
    assert inner == ["MUFU.EX2 R3, R1", "@P0 BRA `(.L_x_2)"]
    assert outer[0] == "IADD3 R1, R1, 0x1, RZ" and outer[-1] == "@P1 BRA `(.L_x_1)"


def test_hopper_pipeline_has_a_backward():
    import flash_cute.arch.hopper.planner as hopper_api

    assert callable(hopper_api.backward)


@pytest.mark.slow
def test_dropout_kernels_run_philox_in_registers(inspected):
    """Each dropout kernel (issue 22) against its twin without dropout: no spill, and at least
    one softmax block's Philox4x32-10 rounds (19 of each group's 20 IMAD.WIDE; the first
    round's head product is shared) over the thread's groups: tile_n / 16 in a forward's two
    rows, at least two in a backward's fragment."""
    def key(e, drop=False):
        flags = {k: v for k, v in e["config"].items() if k not in ("schedule", "dropout")
                 and not isinstance(v, (list, tuple))}
        return (e["kernel"], e["target"], json.dumps(flags, sort_keys=True))

    twins = {key(e): e for e in inspected if not e["config"].get("dropout")}
    dropped = [e for e in inspected if e["config"].get("dropout")]
    assert {e["kernel"] for e in dropped} >= {"hopper.fwd", "hopper.bwd", "ampere.fwd",
                                              "ampere.bwd"}
    for e in dropped:
        assert e["spill_bytes"] == (known_spill(e) or 0), e
        twin = twins.get(key(e))
        if twin is None:
            continue
        groups = e["config"]["schedule"][1] // 16 if e["kernel"].endswith(".fwd") else 2
        if e["config"]["dropout"] == "frame":
            groups = 1   # any frame: a block per element, drawn in a loop
        extra = e["sass"].get("IMAD.WIDE", 0) - twin["sass"].get("IMAD.WIDE", 0)
        assert extra >= 19 * groups, (e["config"], extra)


@pytest.mark.slow
@pytest.mark.parametrize("kernel, target", [("ampere.fwd", "sm_80"), ("hopper.fwd", "sm_90a")])
def test_software_exp2_takes_its_share_off_mufu(inspected, kernel, target):
    """The causal hdim-128 forward with the software exp2 on 2 and 4 of every 16 scores
    (`exp2_emu`): MUFU.EX2 drops by that share of the softmax's exponentials (the per-row
    rescale factors stay on MUFU), each emulated value costs 3 FFMA (degree 3), no spill."""
    def entry(per16):
        found = [e for e in inspected if e["kernel"] == kernel and e["target"] == target
                 and e["config"].get("ex2_emu") == per16]
        assert len(found) == 1, (per16, found)
        return found[0]

    two, four = entry(2), entry(4)
    plain = {k: v for k, v in two["config"].items() if not k.startswith("ex2")}
    (base,) = [e for e in inspected if e["kernel"] == kernel and e["target"] == target
               and e["config"] == plain]
    assert plain["causal"] and plain["hdim"] == 128
    ex2 = [e["sass"].get("MUFU.EX2", 0) for e in (base, two, four)]
    drop2, drop4 = ex2[0] - ex2[1], ex2[0] - ex2[2]
    assert drop2 > 0 and drop4 == 2 * drop2, ex2
    # The rescale factors (one per row and softmax step) are the part of MUFU.EX2 that stays.
    assert 0.8 * 2 / 16 <= drop2 / ex2[0] <= 2 / 16, ex2
    ffma = [e["sass"].get("FFMA", 0) for e in (base, two, four)]
    assert ffma[1] - ffma[0] == 3 * drop2 and ffma[2] - ffma[0] == 3 * drop4, ffma
    assert two["spill_bytes"] == four["spill_bytes"] == 0
    assert two["config"]["ex2_emulation_fraction"] == 0.125


def test_the_report_shows_each_pipelines_roles_residency_and_primitives(tmp_path):
    """`inspect --report DIR`: one HTML page with the PNGs embedded and beside it; per
    pipeline its declared roles, its residency (S, P, O in tensor memory on blackwell only)
    and the primitives its SASS contains (WGMMA on hopper, tcgen05 on blackwell, mma.sync
    on ampere), and what changed from the previous generation."""
    import re

    proc = subprocess.run([sys.executable, "-m", "flash_cute", "inspect", "--report",
                           str(tmp_path), "--plot", ""], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "report.html").read_text()
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(pngs) == 6 and page.count("data:image/png;base64,") == 6
    sections = dict(re.findall(r"<h2 id='([a-z.]+)'>(.*?)(?=<h2 |</body>)", page, re.S))
    assert set(sections) == {"ampere.fwd", "ampere.bwd", "hopper.fwd", "hopper.bwd",
                             "blackwell.fwd", "blackwell.bwd"}

    def count(section, primitive):
        found = re.search(rf"<td>{re.escape(primitive)}</td><td>(\d+)</td>", section)
        return int(found.group(1))

    def resident(section, tensor):
        row = re.search(rf"<tr><td>{tensor}</td>((?:<td>x?</td>)+)</tr>", section).group(1)
        return [m for m, cell in zip(("GMEM", "SMEM", "TMEM", "RMEM"),
                                     re.findall(r"<td>(x?)</td>", row)) if cell]

    for name in ("softmax 0", "correction", "MMA", "load"):
        assert f"<td>{name}</td>" in sections["blackwell.fwd"]
    assert "<td>producer</td>" in sections["hopper.fwd"]
    assert "<td>all warps</td>" in sections["ampere.fwd"]
    assert resident(sections["blackwell.fwd"], "S") == ["TMEM"]
    assert resident(sections["hopper.fwd"], "S") == ["RMEM"]
    assert count(sections["blackwell.fwd"], "tcgen05 MMA") > 0
    assert count(sections["blackwell.fwd"], "TMEM allocation") > 0
    assert count(sections["hopper.fwd"], "WGMMA") > 0
    assert count(sections["hopper.fwd"], "tcgen05 MMA") == 0
    assert count(sections["ampere.fwd"], "mma.sync") > 0
    assert "what changed from hopper.fwd" in sections["blackwell.fwd"]
    assert "S moves from RMEM to TMEM" in sections["blackwell.fwd"]
    # The backward's pair: its 2-CTA forms and the relay role.
    assert "<td>relay</td>" in sections["blackwell.bwd"]
    assert count(sections["blackwell.bwd"], "2-CTA forms") > 0
    assert count(sections["blackwell.bwd"], "TMEM allocation") > 0
    assert resident(sections["blackwell.bwd"], "dQ") == ["GMEM", "TMEM"]


@pytest.mark.slow   # its configs' timer and spills are checked by the slow sweep too
def test_the_timeline_switch_reads_the_global_timer():
    """The hopper forward and backward compiled with their timeline switch (causal and not)
    record with the global timer (SR_GLOBALTIMERLO in the SASS: opcode counts cannot show it)
    and keep their register budgets; the forward spills nothing, the backward the known
    bytes; the same configs without the switch read no timer."""
    from dataclasses import replace
    from pathlib import Path

    from flash_cute.tools.pipelines import sass_facts
    from flash_cute.tools.xcompile import cross_compile

    timed = [c for c in CONFIGS if c.kernel.startswith("hopper.")
             and c.flag_dict.get("timeline")]
    assert len(timed) == 4
    plain = [replace(c, flags=tuple((k, v) for k, v in c.flags if k != "timeline"))
             for c in timed]
    assert all(c in CONFIGS for c in plain)
    for e in cross_compile(timed + plain):
        sass = Path(e["artifacts"]["sass"]).read_text()
        on = bool(e["config"].get("timeline"))
        assert sass_facts(sass)["global_timer"] == on, e["config"]
        if on:
            assert "SR_GLOBALTIMERLO" in sass, e["config"]
            assert e["spill_bytes"] == known_spill(e), (e["kernel"], e["config"])
            assert e["registers_per_role"] == {"producer": 24, "consumer": 240}
