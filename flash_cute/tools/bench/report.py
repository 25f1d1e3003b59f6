"""`python -m flash_cute bench`: attention throughput against peer implementations.

The module is split in two halves so the CPU-only test suite can cover most of it:

* pure parts (no GPU, no triton, no matplotlib at import time): the benchmark grid and
  its filters, the FLOP formula, result records, the text table, the JSON report and the
  plot of a results list;
* device parts: providers (our kernels, flash-attn-4, two SDPA backends), input
  creation, the per-cell sanity check and timing, and `run()`. They take the device and
  the timer as arguments, so they also run (slowly, with a fake timer) on the CPU.

A result is a flat dict (see `make_record`); one is produced per (cell, provider).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

# --------------------------------------------------------------------------- grid

HDIMS = (64, 128, 256)
SIZES = ((32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384))
QUICK_HDIMS = (64, 128)
QUICK_SIZES = ((8, 2048), (2, 8192))
CAUSALS = (False, True)
DIRECTIONS = ("fwd", "bwd")
# Constant total width (nheads * hdim) keeps the memory traffic per token comparable
# across head dims, as in the flash-attention benchmarks.
MODEL_DIM = 2048

PROVIDERS = ("flash_cute", "fa4", "sdpa_cudnn", "sdpa_flash", "sdpa_flash_cute")
# Providers that run flash-cute's kernels (no peers of the ratio column).
OURS = ("flash_cute", "sdpa_flash_cute")
ARCHS = ("auto", "ampere", "hopper", "blackwell")
DTYPES = ("bf16", "fp16")

# A bf16 attention output is O(1); errors above this mean a wrong kernel, not rounding.
WRONG_TOL = 5e-2

CUDA_MESSAGE = "bench needs a CUDA GPU; use `python -m flash_cute inspect` on a CPU-only machine"


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark cell; layout is [batch, seqlen, nheads, hdim] with seqlen_q == seqlen_k."""

    direction: str
    hdim: int
    causal: bool
    batch: int
    seqlen: int
    nheads: int

    @property
    def key(self) -> tuple:
        """Row identity in the table: (direction, hdim, causal, batch, seqlen)."""
        return (self.direction, self.hdim, self.causal, self.batch, self.seqlen)

    def label(self) -> str:
        """Short human-readable description, used in progress lines."""
        return (f"{self.direction} hdim={self.hdim} causal={int(self.causal)} "
                f"b={self.batch} s={self.seqlen} h={self.nheads}")


