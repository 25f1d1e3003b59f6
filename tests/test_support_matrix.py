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
    assert rows["blackwell"]["backward"] == "yes, deterministic"
    assert rows["blackwell"]["head dims"].endswith("192/128, 256")
    assert rows["blackwell"]["context parallel"] == "—"
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


def _refusals():
    """(file, line, literal text) of every NotImplementedError raised in a public path, its
    message's constant parts joined (f-string fields as {})."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [root / "flash_cute" / "flash_attn_interface.py",
             *(f for d in ("api", "runtime", "fp8", "parallel", "integrations", "variants")
               for f in (root / "flash_cute" / d).glob("*.py")),
             *root.glob("arch/*/planner.py")]

    def text(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return (text(node.left) or "") + (text(node.right) or "")
        return None

    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    getattr(node.exc.func, "id", None) == "NotImplementedError":
                yield (path.relative_to(root), node.lineno,
                       text(node.exc.args[0]) if node.exc.args else None)


def test_every_refusal_names_a_gap_the_matrix_lists():
    """Each NotImplementedError of a public path names a term of the README's support block:
    a `NOT_BUILT` entry (rendered under the matrix), a capability as messages spell it, or a
    matrix term (head dims, compute capability, ...)."""
    from flash_cute.contract.limits import MATRIX_TERMS, NOT_BUILT

    block = sm.readme_copy(sm.README.read_text())
    assert all(what in block for _, what in NOT_BUILT)
    terms = [t for t, _ in NOT_BUILT] + list(MATRIX_TERMS) + \
        [caps.spelled(c) for c in caps._SPELLED]
    found = list(_refusals())
    assert len(found) > 25
    unnamed = [(str(f), line, msg) for f, line, msg in found
               if msg is None or not any(t.lower() in msg.lower() for t in terms)]
    assert not unnamed, unnamed
