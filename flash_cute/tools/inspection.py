"""`python -m flash_cute inspect`: cross-compile registered kernels and report what they became.

Needs no GPU. With no selection it compiles one representative forward kernel per SM target
(in parallel, each target in a worker process) and prints a per-target comparison (registers
per role, shared memory, the instructions that make each pipeline what it is, spills) and
saves it as a PNG; `--all` or `--kernel` select from the whole registry (`--list` names its
kernels), printed as one row per (kernel, config, target) or as JSON (`--json`). Results come
from the disk cache (`flash_cute.runtime.disk_cache`) when this build compiled them before.
"""

import importlib.metadata
import json
import os
import shutil
import sys
import textwrap
from collections import Counter

from flash_cute.tools.registry import TARGETS, registered_configs

# The representative kernels of each target: its own pipeline's forward and, where it exists,
# backward, bf16, hdim 128, causal (the blackwell forward with its default software exp2
# share; blackwell's are compile-verified only).
REPRESENTATIVE = {"sm_80": ("ampere.fwd", "ampere.bwd"), "sm_90a": ("hopper.fwd", "hopper.bwd"),
                  "sm_100a": ("blackwell.fwd", "blackwell.bwd")}
_REPRESENTATIVE_FLAGS = {"causal": True, "local": False, "softcap": False, "varlen": False}
_REPRESENTATIVE_NUMBERS = {"blackwell.fwd": {"ex2_emu": 2}}
# Per-target limits the resources are shown against: registers a thread, shared memory a CTA.
LIMITS = {"sm_80": (255, 163 * 1024), "sm_90a": (255, 227 * 1024), "sm_100a": (255, 227 * 1024)}
# Opcode families by what they say about a pipeline: its MMA, its data movement, its softmax.
_FAMILIES = (("MMA", ("HMMA", "HGMMA", "QGMMA", "UTCHMMA", "UTCQMMA")),
             ("async copy", ("LDGSTS", "UTMALDG", "UBLKCP", "UTMASTG")),
             ("TMEM", ("LDTM", "STTM", "UTCBAR")),
             ("MUFU.EX2", ("MUFU.EX2",)),
             ("FFMA", ("FFMA",)))
_TABLE_OPS = ("HMMA", "HGMMA", "QGMMA", "UTCHMMA", "2CTA", "LDGSTS", "UTMALDG", "MUFU.EX2", "FFMA")
_TABLE_HEADS = {"MUFU.EX2": "EX2"}
# The pair's forms (cta_group::2) in one column: its MMAs / its TMEM allocations.
_PAIR_FORMS = ("UTCHMMA.2CTA", "UTCATOMSWS.2CTA.FIND_AND_SET")


def _cell(sass: dict, op: str) -> str:
    if op == "2CTA":
        mma, alloc = (sass.get(form, 0) for form in _PAIR_FORMS)
        return f"{mma}/{alloc}" if mma or alloc else "0"
    return str(sass.get(op, 0))


def add_arguments(parser):
    parser.add_argument("--target", "--arch", dest="target", default=",".join(TARGETS),
                        help=f"comma-separated SM targets (default: {','.join(TARGETS)})")
    parser.add_argument("--kernel", default=None,
                        help="kernel name (e.g. ampere.fwd) or prefix (e.g. hopper)")
    parser.add_argument("--all", action="store_true", help="every registered config")
    parser.add_argument("--list", action="store_true", help="list the registered kernels")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="keep the PTX, cubin and SASS under DIR")
    parser.add_argument("--plot", default="flash-cute-inspect.png", metavar="PNG",
                        help="where the comparison's plot goes (default: %(default)s; "
                             "'' for none)")
    parser.add_argument("--jobs", type=int, default=None, help="compile workers (one per target)")
    parser.add_argument("--report", default=None, metavar="DIR",
                        help="write the pipelines' comparison as DIR/report.html (PNGs "
                             "embedded, and beside it)")


def _public(entry: dict) -> dict:
    keys = ("kernel", "target", "config", "registers", "smem_bytes", "spill_bytes", "sass",
            "registers_per_role", "pipeline", "artifacts", "error")
    return {k: entry[k] for k in keys if k in entry}


