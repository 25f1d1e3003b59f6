"""`python -m flash_cute inspect`: cross-compile registered kernels and report what they became.

Needs no GPU. One entry per (kernel, config, target): registers, shared memory, local-memory
(spill) bytes and SASS opcode counts, as a table or as JSON (`--json`).
"""

import json
import sys

from flash_cute.registry import TARGETS, registered_configs

_TABLE_OPS = ("HMMA", "HGMMA", "UTCHMMA", "UTMALDG", "MUFU.EX2", "FFMA", "LDL", "STL")


def add_arguments(parser):
    parser.add_argument("--target", default=",".join(TARGETS),
                        help=f"comma-separated SM targets (default: {','.join(TARGETS)})")
    parser.add_argument("--kernel", default=None,
                        help="kernel name (e.g. ampere.fwd) or prefix (e.g. hopper)")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="keep the PTX, cubin and SASS under DIR")
    parser.add_argument("--jobs", type=int, default=None, help="compile workers (one per target)")


def _public(entry: dict) -> dict:
    keys = ("kernel", "target", "config", "registers", "smem_bytes", "spill_bytes", "sass",
            "registers_per_role", "artifacts", "error")
    return {k: entry[k] for k in keys if k in entry}


def format_table(entries: list) -> str:
    head = ["kernel", "target", "config", "regs", "smem", "spill"] + list(_TABLE_OPS)
    rows = [head]
    for e in entries:
        config = e["config"]
        flags = [k for k, v in config.items() if v is True]
        label = " ".join([config["dtype"], f"d{config['hdim']}/{config['hdim_v']}",
                          "x".join(map(str, config["schedule"]))] + flags)
        if "error" in e:
            rows.append([e["kernel"], e["target"], label, "ERROR: " + e["error"].splitlines()[0]])
            continue
        ops = [str(e["sass"].get(op, 0)) for op in _TABLE_OPS]
        rows.append([e["kernel"], e["target"], label, str(e["registers"]), str(e["smem_bytes"]),
                     str(e["spill_bytes"])] + ops)
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run(args) -> int:
    from flash_cute.xcompile import cross_compile

    targets = [a.strip() for a in args.target.split(",") if a.strip()]
    unknown = [a for a in targets if a not in TARGETS]
    if unknown:
        print(f"unknown target {unknown}; choose from {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    configs = [c for c in registered_configs(kernel=args.kernel)
               if set(c.targets) & set(targets)]
    if not configs:
        print(f"no registered kernel matches --kernel {args.kernel!r} on {targets}",
              file=sys.stderr)
        return 2
    entries = [_public(e) for e in cross_compile(configs, targets, out_dir=args.keep,
                                                 jobs=args.jobs)]
    if not args.keep:
        for e in entries:
            e.pop("artifacts", None)
    if args.json:
        print(json.dumps(entries, indent=1))
    else:
        print(format_table(entries))
    return 1 if any("error" in e for e in entries) else 0
