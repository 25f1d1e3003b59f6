"""The user guide's examples run: each page's ```python blocks in order, in one fresh process
on the CPU, and each block's stated output (the `Output:` line after it) is what it prints.
A block marked `<!-- example: slow -->` runs in `pytest -m slow` only; `<!-- example: gpu -->`
only where CUDA is."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide"
BLOCK = re.compile(r"(?:<!-- example: (\w+) -->\n)?```python\n(.*?)```\n(?:\nOutput: `([^`]*)`)?",
                   re.S)
PAGES = sorted(p for p in GUIDE.glob("*.md") if "```python" in p.read_text())


def blocks(page: Path):
    """(mark or None, code, stated output or None) of each example on `page`."""
    return [m.groups() for m in BLOCK.finditer(page.read_text())]


def _program(page: Path, slow: bool) -> tuple:
    """The page's examples as one script, each block's output fenced by a marker line; and
    the stated outputs, in order."""
    parts, stated = [], []
    for i, (mark, code, output) in enumerate(blocks(page)):
        if mark == "gpu" and not torch.cuda.is_available() or mark == "slow" and not slow:
            continue
        parts.append(f"print('<<block {i}>>')\n{code}")
        stated.append((i, output))
    return "\n".join(parts), stated


def _run(page: Path, slow: bool, tmp_path):
    program, stated = _program(page, slow)
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         cwd=tmp_path, timeout=600)
    assert run.returncode == 0, f"{page.name}:\n{run.stderr[-3000:]}"
    printed = dict(re.findall(r"<<block (\d+)>>\n(.*?)(?=<<block |\Z)", run.stdout, re.S))
    for i, output in stated:
        if output is not None:
            assert printed[str(i)].strip() == output, (page.name, i, printed[str(i)])


def test_the_guide_has_pages_with_examples():
    assert {p.name for p in PAGES} >= {"training.md", "inference.md"}
    assert all(blocks(p) for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_a_guide_page_runs_as_written(page, tmp_path):
    _run(page, slow=False, tmp_path=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_a_guide_page_runs_with_its_slow_examples(page, tmp_path):
    _run(page, slow=True, tmp_path=tmp_path)
