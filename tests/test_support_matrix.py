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
