#!/usr/bin/env bash
# One device call that checks a structural change against an earlier tree, on the GPU host:
#   bash bench/tree_session.sh BASE_TREE [tests|overhead|ab]...   (default: all three)
# BASE_TREE holds flash_cute/ with its arch/ inside (e.g. `git archive` of the old commit,
# arch moved under flash_cute/). This tree is copied to the same layout, then:
#   tests     the whole GPU suite on this tree (pytest -m gpu -n 14)
#   overhead  bench/launch_overhead.py in each tree, interleaved, two rounds
#   ab        bench/ab_trees.py --quick, both trees interleaved, peers once
# Run after `source .gpu-host/setup.sh`; logs go to $OUT (or results/tree-session-<date>).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bash bench/tree_session.sh BASE_TREE [tests|overhead|ab]..."; exit 2; }
base="$(realpath "$1")"; shift
steps="${*:-tests overhead ab}"
out="${OUT:-results/tree-session-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
new="$scratch/new"
mkdir -p "$new" && cp -r flash_cute bench "$new/" && cp -r arch "$new/flash_cute/arch"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
for step in $steps; do
  case "$step" in
    tests)
      timeout 420 python3 -m pytest -m gpu -q -n 14 -p no:cacheprovider tests/ 2>&1 \
        | tee "$out/pytest-gpu.log" | tail -15 ;;
    overhead)
      for round in 1 2; do
        for tree in "$base" "$new"; do
          echo "== round $round: $tree" | tee -a "$out/overhead.log"
          (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 120 python3 bench/launch_overhead.py \
             --calls 500) 2>&1 | tee -a "$out/overhead.log" | tail -6
        done
      done ;;
    ab)
      timeout 540 python3 bench/ab_trees.py --tree base="$base" --tree new="$new" --rounds 2 \
        --peers-once -- --quick --providers flash_cute,fa4,sdpa_cudnn 2>&1 \
        | tee "$out/ab.log" | tail -40 ;;
  esac
done
