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


def _program(pages, slow: bool) -> tuple:
    """Every page's examples as one script (one interpreter: torch is imported once), each
    page in a fresh namespace, each block's output fenced by a marker line; and the stated
    outputs by (page, block)."""
    parts, stated = [], []
    for page in pages:
        code = []
        for i, (mark, block, output) in enumerate(blocks(page)):
            if mark == "gpu" and not torch.cuda.is_available() or mark == "slow" and not slow:
                continue
            code.append(f"print('<<{page.stem} {i}>>')\n{block}")
            stated.append((f"{page.stem} {i}", output))
        parts.append(f"exec({chr(10).join(code)!r}, {{'__name__': '__main__'}})")
    return "\n".join(parts), stated


def _run(pages, slow: bool, tmp_path):
    program, stated = _program(pages, slow)
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stdout[-1500:] + run.stderr[-3000:]
    printed = dict(re.findall(r"<<(\w[\w-]* \d+)>>\n(.*?)(?=<<\w[\w-]* \d+>>|\Z)",
                              run.stdout, re.S))
    for key, output in stated:
        if output is not None:
            assert printed[key].strip() == output, (key, printed[key])


def test_the_guide_has_pages_with_examples():
    assert {p.name for p in PAGES} >= {"training.md", "inference.md", "variants.md"}
    assert all(blocks(p) for p in PAGES)


def test_the_guide_pages_run_as_written(tmp_path):
    _run(PAGES, slow=False, tmp_path=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_a_guide_page_runs_with_its_slow_examples(page, tmp_path):
    """One process a page: an example that forks ranks must fork before the process has
    started torch's thread pools (a fork after them can deadlock the children)."""
    _run([page], slow=True, tmp_path=tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the guide's GPU examples need CUDA")
def test_the_guide_pages_gpu_examples_run(tmp_path):
    """The examples marked for the GPU (with their pages' CPU ones, which they build on), in
    the GPU suite."""
    pages = [p for p in PAGES if any(mark == "gpu" for mark, _, _ in blocks(p))]
    assert pages
    _run(pages, slow=False, tmp_path=tmp_path)
