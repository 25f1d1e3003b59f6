#!/usr/bin/env bash
# One device call of the hardening checks, run side by side (GPU):
#   bash bench/reliability.sh [MINUTES] [SEED]        (default: 6 minutes, seed 0)
# the gpu-marked tests, the seeded fuzz of both pipelines (hopper and ampere, one process per
# shard, starting no config after MINUTES) and bench/sanitize.sh, sharing one disk cache so
# that a kernel they all need compiles once. Timings from this run mean nothing (the GPU is
# shared); bench/ holds the timed runs. Logs and the fuzz's JSON go to $OUT (or
# results/reliability-<date>); the last lines summarise each part.
set -uo pipefail
minutes="${1:-6}"
seed="${2:-0}"
out="${OUT:-results/reliability-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
limit=$(python3 -c "print(int($minutes * 60 + 150))")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
timeout "$limit" python3 -m pytest -m gpu -q -n 6 -p no:cacheprovider tests/ \
  > "$out/pytest-gpu.log" 2>&1 &
timeout "$limit" python3 bench/fuzz.py --arch hopper --seed "$seed" --configs 4000 --workers 5 \
  --minutes "$minutes" --json "$out/fuzz-hopper.json" > "$out/fuzz-hopper.log" 2>&1 &
timeout "$limit" python3 bench/fuzz.py --arch ampere --seed "$seed" --configs 4000 --workers 4 \
  --minutes "$minutes" --json "$out/fuzz-ampere.json" > "$out/fuzz-ampere.log" 2>&1 &
OUT="$out/sanitize" timeout "$limit" bash bench/sanitize.sh > "$out/sanitize.log" 2>&1 &
wait
echo "== pytest";   tail -3 "$out/pytest-gpu.log"
echo "== fuzz";     grep -h -A1 "^fuzz" "$out"/fuzz-*.log
echo "== sanitize"; cat "$out/sanitize.log"
