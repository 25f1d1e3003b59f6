#!/usr/bin/env bash
# One device call's worth of GPU work: the gpu-marked tests, `check`, and a benchmark.
# Usage (on the GPU host, from the repo root, after `source .gpu-host/setup.sh`):
#   bash bench/h200_run.sh [pytest -k expression] [bench args...]
# Logs go to $OUT (or ./results/h200-<date>) so they come back from the device machine.
set -uo pipefail
out="${OUT:-results/h200-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
kexpr="${1:-}"
shift || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
python3 -m pytest -m gpu -q -x ${kexpr:+-k "$kexpr"} 2>&1 | tee "$out/pytest-gpu.log" | tail -25
python3 -m flash_cute check --no-bench 2>&1 | tee "$out/check.log"
if [ "$#" -gt 0 ]; then
  python3 -m flash_cute bench "$@" --out "$out/bench" 2>&1 | tee "$out/bench.log" | tail -60
fi
