"""Reporting a results list (pure: no GPU; matplotlib only inside `plot_results`): the
Markdown table with the ratio column, the JSON report, the plot, the environment header
(GPU, versions, date), and the tables of the A/Bs: an ablation script's (`ablation_table`) and
an A/B of source trees' (`tree_ab_table`, `bench/ab_trees.py`)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
from typing import Iterable, Sequence

from flash_cute.tools.bench.grid import DIRECTIONS
from flash_cute.tools.bench.measure import _median_min_max, spread_pct
from flash_cute.tools.bench.providers import OURS
from flash_cute.tools.bench.records import WRONG_TOL

# -------------------------------------------------------------------------- table

_DIRECTION_ORDER = {d: i for i, d in enumerate(DIRECTIONS)}
RATIO_COLUMN = "flash_cute / best peer"


def _row_sort_key(key: tuple) -> tuple:
    direction, hdim, causal, batch, seqlen = key
    return (_DIRECTION_ORDER.get(direction, 99), hdim, causal, seqlen, batch)


def group_rows(results: Iterable[dict]) -> dict[tuple, dict[str, dict]]:
    """{(direction, hdim, causal, batch, seqlen): {provider: record}}, in table order."""
    rows: dict[tuple, dict[str, dict]] = {}
    for r in results:
        key = (r["direction"], r["hdim"], r["causal"], r["batch"], r["seqlen"])
        rows.setdefault(key, {})[r["provider"]] = r
    return dict(sorted(rows.items(), key=lambda item: _row_sort_key(item[0])))


def _providers_in(results: Iterable[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in results:
        seen.setdefault(r["provider"], None)
    return list(seen)


def format_cell(record: dict | None) -> str:
    """TFLOP/s with one decimal, "WRONG" appended on a failed sanity check;
    "n/a" when unavailable, "ERR" on error, "-" when the provider was not run."""
    if record is None:
        return "-"
    if record["status"] == "unavailable":
        return "n/a"
    if record["status"] != "ok" or record.get("tflops") is None:
        return "ERR"
    text = f"{record['tflops']:.1f}"
    return f"{text} WRONG" if record.get("wrong") else text


def flash_cute_ratio(row: dict[str, dict]) -> float | None:
    """flash_cute TFLOP/s over the fastest peer that ran and passed the sanity check."""
    ours = row.get("flash_cute")
    if not ours or ours["status"] != "ok" or not ours.get("tflops"):
        return None
    peers = [r["tflops"] for name, r in row.items()
             if name not in OURS and r["status"] == "ok" and r.get("tflops")
             and not r.get("wrong")]
    return ours["tflops"] / max(peers) if peers else None


def format_header(env: dict) -> str:
    """One line per fact: GPU, software versions, dtype and date."""
    return "\n".join([
        f"GPU: {env.get('gpu') or 'unknown'} (sm_{env.get('capability') or '?'})",
        "versions: " + ", ".join(
            f"{name} {env.get(name) or 'n/a'}"
            for name in ("torch", "cuda", "triton", "cutlass-dsl", "flash-attn", "flash_cute")),
        f"dtype: {env.get('dtype', '?')}, arch: {env.get('arch', '?')}, "
        f"date: {env.get('date', '?')}",
    ])


def format_table(results: Sequence[dict], providers: Sequence[str] | None = None,
                 env: dict | None = None) -> str:
    """Markdown table (readable as-is in a terminal): one row per cell, one TFLOP/s
    column per provider, a ratio column when flash_cute ran, then a legend with the
    reasons for unavailable / failed cells."""
    providers = list(providers) if providers else _providers_in(results)
    rows = group_rows(results)
    with_ratio = "flash_cute" in providers and any(
        r["provider"] == "flash_cute" and r["status"] == "ok" for r in results)
    header = ["dir", "hdim", "causal", "batch", "seqlen", *providers]
    if with_ratio:
        header.append(RATIO_COLUMN)
    body = []
    for (direction, hdim, causal, batch, seqlen), row in rows.items():
        line = [direction, str(hdim), str(int(causal)), str(batch), str(seqlen)]
        line += [format_cell(row.get(p)) for p in providers]
        if with_ratio:
            ratio = flash_cute_ratio(row)
            line.append(f"{ratio:.2f}x" if ratio is not None else "-")
        body.append(line)
    parts = [format_header(env), ""] if env else []
    parts.append(markdown_table(header, body))
    parts.append("")
    parts.append(f"Values are TFLOP/s. WRONG: max |out - reference| > {WRONG_TOL:g}, or for bwd "
                 f"a gradient off by more than {WRONG_TOL:g} of its largest entry "
                 "(time still reported). n/a: unavailable. ERR: error.")
    parts += _reason_notes(results, providers)
    return "\n".join(parts)


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    """A Markdown table, columns padded and right-aligned (also for the ablation scripts in
    bench/)."""
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    def fmt(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([fmt(header), rule, *(fmt(row) for row in body)])


def _reason_notes(results: Sequence[dict], providers: Sequence[str]) -> list[str]:
    """One note per (provider, status, reason), with a cell count, so 72 cells with the
    same missing-kernel reason produce one line."""
    counts: dict[tuple, int] = {}
    for r in results:
        if r["provider"] in providers and r["status"] != "ok":
            key = (r["provider"], "n/a" if r["status"] == "unavailable" else "ERR",
                   r.get("reason") or "")
            counts[key] = counts.get(key, 0) + 1
    return [f"- {label} {provider} ({n} cell{'s' * (n != 1)}): {reason}"
            for (provider, label, reason), n in counts.items()]


# --------------------------------------------------------------------- JSON, plot

def _finite_or_none(value):
    """JSON has no NaN/inf; the WRONG flag already records that a diff was not finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def build_report(results: Sequence[dict], env: dict, settings: dict) -> dict:
    """The JSON document: environment, run settings and every raw result."""
    clean = [{k: _finite_or_none(v) for k, v in r.items()} for r in results]
    return {"environment": env, "settings": settings, "wrong_tol": WRONG_TOL,
            "results": clean}


