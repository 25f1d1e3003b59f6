#!/usr/bin/env bash
# The FP8 forward on the GPU, in one device call: its accuracy against float64 beside the
# emulation's (bench/fp8_kernel.py), the FP8 GPU tests and the hopper forward's (the FP8
# kernel's hooks must leave it as it was), then the speed table (python -m flash_cute bench
# fp8).
# Run after `source .gpu-host/setup.sh`; logs go to $OUT (or results/fp8-<date>).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/session_common.sh"
session_start fp8
status=0
timeout 280 python3 "$here/fp8_kernel.py" --json "$out/fp8_accuracy.json" 2>&1 \
  | tee "$out/fp8_accuracy.log" | tail -40 || status=1
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_gpu.py \
  tests/test_hopper_fwd_gpu.py \
  2>&1 | tee "$out/hopper_fwd.log" | tail -5 || status=1
timeout 170 python3 -m flash_cute bench fp8 --rounds 3 --out "$out/bench-fp8" 2>&1 \
  | tee "$out/fp8_speed.log" | tail -20 || status=1
exit $status