def nvdisasm_found() -> bool:
    """Whether SASS can be written: the nvidia-cuda-nvdisasm wheel, or nvdisasm on PATH or
    under CUDA_HOME (what CuTe DSL looks for)."""
    try:
        importlib.metadata.distribution("nvidia-cuda-nvdisasm")
        return True
    except importlib.metadata.PackageNotFoundError:
        pass
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or ""
    return bool(shutil.which("nvdisasm")
                or os.path.isfile(os.path.join(cuda_home, "bin", "nvdisasm")))


def config_label(config: dict) -> str:
    """What tells a config apart: dtype, head dims, schedule numbers, then every switch that is
    on and every number a config sets (``pack_gqa=4``, ``do_stages=1``)."""
    parts = [config["dtype"], f"d{config['hdim'] or '-'}/{config['hdim_v']}",
             "x".join(map(str, config["schedule"]))]
    for key in sorted(config):
        value = config[key]
        if key in ("dtype", "hdim", "hdim_v", "schedule") or value is False or value is None:
            continue
        parts.append(key if value is True else f"{key}={value}")
    return " ".join(parts)


def _error_line(entry: dict) -> str:
    first = entry["error"].strip().splitlines()[0] if entry["error"].strip() else "error"
    return "ERROR: " + first[:60]


def format_table(entries: list) -> str:
    """One row per (kernel, config, target), at most 100 columns: the config label wraps onto
    its own line above its numbers; "2CTA" is the pair's MMAs / its TMEM allocations
    (cta_group::2)."""
    ops_head = [_TABLE_HEADS.get(op, op) for op in _TABLE_OPS]
    head = ["target", "regs", "smem", "spill"] + ops_head
    lines = []
    widths = [7, 4, 6, 5] + [max(5, len(h)) for h in ops_head]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    lines.append(fmt(head))
    last = None
    for e in entries:
        title = f"{e['kernel']}  {config_label(e['config'])}"
        if title != last:
            lines += textwrap.wrap(title, 100, subsequent_indent="    ")
            last = title
        if "error" in e:
            lines.append(f"{e['target']:>7}  {_error_line(e)}")
            continue
        ops = [_cell(e["sass"], op) for op in _TABLE_OPS]
        lines.append(fmt([e["target"], str(e["registers"]), str(e["smem_bytes"]),
                          str(e["spill_bytes"])] + ops))
    return "\n".join(lines)


def _family_counts(sass: dict) -> dict:
    """Opcode counts by family; an opcode counts toward a family by its leading name
    (``HGMMA.64x128x16.F32.BF16`` is HGMMA)."""
    return Counter({family: sum(n for _, n in _by_name(sass, names))
                    for family, names in _FAMILIES})


def _by_name(sass: dict, names) -> list:
    """(name, count) of each opcode name, its variants summed (``HGMMA.64x128x16.F32.BF16``
    counts as HGMMA)."""
    return [(name, sum(n for op, n in sass.items() if op == name or op.startswith(name + ".")))
            for name in names]


def _roles(entry: dict) -> str:
    """The declared warp roles, short: idle ones left out, repeats counted (``cons×2``)."""
    pipe = entry.get("pipeline")
    if pipe is None:
        return "-"
    names = [r["name"][:4] for r in pipe["roles"] if r["name"] != "idle"]
    out = []
    for name in dict.fromkeys(names):
        count = names.count(name)
        out.append(name if count == 1 else f"{name}×{count}")
    return " ".join(out)


def _registers(entry: dict) -> str:
    """setmaxnreg budgets per warpgroup (declared), or the launch count every warp keeps."""
    pipe = entry.get("pipeline")
    budgets = {} if pipe is None else {r["warpgroup"]: r["registers"] for r in pipe["roles"]
                                       if r["registers"] is not None}
    if not budgets:
        return f"{entry['registers']}, no setmaxnreg"
    return "/".join(str(budgets[wg]) for wg in sorted(budgets))


