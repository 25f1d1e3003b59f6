"""Interleaved A/B of source trees of this project, for a change that is no schedule switch
(the ablation scripts compare switches inside one process):

    python bench/ab_trees.py --tree main=. --tree wip=.gpu-host/Q --rounds 3 -- \
        --direction bwd --hdim 64,128 --seqlen 2048,8192 --providers flash_cute,fa4

Each round runs `python -m flash_cute bench <args after -->` once per tree, in turn, in a
fresh process started in that tree (a tree holds flash_cute/ with its arch/ inside, as a
worktree with the arch link or a copied archive does): `python -m` puts the working
directory first on sys.path, ahead of PYTHONPATH and of an editable install, and each
process checks where its flash_cute.arch came from. Each tree gets a CuTe DSL file cache of
its own, which turns its later rounds' compiles into loads: the cache's key is the generated
IR, and a change of compile options alone (e.g. --opt-level) was seen to be served another
build. Prints each tree's median TFLOP/s per cell with its rounds' spread, each tree against
the first, and the peers (`bench.tree_ab_table`).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from flash_cute.tools.bench.report import tree_ab_table

_WHERE = "import os, flash_cute.arch as a; print(os.path.realpath(a.__file__))"


def run_tree(path: str, bench_args: list, out: str, cache: str) -> list:
    tree = os.path.realpath(path)
    env = {**os.environ, "CUTE_DSL_CACHE_DIR": cache}
    where = subprocess.run([sys.executable, "-c", _WHERE], cwd=tree, env=env, check=True,
                           capture_output=True, text=True).stdout.strip()
    if not where.startswith(tree + os.sep):
        raise SystemExit(f"in {tree}, flash_cute.arch comes from {where}: the tree needs "
                         "flash_cute/ with arch/ inside")
    subprocess.run([sys.executable, "-m", "flash_cute", "bench", *bench_args, "--no-plot",
                    "--out", out], cwd=tree, env=env, check=True)
    with open(os.path.join(out, "bench.json")) as f:
        return json.load(f)["results"]


def ours_only(bench_args: list) -> list:
    """`bench_args` with flash_cute as the only provider (the bench CLI keeps the last
    --providers)."""
    return [*bench_args, "--providers", "flash_cute"]


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peers-once", action="store_true",
                   help="time the peers in the first tree's processes only: they are the same "
                        "code in every tree, and each fresh process compiles FA4's kernels again")
    args = p.parse_args(argv[:split])
    trees = [t.split("=", 1) for t in args.tree]
    if any(len(t) != 2 for t in trees) or len({n for n, _ in trees}) != len(trees):
        p.error("each --tree is NAME=PATH, names distinct")
    bench_args = argv[split + 1:]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, (name, path) in enumerate(trees):
                out = os.path.join(tmp, f"{name}-{r}")
                cache = os.path.join(tmp, f"{name}-dsl-cache")
                tree_args = ours_only(bench_args) if args.peers_once and i else bench_args
                runs.append((name, run_tree(path, tree_args, out, cache)))
                print(f"round {r + 1}/{args.rounds}: {name} done", flush=True)
    print(tree_ab_table(runs))


if __name__ == "__main__":
    main()
