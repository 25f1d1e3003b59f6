"""docs/architecture.md is the map: every file or folder it names in backticks exists, but the
places it marks reserved; the changelog's moved paths exist; every relative link resolves."""

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
    missing = sorted(p for p in _named_paths(DOC.read_text()) - RESERVED if not _exists(p))
    assert not missing, missing


def test_every_new_path_of_the_changelogs_move_table_exists():
    """docs/CHANGELOG.md lists the modules the layered move relocated: each new path exists
    (the old ones need not)."""
    text = (ROOT / "docs" / "CHANGELOG.md").read_text()
    table = text.split("old paths -> new paths", 1)[1]
    rows = re.findall(r"^\| `([^`]+)` \| (.*) \|$", table, flags=re.M)
    assert len(rows) > 20, "the old -> new table is missing"
    missing = sorted(p for _, new in rows for p in _named_paths(new) if not _exists(p))
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


def test_the_readme_is_short_and_the_user_docs_say_nothing_internal():
    """The README fits in 150 lines; the README and the user pages (the guide, the changelog)
    name no issue, session or decision code (those live in docs/decisions.md and
    docs/perf.md)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    pages = [ROOT / "README.md", ROOT / "docs" / "CHANGELOG.md",
             *sorted((ROOT / "docs" / "guide").glob("*.md"))]
    internal = re.compile(r"\bD-[A-Z][A-Z0-9-]+|\b[Ii]ssues? #?\d+|\b[Ss]essions? \d+")
    found = [f"{p.relative_to(ROOT)}: {m}" for p in pages for m in internal.findall(p.read_text())]
    assert not found, found


def test_the_readme_performance_figure_is_drawn_from_the_latest_grid():
    """The README's performance block is what `bench/perf_figure.py` makes of docs/perf.md's
    standard-grid section (its date, card and peers), and the PNG it draws is there."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("perf_figure", ROOT / "bench" / "perf_figure.py")
    figure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figure)
    grid = figure.latest_grid((ROOT / "docs" / "perf.md").read_text())
    assert len(grid["rows"]) >= 48 and grid["providers"][0] == "flash_cute"
    text = (ROOT / "README.md").read_text()
    assert figure.START + text.split(figure.START, 1)[1].split(figure.END, 1)[0] + figure.END \
        == figure.readme_block(grid)
    assert figure.PNG.read_bytes()[:4] == b"\x89PNG"