def _budgets(entry: dict) -> list:
    """The declared setmaxnreg budgets of an entry (empty without setmaxnreg)."""
    pipe = entry.get("pipeline") or {"roles": []}
    return [r["registers"] for r in pipe["roles"] if r["registers"] is not None]


def _residency(entry: dict, tensors=("S", "P", "O")) -> str:
    pipe = entry.get("pipeline")
    if pipe is None:
        return "-"
    from flash_cute.contract.pipeline import from_dict

    places = from_dict(pipe).residency()
    return " ".join(f"{t}:{''.join(m[:1] for m in places[t])}" for t in tensors if t in places)


def comparison(entries: list) -> str:
    """The story of the representative kernels: one column per kernel, at most 100 columns."""
    cols = [e for e in entries if "error" not in e]
    rows = [("pipeline", [f"{e['kernel']} ({e['target']})" for e in cols]),
            ("warp roles", [_roles(e) for e in cols]),
            ("regs / warpgroup", [_registers(e) for e in cols]),
            ("residency", [_residency(e, ("S", "P", "O") if e["kernel"].endswith(".fwd")
                                      else ("S", "P", "dS", "dQ")) for e in cols]),
            ("shared memory", [f"{e['smem_bytes'] / 1024:.0f} KiB" for e in cols]),
            ("spills", [f"{e['spill_bytes']} B" for e in cols])]
    for family, names in _FAMILIES:
        rows.append((family, [" ".join(f"{name} {n}" for name, n in _by_name(e["sass"], names)
                                        if n) or "-" for e in cols]))
    rows.append(("exp2 in software", [f"{e['config']['ex2_emu']}/16" if e["config"].get("ex2_emu")
                                      else "off" for e in cols]))
    width = max(len(name) for name, _ in rows)
    col = max([len(v) for _, values in rows for v in values] + [10])
    out = [f"{name:<{width}}  " + "  ".join(f"{v:<{col}}" for v in values)
           for name, values in rows]
    for e in entries:
        if "error" in e:
            out.append(f"{e['target']}: {_error_line(e)}")
    return "\n".join(line.rstrip() for line in out)


def plot(entries: list, path: str) -> bool:
    """Bars of the representative kernels' opcode families and resources, one group per
    target, into `path` (False when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cols = [e for e in entries if "error" not in e]
    families = [f for f, _ in _FAMILIES]
    fig, (ax_ops, ax_res) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(len(cols), 1)
    for i, e in enumerate(cols):
        counts = _family_counts(e["sass"])
        total = max(sum(e["sass"].values()), 1)
        label = f"{e['kernel']} ({e['target']})"
        xs = [j + i * width for j in range(len(families))]
        ax_ops.bar(xs, [100.0 * counts[f] / total for f in families], width, label=label)
        regs, smem = LIMITS.get(e["target"], (255, 227 * 1024))
        ax_res.bar([j + i * width for j in range(2)],
                   [100.0 * max(_budgets(e) or [e["registers"]]) / regs,
                    100.0 * e["smem_bytes"] / smem], width, label=label)
    ax_ops.set_xticks([j + 0.4 - width / 2 for j in range(len(families))], families)
    ax_ops.set_ylabel("% of the kernel's SASS instructions")
    ax_ops.set_title("instruction mix (static)")
    ax_res.set_xticks([0.4 - width / 2, 1.4 - width / 2],
                      ["registers of the largest role / 255", "shared memory / the CTA limit"])
    ax_res.set_ylabel("% of the target's limit")
    ax_res.set_ylim(0, 100)
    ax_res.set_title("resources against each target's limits")
    ax_ops.legend(fontsize=7)
    fig.suptitle("flash-cute: each pipeline's kernels (bf16, hdim 128, causal; "
                 "blackwell compile-verified only)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def representative_configs(targets) -> list:
    """The registry entries of `REPRESENTATIVE` for `targets`."""
    out = []
    for target in targets:
        for kernel in REPRESENTATIVE.get(target, ()):
            numbers = _REPRESENTATIVE_NUMBERS.get(kernel, {})
            found = [c for c in registered_configs(kernel=kernel, target=target)
                     if c.dtype == "bf16" and c.hdim == 128 and c.hdim_v == 128
                     and c.flag_dict == {**{k: False for k in c.flag_dict},
                                         **{k: v for k, v in _REPRESENTATIVE_FLAGS.items()
                                            if k in c.flag_dict}, **numbers}]
            if found and found[0] not in out:
                out.append(found[0])
    return out


def _progress(total: int):
    """A progress bar on stderr, and its per-result callback."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="cross-compiling", unit="kernel", file=sys.stderr,
               mininterval=0.2, leave=False)

    def advance(result):
        bar.set_postfix_str(f"{result.get('kernel')} {result.get('target')}"
                            + (" (cached)" if result.get("cached") else ""))
        bar.update(1)

    return bar, advance


