"""The README's quickstart runs as written, on the CPU, and prints what the README says."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart() -> str:
    text = README.read_text().split("<!-- quickstart -->", 1)[1]
    return re.search(r"```python\n(.*?)```", text, flags=re.S).group(1)


def test_the_readme_quickstart_runs_and_prints_its_stated_output(tmp_path):
    said = re.search(r"Output: `([^`]*)`", README.read_text().split("<!-- quickstart -->")[1])
    run = subprocess.run([sys.executable, "-c", quickstart()], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == said.group(1)
