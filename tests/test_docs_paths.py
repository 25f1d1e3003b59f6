"""docs/architecture.md is the map: every file or folder it names in backticks exists, but the
old paths of its old -> new table and the places it marks reserved."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
RESERVED = {"flash_cute/parallel/", "flash_cute/fp8/"}


def _named_paths(text: str) -> set:
    spans = set(re.findall(r"`([^`\s]+)`", re.sub(r"```.*?```", "", text, flags=re.S)))
    return {s for s in spans if "/" in s and (s.endswith(".py") or s.endswith("/"))
            and not s.startswith(("http", "../"))}


def _exists(path: str) -> bool:
    pattern = path.replace("<name>", "*")
    return any(ROOT.glob(pattern.rstrip("/"))) if "*" in pattern else (ROOT / path).exists()


def test_every_path_the_map_names_exists():
    text = DOC.read_text()
    old_table = text.split("## Old paths -> new paths", 1)[1].split("\n## ", 1)[0]
    old = {m for m in re.findall(r"^\| `([^`]+)` \|", old_table, flags=re.M)}
    assert old, "the old -> new table is missing"
    missing = sorted(p for p in _named_paths(text) - old - RESERVED if not _exists(p))
    assert not missing, missing


def test_the_map_opens_with_the_layer_table():
    head = DOC.read_text().split("\n## ", 1)[0]
    for layer in ("contract", "blocks", "kernels", "variants", "reference", "runtime", "api",
                  "tools"):
        assert f"| {layer} |" in head, layer
