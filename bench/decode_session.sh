#!/usr/bin/env bash
# One device call for the decode work: its GPU tests, `bench decode`, and optionally the
# profile and the ablation of the decode plan.
# Usage (GPU host, repo root, after `source .gpu-host/setup.sh`):
#   bash bench/decode_session.sh [pytest -k expression] [--profile] [--ablation] [--no-bench]
set -uo pipefail
source "$(dirname "$0")/session_common.sh"
session_start decode
kexpr="${1:-}"
shift || true
python3 -m pytest -m gpu -q -n 14 -p no:cacheprovider tests/test_split_gpu.py \
  tests/test_kvcache.py ${kexpr:+-k "$kexpr"} 2>&1 | tee "$out/pytest-decode.log" | tail -30
for arg in "$@"; do
  case "$arg" in
    --profile) python3 bench/decode_profile.py --cells 1x8192,1x32768 --pages 0,16,64 \
                 --splits 0,32 2>&1 | grep -v Warn | tee "$out/profile.log" ;;
    --ablation) python3 bench/decode_ablation.py 2>&1 | grep -v Warn | tee "$out/ablation.log" ;;
  esac
done
case " $* " in
  *" --no-bench "*) ;;
  *) python3 -m flash_cute bench decode --out "$out/decode" 2>&1 | tee "$out/decode.log" \
       | tail -52 ;;
esac
