"""The README's support matrix is the one generated from the pipelines' descriptors, and the
generator reads them: verification, decode paths, FP8, context parallelism, features."""

import dataclasses

import pytest

from flash_cute.contract import descriptor as caps
from flash_cute.tools import support_matrix as sm


def test_the_readme_matrix_is_the_generated_one():
    assert sm.readme_copy(sm.README.read_text()) == sm.markdown()


def test_each_row_reads_its_descriptor():
    rows = {r["pipeline"]: r for r in (sm.row(d) for d in sm.descriptors())}
    assert set(rows) == {"ampere", "hopper", "blackwell"}
    assert rows["blackwell"]["verified"] == "compile-verified only"
    assert rows["blackwell"]["backward"] == rows["blackwell"]["context parallel"] == "—"
    assert rows["hopper"]["backward"] == "yes, deterministic"
    assert rows["hopper"]["FP8"].startswith("forward") and rows["ampere"]["FP8"] == "—"
    assert "packed GQA" in rows["hopper"]["features"]
    assert "packed GQA" not in rows["ampere"]["features"]
    assert rows["hopper"]["verified"].startswith("on an ")


def test_a_changed_descriptor_changes_its_row():
    base = caps.Descriptor("x", range(9, 10), frozenset({caps.FORWARD, caps.CAUSAL}),
                           hardware_tested=False, head_dims=((64, 64), (192, 128)))
    r = sm.row(base)
    assert (r["GPUs"], r["head dims"], r["features"]) == ("sm90", "64, 192/128", "causal")
    tested = dataclasses.replace(base, hardware_tested=True, verified="H200, 2026-12-01",
                                 capabilities=base.capabilities | {caps.BACKWARD},
                                 decode=("split-KV",))
    r = sm.row(tested)
    assert r["verified"] == "on an H200, 2026-12-01"
    assert r["context parallel"] == "ring, Ulysses, forward and backward"
    with pytest.raises(ValueError, match="go together"):
        dataclasses.replace(base, hardware_tested=True)


def test_the_main_job_prints_the_row_of_the_gpu_it_found(monkeypatch, capsys):
    """`python -m flash_cute` on a GPU (its capability monkeypatched) starts with the row of
    the pipeline dispatch takes there: hopper on 9.0, ampere on 10.0 unless blackwell is
    allowed, nothing on 7.x."""
    import argparse

    import torch

    from flash_cute.tools import selfcheck

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a test card")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    for name in ("check_score_attention", "check_lse_merge", "check_attention"):
        monkeypatch.setattr(selfcheck, name, lambda: True)
    assert selfcheck.run(argparse.Namespace(no_bench=True)) == 0
    out = capsys.readouterr().out
    assert "a test card" in out and "  pipeline: hopper" in out and "  FP8: forward" in out
    assert "  pipeline: ampere" in sm.device_summary(10)
    monkeypatch.setenv("FLASH_CUTE_ALLOW_UNTESTED", "blackwell")
    assert "  verified: compile-verified only" in sm.device_summary(10)
    assert sm.device_summary(7) == "no pipeline runs on compute capability 7.x"