def _list() -> int:
    counts = Counter((c.kernel, t) for c in registered_configs() for t in c.targets)
    kernels = sorted({k for k, _ in counts})
    for kernel in kernels:
        per = ", ".join(f"{t} {counts[(kernel, t)]}" for t in TARGETS if (kernel, t) in counts)
        print(f"{kernel:<28} {per}")
    return 0


def _select(args, targets):
    if args.kernel:
        configs = registered_configs(kernel=args.kernel)
        if not configs:
            names = sorted({c.kernel for c in registered_configs()})
            print(f"no registered kernel matches --kernel {args.kernel!r}; kernels: "
                  f"{', '.join(names)} (or a prefix such as 'hopper')", file=sys.stderr)
            return None
        return [c for c in configs if set(c.targets) & set(targets)]
    if args.all:
        return [c for c in registered_configs() if set(c.targets) & set(targets)]
    return representative_configs(targets)


def run(args) -> int:
    from flash_cute.tools.xcompile import cross_compile

    if args.list:
        return _list()
    targets = [a.strip() for a in args.target.split(",") if a.strip()]
    unknown = [a for a in targets if a not in TARGETS]
    if unknown:
        print(f"unknown target {unknown}; choose from {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    configs = _select(args, targets)
    if not configs:
        if configs is not None:
            print(f"no registered kernel compiles for {targets}", file=sys.stderr)
        return 2
    if not nvdisasm_found():
        print("no SASS without nvdisasm: pip install 'nvidia-cuda-nvdisasm>=13.4' (in the "
              "project's [dev] extra)", file=sys.stderr)
        return 2
    story = not (args.kernel or args.all or args.json) or bool(args.report)
    total = sum(len(set(c.targets) & set(targets)) for c in configs)
    bar, advance = _progress(total)
    with bar:
        entries = [_public(e) for e in cross_compile(configs, targets, out_dir=args.keep,
                                                     jobs=args.jobs, progress=advance)]
    if story:
        # A config compiles for every target it lists: keep each target's own pipeline.
        entries = [e for e in entries if e["kernel"] in REPRESENTATIVE.get(e["target"], ())]
    if args.report:
        from flash_cute.tools.report import write

        print(f"report: {write(entries, args.report)}")
    if not args.keep:
        for e in entries:
            e.pop("artifacts", None)
    if args.json:
        print(json.dumps(entries, indent=1))
    elif story:
        order = {t: i for i, t in enumerate(targets)}
        entries.sort(key=lambda e: (order[e["target"]], e["kernel"].endswith(".bwd")))
        for direction, title in ((".fwd", "forward"), (".bwd", "backward")):
            chosen = [e for e in entries if e["kernel"].endswith(direction)]
            if chosen:
                print(f"Each pipeline's {title} (bf16, hdim 128, causal"
                      f"{'; blackwell: compile-verified only' if direction == '.fwd' else ''}):")
                print(comparison(chosen))
        print("residency: R registers, S shared memory, T tensor memory, G global memory")
        if args.plot and plot(entries, args.plot):
            print(f"plot: {args.plot}")
        elif args.plot:
            print("no plot: matplotlib is not installed")
        print("Every registered config: python -m flash_cute inspect --all "
              "(--list names the kernels)")
    else:
        print(format_table(entries))
    return 1 if any("error" in e for e in entries) else 0