def write_json(report: dict, path: str) -> None:
    """Write the report atomically, so a crash mid-run leaves the last complete file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def plot_results(results: Sequence[dict], path: str, title: str | None = None) -> str:
    """PNG with one subplot per (direction, causal, hdim): x = seqlen (log2), y = TFLOP/s,
    one line per provider; black rings mark points that failed the sanity check."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["direction"], r["causal"]) for r in results},
                    key=lambda p: (_DIRECTION_ORDER.get(p[0], 99), p[1]))
    hdims = sorted({r["hdim"] for r in results})
    # One colour per provider across all panels, so lines are comparable at a glance.
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ran = _providers_in(r for r in results if r["status"] == "ok")
    colors = {p: cycle[i % len(cycle)] for i, p in enumerate(ran)}
    nrows, ncols = max(len(panels), 1), max(len(hdims), 1)
    fig, axes = plt.subplots(nrows, ncols, squeeze=False, figsize=(4.5 * ncols, 3.2 * nrows))
    for i, (direction, causal) in enumerate(panels):
        for j, hdim in enumerate(hdims):
            _plot_panel(axes[i][j], results, colors, direction, causal, hdim)
    legend: dict = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    if WRONG_LABEL in legend:
        legend[WRONG_LABEL] = legend.pop(WRONG_LABEL)  # last in the legend
    top = 1 - 0.6 / (3.2 * nrows)  # room for the legend and title, in figure fraction
    fig.tight_layout(rect=(0, 0, 1, top))
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="lower center",
                   bbox_to_anchor=(0.5, top), ncol=len(legend), frameon=False)
    if title:
        fig.suptitle(title, y=1.0, fontsize=10, va="top")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


WRONG_LABEL = "WRONG (sanity check)"


