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


def test_every_relative_link_in_the_readme_and_docs_resolves():
    """Markdown links `[text](path)` that are not URLs point at files that exist (anchors
    dropped), in the README and every page under docs/."""
    import re

    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(root)}: {target}")
    assert not broken, broken