def make_grid(quick: bool = False) -> list[BenchConfig]:
    """All cells of the standard (or `--quick`) grid, in table order."""
    hdims, sizes = (QUICK_HDIMS, QUICK_SIZES) if quick else (HDIMS, SIZES)
    return [
        BenchConfig(direction, hdim, causal, batch, seqlen, MODEL_DIM // hdim)
        for direction in DIRECTIONS
        for hdim in hdims
        for causal in CAUSALS
        for batch, seqlen in sizes
    ]


def filter_grid(
    configs: Iterable[BenchConfig],
    hdims: Sequence[int] | None = None,
    seqlens: Sequence[int] | None = None,
    causal: str = "both",
    direction: str = "both",
) -> list[BenchConfig]:
    """Keep the cells matching every given filter (None / "both" means no filter)."""
    causals = {"0": {False}, "1": {True}, "both": {False, True}}[str(causal)]
    directions = set(DIRECTIONS) if direction == "both" else {direction}
    return [
        c for c in configs
        if (hdims is None or c.hdim in hdims)
        and (seqlens is None or c.seqlen in seqlens)
        and c.causal in causals
        and c.direction in directions
    ]


# -------------------------------------------------------------------------- flops

def attention_flops(
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    hdim: int,
    hdim_v: int | None = None,
    causal: bool = False,
    direction: str = "fwd",
) -> float:
    """Nominal FLOPs of one attention pass, the convention of the FlashAttention papers.

    Forward: two matmuls (QK^T and PV) of 2·sq·sk·d each, i.e. 2·b·h·sq·sk·(d + d_v),
    which is 4·b·h·sq·sk·d when d_v == d. Causal halves it; this standard halving is
    applied even when sq != sk (then it is only an approximation of the unmasked work).
    Backward counts 2.5x the forward (five matmuls instead of two).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    hdim_v = hdim if hdim_v is None else hdim_v
    flops = 2.0 * batch * nheads * seqlen_q * seqlen_k * (hdim + hdim_v)
    if causal:
        flops /= 2
    if direction == "bwd":
        flops *= 2.5
    return flops


def tflops_per_s(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s of `flops` done in `ms` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------ records

def make_record(
    cell: BenchConfig,
    provider: str,
    status: str,
    ms: float | None = None,
    max_abs_diff: float | None = None,
    reason: str | None = None,
    grad_rel_diff: float | None = None,
) -> dict:
    """One result: config fields + provider, status ("ok", "unavailable", "error"),
    time, TFLOP/s, sanity-check diffs (forward output; for bwd cells also the gradients,
    relative to their largest entry), WRONG flag and the reason when not ok."""
    flops = attention_flops(cell.batch, cell.nheads, cell.seqlen, cell.seqlen, cell.hdim,
                            causal=cell.causal, direction=cell.direction)
    record = asdict(cell)
    record.update(
        provider=provider,
        status=status,
        ms=ms,
        flops=flops,
        tflops=tflops_per_s(flops, ms) if ms else None,
        max_abs_diff=max_abs_diff,
        grad_rel_diff=grad_rel_diff,
        wrong=is_wrong(max_abs_diff) or is_wrong(grad_rel_diff),
        reason=reason,
    )
    return record


def is_wrong(max_abs_diff: float | None) -> bool:
    """True when a sanity-check diff exceeds WRONG_TOL; NaN counts as wrong."""
    if max_abs_diff is None:
        return False
    return not max_abs_diff <= WRONG_TOL


def classify_error(exc: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception raised while running one provider on one cell.

    Missing features, missing kernels and out-of-memory are "unavailable" (a property of
    the config), anything else is an "error" (a bug worth looking at).
    """
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, (Unavailable, NotImplementedError, ImportError)):
        return "unavailable", text or type(exc).__name__
    lowered = str(exc).lower()
    if isinstance(exc, _oom_types()) or "out of memory" in lowered:
        return "unavailable", "out of memory"
    if "no available kernel" in lowered or "no viable backend" in lowered:
        return "unavailable", text
    return "error", f"{type(exc).__name__}: {text}"


def _oom_types() -> tuple[type, ...]:
    import torch

    return tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                             getattr(torch.cuda, "OutOfMemoryError", None)) if t)


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


# ----------------------------------------------------------------------- providers

class Unavailable(Exception):
    """A provider cannot run a config (missing package, feature or kernel): reported
    in the table as n/a with this message, never as an error."""


@dataclass
class Provider:
    """A benchmarked implementation.

    `forward(q, k, v, causal)` takes [b, s, h, d] tensors and returns the [b, s, h, d]
    output; with requires_grad inputs the output carries the autograd graph, which is
    how the backward pass is timed. `context()` is entered around all calls of a cell
    (e.g. the SDPA backend selection) so it is not part of the timed callable.
    `unavailable` holds the reason when the provider cannot run at all.
    """

    name: str
    forward: Callable | None = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    unavailable: str | None = None


def _first(result):
    """flash-attn-4 convention: `out` or `(out, lse)`."""
    return result[0] if isinstance(result, (tuple, list)) else result


def load_flash_cute(arch: str = "auto") -> Provider:
    """Our kernels through `flash_cute.flash_attn_func`; `arch="auto"` passes no arch
    keyword so the library's own dispatch decides."""
    import flash_cute

    func = getattr(flash_cute, "flash_attn_func", None)
    if func is None:
        return Provider("flash_cute",
                        unavailable="flash_cute.flash_attn_func is not implemented yet")
    kwargs = {} if arch == "auto" else {"arch": arch}

    def forward(q, k, v, causal):
        return _first(func(q, k, v, causal=causal, **kwargs))

    return Provider("flash_cute", forward)


