"""Compare two `python -m flash_cute inspect --json` outputs, config by config.

A structural change (a refactor, a rename) must leave every kernel's machine code as it was:
this names each (kernel, target, config) whose registers, shared memory, spill bytes, register
budgets per role or SASS opcode counts differ, and each config found on one side only.

    python -m flash_cute inspect --json > before.json      # on the old tree
    python -m flash_cute inspect --json > after.json       # on the new tree
    python bench/sass_diff.py before.json after.json [--rename old=new ...]

`--rename` maps a config key (or a kernel name) of the old output to its new name, for a
change that renames a schedule field. Exit status: 0 when everything matches, 1 otherwise.
"""

import argparse
import json
import sys

COMPARED = ("registers", "smem_bytes", "spill_bytes", "registers_per_role", "sass", "error")


def _target(entry: dict) -> str:
    # Older outputs call the SM target "arch".
    return entry.get("target", entry.get("arch"))


def entry_key(entry: dict, renames: dict) -> tuple:
    config = {renames.get(k, k): v for k, v in entry["config"].items()}
    kernel = renames.get(entry["kernel"], entry["kernel"])
    return kernel, _target(entry), json.dumps(config, sort_keys=True)


def index(entries: list, renames: dict) -> dict:
    """Entries by key; a config registered twice must have compiled the same both times."""
    out = {}
    for e in entries:
        key = entry_key(e, renames)
        if key in out:
            if any(out[key].get(f) != e.get(f) for f in COMPARED):
                raise ValueError(f"config listed twice with different results: {key}")
            print(f"note: listed twice (identical): {' '.join(map(str, key))}")
        out[key] = e
    return out


def differences(before: dict, after: dict) -> list:
    """(key, field, old, new) per differing field; SASS per opcode."""
    rows = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if old is None or new is None:
            rows.append((key, "present", old is not None, new is not None))
            continue
        for field in COMPARED:
            a, b = old.get(field), new.get(field)
            if field == "sass" and a is not None and b is not None:
                for op in sorted(set(a) | set(b)):
                    if a.get(op, 0) != b.get(op, 0):
                        rows.append((key, f"sass.{op}", a.get(op, 0), b.get(op, 0)))
            elif a != b:
                rows.append((key, field, a, b))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                        help="a config key or kernel name of BEFORE that AFTER calls NEW")
    args = parser.parse_args(argv)
    renames = dict(r.split("=", 1) for r in args.rename)
    with open(args.before) as f:
        before = index(json.load(f), renames)
    with open(args.after) as f:
        after = index(json.load(f), {})
    rows = differences(before, after)
    for (kernel, target, config), field, old, new in rows:
        print(f"{kernel} {target} {config}: {field} {old} -> {new}")
    same = len(set(before) & set(after)) - len({r[0] for r in rows if r[1] != "present"})
    print(f"{same} configs identical, {len({r[0] for r in rows})} differ or are missing "
          f"({len(before)} before, {len(after)} after)")
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main())
