"""The README's performance figure, drawn from docs/perf.md's latest standard-grid table: hdim
128 forward and backward TFLOP/s, causal and not, over the sequence lengths, ours beside the
peers of that run, with its date and card.

    python bench/perf_figure.py            # print the README's block
    python bench/perf_figure.py --write    # draw docs/perf-grid.png, rewrite the README block

A test checks that the README's block is the one this prints (the PNG is redrawn with
--write whenever docs/perf.md's grid changes)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERF, README, PNG = ROOT / "docs" / "perf.md", ROOT / "README.md", ROOT / "docs" / "perf-grid.png"
START, END = "<!-- perf-figure:start -->", "<!-- perf-figure:end -->"
NAMES = {"flash_cute": "flash-cute", "fa4": "FA4", "sdpa_cudnn": "cuDNN (SDPA)",
         "sdpa_flash": "FA2 (SDPA)"}


def latest_grid(text: str) -> dict:
    """date, card, providers and rows {(dir, hdim, causal, seqlen): {provider: TFLOP/s}} of
    the standard-grid section."""
    head = re.search(r"^## The standard grid — last run (\d{4}-\d\d-\d\d)", text, flags=re.M)
    section = text[head.start():].split("\n## ", 1)[0]
    card = re.search(r"\*\*Where:\*\* the lent (\w+)", section).group(1)
    header = re.search(r"^\| dir \|(.*)\|$", section, flags=re.M).group(1)
    columns = [c.strip() for c in header.split("|")]
    providers = columns[4:-1]
    rows = {}
    for line in re.findall(r"^\| (?:fwd|bwd) \|.*\|$", section, flags=re.M):
        cells = [c.strip() for c in line.strip("|").split("|")]
        key = (cells[0], int(cells[1]), int(cells[2]), int(cells[4]))
        rows[key] = {p: float(v) for p, v in zip(providers, cells[5:5 + len(providers)])}
    return {"date": head.group(1), "card": card, "providers": providers, "rows": rows}


def caption(grid: dict) -> str:
    peers = ", ".join(NAMES.get(p, p) for p in grid["providers"][1:])
    return (f"hdim 128 TFLOP/s on an {grid['card']}, {grid['date']}, beside {peers} "
            f"(`python -m flash_cute bench`; every cell in [docs/perf.md](docs/perf.md))")


def readme_block(grid: dict) -> str:
    return "\n".join([START, "![hdim 128 forward and backward TFLOP/s](docs/perf-grid.png)", "",
                      caption(grid) + ".", END])


def draw(grid: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2), sharey=True)
    panels = [(d, c) for d in ("fwd", "bwd") for c in (0, 1)]
    for ax, (direction, causal) in zip(axes, panels):
        cells = sorted((k, v) for k, v in grid["rows"].items()
                       if k[:3] == (direction, 128, causal))
        lengths = [k[3] for k, _ in cells]
        for provider in grid["providers"]:
            ax.plot(lengths, [v[provider] for _, v in cells], marker="o",
                    label=NAMES.get(provider, provider))
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
        ax.set_title(f"{'forward' if direction == 'fwd' else 'backward'}"
                     f"{', causal' if causal else ''}")
        ax.set_xlabel("tokens per sequence")
    axes[0].set_ylabel("TFLOP/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"hdim 128 on an {grid['card']}, {grid['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    grid = latest_grid(PERF.read_text())
    block = readme_block(grid)
    if not args.write:
        print(block)
        return 0
    draw(grid, PNG)
    text = README.read_text()
    old = START + text.split(START, 1)[1].split(END, 1)[0] + END
    README.write_text(text.replace(old, block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