def load_fa4() -> Provider:
    """flash-attn-4 (`flash_attn.cute.flash_attn_func`), when installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # a broken install raises more than ImportError
        return Provider("fa4", unavailable=f"flash_attn.cute not importable: {exc}")

    def forward(q, k, v, causal):
        return _first(flash_attn_func(q, k, v, causal=causal))

    return Provider("fa4", forward)


def load_sdpa(name: str) -> Provider:
    """torch SDPA restricted to one backend ("sdpa_cudnn" or "sdpa_flash"), on
    [b, h, s, d] transposed views of the [b, s, h, d] storage."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_flash": SDPBackend.FLASH_ATTENTION}[name]

    def forward(q, k, v, causal):
        try:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        except RuntimeError as exc:
            status, reason = classify_error(exc)
            if status == "unavailable":
                raise Unavailable(reason) from exc
            raise
        return out.transpose(1, 2)

    return Provider(name, forward, context=lambda: sdpa_kernel(backend))


def load_sdpa_flash_cute() -> Provider:
    """torch SDPA's flash backend with flash-cute activated as its implementation
    (`flash_cute.integrations.sdpa`), only around this provider's calls."""
    import torch.nn.attention as attention

    if not hasattr(attention, "register_flash_attention_impl"):
        return Provider("sdpa_flash_cute", unavailable="torch has no flash-attention registry")
    from flash_cute.integrations import sdpa

    sdpa.register()
    flash = load_sdpa("sdpa_flash")

    @contextlib.contextmanager
    def context():
        attention.activate_flash_attention_impl(sdpa.IMPL)
        try:
            with flash.context():
                yield
        finally:
            attention.restore_flash_attention_impl()

    return Provider("sdpa_flash_cute", flash.forward, context=context)


def load_provider(name: str, arch: str = "auto") -> Provider:
    """Provider by name; never raises for a missing package (see Provider.unavailable)."""
    if name == "flash_cute":
        return load_flash_cute(arch)
    if name == "fa4":
        return load_fa4()
    if name in ("sdpa_cudnn", "sdpa_flash"):
        return load_sdpa(name)
    if name == "sdpa_flash_cute":
        return load_sdpa_flash_cute()
    raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS}")


# -------------------------------------------------------------------- device cells

def make_inputs(cell: BenchConfig, dtype, device: str = "cuda"):
    """Fresh random q, k, v (requires_grad for bwd cells) and dout, all [b, s, h, d]."""
    import torch

    shape = (cell.batch, cell.seqlen, cell.nheads, cell.hdim)
    grad = cell.direction == "bwd"
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=grad)
               for _ in range(3))
    dout = torch.randn(shape, device=device, dtype=dtype) if grad else None
    return q, k, v, dout


