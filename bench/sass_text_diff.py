"""Compare the SASS text of two `inspect --all --json --keep DIR` runs, config by config.

    (cd OLD_TREE && python -m flash_cute inspect --all --json --keep OLD > old.json)
    python -m flash_cute inspect --all --json --keep NEW > new.json
    python bench/sass_text_diff.py old.json new.json

Configs are paired by (kernel, target, config) from the JSON, and each side's SASS file is
the one its artifacts name (the file stems carry the registry index, which may differ). The
kernels' mangled symbol names spell the Python module path of the kernel class
(`flash_cutearchhopperfwdHopperFwd...`), so a moved module renames them: every symbol token
(a name holding "cutlass" or "flash_cute", in section names, labels, `.global` lines and CALL
targets alike) is replaced by SYM<n>, numbered in order of first appearance. Everything else
must be equal byte for byte. Exit status 0 when every paired config is identical and none is
on one side only.
"""

import argparse
import json
import re
import sys

_SYMBOL = re.compile(r"[A-Za-z_.$][\w.$]*(?:cutlass|flash_cute)[\w.$]*")


def normalised(text: str) -> str:
    names = {}

    def rename(match):
        return names.setdefault(match.group(0), f"SYM{len(names)}")

    return _SYMBOL.sub(rename, text)


def _index(entries: list) -> dict:
    out = {}
    for e in entries:
        if "artifacts" not in e:
            continue
        out[(e["kernel"], e["target"], json.dumps(e["config"], sort_keys=True))] = \
            e["artifacts"]["sass"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    args = ap.parse_args(argv)
    old, new = (_index(json.load(open(p))) for p in (args.old, args.new))
    only = sorted(old.keys() ^ new.keys())
    differ = []
    for key in sorted(old.keys() & new.keys()):
        a, b = (normalised(open(p).read()) for p in (old[key], new[key]))
        if a != b:
            differ.append(key)
    print(f"{len(old.keys() & new.keys())} configs paired, {len(differ)} differ, "
          f"{len(only)} on one side only")
    for key in differ[:20]:
        print("  differs:", *key)
    for key in only[:20]:
        print("  one side:", *key)
    return 1 if differ or only else 0


if __name__ == "__main__":
    sys.exit(main())