def _plot_panel(ax, results, colors, direction, causal, hdim) -> None:
    ax.set_title(f"{direction} {'causal' if causal else 'non-causal'} hdim={hdim}", fontsize=10)
    ax.set_xlabel("seqlen")
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, alpha=0.3)
    panel = [r for r in results if r["direction"] == direction and r["causal"] == causal
             and r["hdim"] == hdim and r["status"] == "ok" and r.get("tflops")]
    if not panel:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    for provider, color in colors.items():
        points = sorted((r["seqlen"], r["tflops"], bool(r.get("wrong")))
                        for r in panel if r["provider"] == provider)
        if not points:
            continue
        xs, ys, _ = zip(*points)
        ax.plot(xs, ys, marker="o", color=color, label=provider)
        bad = [(x, y) for x, y, wrong in points if wrong]
        if bad:
            ax.scatter(*zip(*bad), s=110, facecolors="none", edgecolors="black",
                       linewidths=1.5, zorder=3, label=WRONG_LABEL)
    seqlens = sorted({r["seqlen"] for r in panel})
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [str(x) for x in seqlens], rotation=45, fontsize=7)
    ax.minorticks_off()
    ax.set_ylim(bottom=0)


# --------------------------------------------------------------------- environment

def package_version(*dist_names: str) -> str | None:
    """Version of the first installed distribution among `dist_names`, else None."""
    for name in dist_names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment_info(device: str = "cuda") -> dict:
    """GPU name and capability, software versions and the date (ISO, local time)."""
    import torch

    import flash_cute

    env = {
        "gpu": None,
        "capability": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton", "pytorch-triton"),
        "cutlass-dsl": package_version("nvidia-cutlass-dsl"),
        "flash-attn": package_version("flash-attn-4", "flash_attn_4", "flash-attn-cute",
                                      "flash-attn", "flash_attn"),
        "flash_cute": getattr(flash_cute, "__version__", None),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    if device == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        env.update(gpu=torch.cuda.get_device_name(), capability=f"{major}{minor}")
    return env


# ---------------------------------------------------------------------- A/B tables

def ablation_table(rows: list, metric: str, err_label: str) -> str:
    """The Markdown table of `measure.ablation_rows` rows over (hdim, seqlen, causal) cells."""
    header = ["hdim", "seqlen", "causal", "provider", metric, "round spread", err_label]
    return markdown_table(header, [[*map(str, r[:4]), f"{r[4]:.1f}", r[5], r[6]]
                                   for r in rows])


def tree_ab_table(runs: Sequence[tuple[str, Sequence[dict]]]) -> str:
    """The Markdown table of an A/B of source trees (`bench/ab_trees.py`): `runs` holds one
    (tree name, bench.json results) per process, rounds interleaved. Per cell: each tree's
    median flash_cute TFLOP/s with its rounds' spread (`measure.spread_pct`), each tree
    against the first, and the peers' medians over every process."""
    trees = list(dict.fromkeys(name for name, _ in runs))
    ms: dict = {}
    flops: dict = {}
    for name, results in runs:
        for r in results:
            if r.get("status") != "ok":
                continue
            cell = (r["direction"], r["hdim"], int(r["causal"]), r["batch"], r["seqlen"])
            who = name if r["provider"] == "flash_cute" else r["provider"]
            ms.setdefault(cell, {}).setdefault(who, []).append(r["ms"])
            flops[cell] = r["flops"]
    peers = sorted({w for by in ms.values() for w in by} - set(trees))
    header = ["dir", "hdim", "causal", "batch", "seqlen", *trees,
              *[f"{t} / {trees[0]}" for t in trees[1:]], *peers]
    body = []
    for cell in sorted(ms, key=_row_sort_key):
        by = ms[cell]
        stats = {w: _median_min_max(t) for w, t in by.items()}
        tflops = {w: flops[cell] / st[0] / 1e9 for w, st in stats.items()}
        row = [*map(str, cell)]
        row += [f"{tflops[t]:.1f} ({spread_pct(stats[t])})" if t in stats else "—" for t in trees]
        row += [f"{tflops[t] / tflops[trees[0]]:.3f}x" if t in tflops and trees[0] in tflops
                else "—" for t in trees[1:]]
        row += [f"{tflops[p]:.1f}" if p in tflops else "—" for p in peers]
        body.append(row)
    return markdown_table(header, body)