def math_reference(q, k, v, causal: bool, max_bytes: int = 1 << 31):
    """float32 math-SDPA output in [b, s, h, d]; heads are processed in chunks so the
    materialized score matrix stays below `max_bytes` even at seqlen 16k."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, sq, h, _ = q.shape
    sk = k.shape[1]
    chunk = max(1, min(h, max_bytes // max(1, b * sq * sk * 4)))
    outs = []
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        for start in range(0, h, chunk):
            sl = slice(start, start + chunk)
            qc, kc, vc = (t[:, :, sl].float().transpose(1, 2) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)
                        .transpose(1, 2))
    return torch.cat(outs, dim=2)


def reference_output(q, k, v, causal: bool, flash: Provider | None):
    """(output, name) to check every provider against: sdpa_flash when it runs the
    config, else the float32 math reference; (None, reason) if neither fits."""
    import torch

    if flash is not None and flash.forward is not None:
        try:
            with flash.context(), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return flash.forward(q, k, v, causal), "sdpa_flash"
        except Exception:
            pass  # fall back to the math reference below
    try:
        return math_reference(q, k, v, causal), "math_fp32"
    except Exception as exc:
        return None, f"no reference: {classify_error(exc)[1]}"


def reference_grads(q, k, v, dout, causal: bool, flash: Provider | None):
    """(dq, dk, dv) of the same reference as `reference_output`, for bwd cells; None when no
    reference can run the cell."""
    import torch

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        if flash is not None and flash.forward is not None:
            with flash.context(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = flash.forward(*leaves, causal)
        else:
            out = math_reference(*leaves, causal)
        return torch.autograd.grad(out, leaves, dout)
    except Exception:
        return None


def grad_rel_diff(grads, ref_grads) -> float | None:
    """max over dq, dk, dv of max|g - g_ref| / max|g_ref| (NaN propagates)."""
    if ref_grads is None:
        return None
    rel = []
    for g, r in zip(grads, ref_grads):
        r = r.float()
        rel.append(((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-6)).item())
    return max(rel) if all(x == x for x in rel) else float("nan")


def max_abs_diff(out, ref) -> float | None:
    """max |out - ref| in float32 (NaN propagates, and is flagged WRONG)."""
    if ref is None:
        return None
    diff = (out.float() - ref.float()).abs()
    if diff.isnan().any():
        return float("nan")
    return diff.max().item()


def _free(device: str) -> None:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _warning_reason(caught: list) -> str:
    """Why a fused SDPA kernel was skipped: torch explains it in UserWarnings only."""
    texts = [" ".join(str(w.message).split()) for w in caught]
    return "; ".join(t for t in texts if t)[:300]


def bench_provider(provider: Provider, cell: BenchConfig, inputs, ref, timer,
                   device: str = "cuda", ref_grads=None) -> dict:
    """Sanity-check then time one provider on one cell; every failure becomes a record.

    `timer(fn) -> ms`. Forward times `forward(q, k, v)`; backward runs the forward once
    and times `torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)` alone.
    """
    import torch

    if provider.unavailable:
        return make_record(cell, provider.name, "unavailable", reason=provider.unavailable)
    q, k, v, dout = inputs
    diff = gdiff = None
    out = fn = None
    try:
        with provider.context():
            with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    out = provider.forward(q, k, v, cell.causal)
                except Unavailable as exc:
                    detail = _warning_reason(caught)
                    raise Unavailable(f"{exc} ({detail})" if detail else str(exc)) from exc
            diff = max_abs_diff(out, ref)
            out = None
            fn = _timed_callable(provider, cell, q, k, v, dout)
            first = fn()  # first call compiles / raises here, outside the timed region
            if cell.direction == "bwd":
                gdiff = grad_rel_diff(first, ref_grads)
            first = None
            ms = timer(fn)
        return make_record(cell, provider.name, "ok", ms=ms, max_abs_diff=diff, grad_rel_diff=gdiff)
    except Exception as exc:
        status, reason = classify_error(exc)
        return make_record(cell, provider.name, status, max_abs_diff=diff, reason=reason,
                           grad_rel_diff=gdiff)
    finally:
        del out, fn
        _free(device)


def _timed_callable(provider: Provider, cell: BenchConfig, q, k, v, dout) -> Callable:
    import torch

    if cell.direction == "fwd":
        return lambda: provider.forward(q, k, v, cell.causal)
    out = provider.forward(q, k, v, cell.causal)
    if out.grad_fn is None:
        raise NotImplementedError("forward output has no grad_fn (no backward pass)")
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def run_cell(cell: BenchConfig, providers: Sequence[Provider], dtype, timer,
             device: str = "cuda", reference_provider: Provider | None = None) -> list[dict]:
    """All providers on one cell, on the same fresh inputs; records carry the name of
    the reference used for the sanity check."""
    inputs = make_inputs(cell, dtype, device)
    ref, ref_name = reference_output(*inputs[:3], cell.causal, reference_provider)
    ref_grads = None
    if cell.direction == "bwd":
        ref_grads = reference_grads(*inputs, cell.causal, reference_provider)
    try:
        records = [bench_provider(p, cell, inputs, ref, timer, device, ref_grads) for p in providers]
    finally:
        del ref, ref_grads, inputs
        _free(device)
    for r in records:
        r["reference"] = ref_name
    return records


def cuda_healthy(device: str = "cuda") -> bool:
    """False after a sticky CUDA error (illegal address, ...): every later cell would
    fail too, so the run stops and keeps what it measured."""
    import torch

    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def make_timer(warmup: int, rep: int) -> Callable[[Callable], float]:
    """triton's do_bench (CUDA events, L2 flush between runs), median of the runs in ms."""
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def interleaved_times(fns: dict, rounds: int, timer: Callable[[Callable], float]) -> dict:
    """{name: (median, min, max)} of `timer(fn)` (ms) over `rounds` rounds that each time
    every callable once, in turn: a slow drift of the clocks or the host then reaches every
    entry alike instead of whichever ran last, and min/max show what one round can move
    (the ablation scripts in bench/ print it next to each A/B)."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timer(fn))
    return {name: _median_min_max(t) for name, t in times.items()}


def spread_pct(stats: tuple) -> str:
    """(median, min, max) as the spread of the rounds, in % of the median."""
    median, lo, hi = stats
    return f"{100 * (hi - lo) / median:.1f}%"


def ablation_rows(cell: tuple, fns: dict, errs: dict, flops: float, rounds: int,
                  timer: Callable[[Callable], float]) -> list:
    """One cell of an ablation script (bench/): each entry of `fns` (None: skipped) timed in
    interleaved rounds, as rows (*cell, name, TFLOP/s of the median, spread, error note),
    printed as they come."""
    stats = interleaved_times({n: f for n, f in fns.items() if f is not None}, rounds, timer)
    rows = []
    for name, st in stats.items():
        rows.append((*cell, name, flops / st[0] / 1e9, spread_pct(st), errs.get(name, "")))
        print(rows[-1], flush=True)
    return rows


def ablation_table(rows: list, metric: str, err_label: str) -> str:
    """The Markdown table of `ablation_rows` rows over (hdim, seqlen, causal) cells."""
    header = ["hdim", "seqlen", "causal", "provider", metric, "round spread", err_label]
    return markdown_table(header, [[*map(str, r[:4]), f"{r[4]:.1f}", r[5], r[6]]
                                   for r in rows])


def tree_ab_table(runs: Sequence[tuple[str, Sequence[dict]]]) -> str:
    """The Markdown table of an A/B of source trees (`bench/ab_trees.py`): `runs` holds one
    (tree name, bench.json results) per process, rounds interleaved. Per cell: each tree's
    median flash_cute TFLOP/s with its rounds' spread (`spread_pct`), each tree against the
    first, and the peers' medians over every process."""
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


