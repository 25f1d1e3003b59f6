#!/usr/bin/env bash
# One device call for the split-KV / decode work: its GPU tests, then `bench decode`.
# Usage (GPU host, repo root, after `source .gpu-host/setup.sh`):
#   bash bench/decode_session.sh [pytest -k expression] [bench decode args...]
set -uo pipefail
out="${OUT:-results/decode-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLASH_CUTE_CACHE_DIR="${FLASH_CUTE_CACHE_DIR:-/tmp/fc-cache}"
kexpr="${1:-}"
shift || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -m pytest -m gpu -q -n 14 tests/test_split_gpu.py ${kexpr:+-k "$kexpr"} 2>&1 \
  | tee "$out/pytest-split.log" | tail -30
python3 -m flash_cute bench decode --out "$out/decode" "$@" 2>&1 | tee "$out/decode.log" | tail -40
