#!/usr/bin/env bash
# One device call for dropout (issue 22): its GPU tests, then bench/dropout.py.
# Usage (GPU host, repo root): bash bench/dropout_session.sh [pytest -k expr] [bench args...]
set -uo pipefail
source "$(dirname "$0")/session_common.sh"
session_start dropout
kexpr="${1:-}"
shift || true
timeout 330 python3 -m pytest -m gpu -q -n 8 tests/test_dropout_gpu.py ${kexpr:+-k "$kexpr"} \
  > "$out/dropout-tests.log" 2>&1
tail -30 "$out/dropout-tests.log"
timeout 230 python3 bench/dropout.py "$@" > "$out/bench-dropout.log" 2>&1
tail -40 "$out/bench-dropout.log"