def _median_min_max(times: Sequence[float]) -> tuple:
    t = sorted(times)
    return t[len(t) // 2], t[0], t[-1]


# -------------------------------------------------------------------------- CLI

def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _provider_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown provider(s) {unknown or text!r}; choose from {','.join(PROVIDERS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `bench` options to `parser` (the `bench` subparser of the CLI), with those of
    `bench latency` (`flash_cute.tools.bench_latency`, which `flash_cute.__main__` runs)."""
    parser.add_argument("what", nargs="?", choices=("throughput", "latency", "decode"),
                        default="throughput",
                        help="throughput: TFLOP/s over the grid (default); latency: host time "
                             "per call of a tiny problem (flash_cute.tools.bench_latency); decode: "
                             "GB/s of KV-cache decode (flash_cute.tools.bench_decode)")
    parser.add_argument("--quick", action="store_true",
                        help=f"small grid: hdim {QUICK_HDIMS}, (batch, seqlen) {QUICK_SIZES}")
    parser.add_argument("--hdim", type=_int_list, default=None,
                        help="only these head dims, comma-separated (e.g. 64,128)")
    parser.add_argument("--seqlen", type=_int_list, default=None,
                        help="only these sequence lengths, comma-separated")
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both")
    parser.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both")
    parser.add_argument("--providers", type=_provider_list, default=list(PROVIDERS),
                        help=f"comma-separated subset of {','.join(PROVIDERS)}")
    parser.add_argument("--arch", choices=ARCHS, default="auto",
                        help="pipeline passed to flash_cute kernels (auto: library default)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--out", default=None,
                        help="output directory (default results/bench-<timestamp>)")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    latency = parser.add_argument_group("latency")
    latency.add_argument("--calls", type=int, default=100,
                         help="calls per timed loop (a fwd+bwd step queues ~5 kernels each: "
                              "keep calls x kernels under CUDA's ~1000 queued launches)")
    latency.add_argument("--rounds", type=int, default=7, help="rounds per provider and case")
    latency.add_argument("--cases", default="fwd,fwd_bwd", help="fwd, fwd_bwd")
    latency.add_argument("--json", default=None, help="write the records here")
    decode = parser.add_argument_group("decode")
    decode.add_argument("--pages", type=_int_list, default=None,
                        help="page sizes to run, 0 for the dense cache (default 0,16,64,256)")
    return parser


def selected_configs(args: argparse.Namespace) -> list[BenchConfig]:
    """The grid cells selected by --quick and the filters."""
    return filter_grid(make_grid(args.quick), args.hdim, args.seqlen,
                       args.causal, args.direction)


def settings_of(args: argparse.Namespace) -> dict:
    """The run options recorded in the JSON."""
    return {k: getattr(args, k) for k in ("quick", "hdim", "seqlen", "causal", "direction",
                                          "providers", "arch", "dtype", "warmup", "rep")}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark. Exit code: 0 done; 1 some cell errored, was WRONG, or the run
    stopped on a CUDA error; 2 nothing to run (no CUDA, empty selection, no triton)."""
    configs = selected_configs(args)
    if not configs:
        print(f"bench: no cells match the filters (hdims {HDIMS}, seqlens "
              f"{[s for _, s in SIZES]}; --quick uses {QUICK_HDIMS} and "
              f"{[s for _, s in QUICK_SIZES]})", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(CUDA_MESSAGE, file=sys.stderr)
        return 2
    try:
        timer = make_timer(args.warmup, args.rep)
    except ImportError as exc:
        print(f"bench needs triton for do_bench: {exc}", file=sys.stderr)
        return 2
    return _run_on_gpu(args, configs, timer)


def _run_on_gpu(args: argparse.Namespace, configs: list[BenchConfig], timer,
                device: str = "cuda") -> int:
    """The measuring loop; `device` is a parameter only so tests can drive it on the CPU."""
    import torch

    out_dir = args.out or os.path.join("results", f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "bench.json")
    env = environment_info(device)
    env.update(dtype=args.dtype, arch=args.arch)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    providers = [load_provider(name, args.arch) for name in args.providers]
    # The sanity-check reference is sdpa_flash even when it is not benchmarked.
    reference = next((p for p in providers if p.name == "sdpa_flash"), None)
    reference = reference or load_provider("sdpa_flash")
    torch.manual_seed(0)
    print(format_header(env), file=sys.stderr)
    results: list[dict] = []
    aborted = False
    write_json(build_report(results, env, settings_of(args)), json_path)
    try:
        for i, cell in enumerate(configs, 1):
            records = run_cell(cell, providers, dtype, timer, device, reference)
            results += records
            print(f"[{i}/{len(configs)}] {cell.label()}: " + ", ".join(
                f"{r['provider']} {format_cell(r)}" for r in records), file=sys.stderr,
                flush=True)
            write_json(build_report(results, env, settings_of(args)), json_path)
            if not cuda_healthy(device):
                print("bench: CUDA context is broken (sticky error); stopping early",
                      file=sys.stderr)
                aborted = True
                break
    except KeyboardInterrupt:
        # Ctrl-C still yields the table and plot of the cells measured so far.
        print("bench: interrupted; reporting the cells done so far", file=sys.stderr)
        aborted = True
    return _finish(results, args, env, out_dir, json_path, aborted)


def _finish(results, args, env, out_dir, json_path, aborted) -> int:
    """Print and save the table, draw the plot, print the paths; return the exit code."""
    table = format_table(results, args.providers, env)
    print(table)
    table_path = os.path.join(out_dir, "bench.md")
    with open(table_path, "w") as f:
        f.write(table + "\n")
    print(f"\njson:  {json_path}\ntable: {table_path}")
    if not args.no_plot:
        try:
            png = plot_results(results, os.path.join(out_dir, "bench.png"),
                               title=f"{env.get('gpu')} {args.dtype}")
            print(f"plot:  {png}")
        except ImportError as exc:
            print(f"plot skipped (matplotlib missing: {exc})", file=sys.stderr)
    bad = any(r["status"] == "error" or r["wrong"] for r in results)
    return 1 if bad or aborted else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (`python -m flash_cute.tools.bench`), same options as the CLI."""
    parser = add_arguments(argparse.ArgumentParser(prog="flash_cute bench",
                                                   description=__doc__.splitlines()[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
