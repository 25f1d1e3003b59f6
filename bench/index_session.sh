#!/usr/bin/env bash
# Index safety on the GPU, in one device call (the content check off):
#   bash bench/index_session.sh [CASES]          (default 200)
#   1. the index-safety GPU tests (the kernel's append drops and counts; the check raises
#      before the kernel writes) and the kvcache GPU tests;
#   2. bench/fuzz_index.py: CASES seeded calls with bad index contents, each against its
#      cache model and the status word;
#   3. the same fuzz's first 40 cases under compute-sanitizer memcheck (the paged reads and
#      the appends, torch path and kernel): 0 errors expected.
# Run after `source .gpu-host/setup.sh`; logs go to $OUT (or results/index-session-<date>).
set -uo pipefail
cases="${1:-200}"
out="${OUT:-results/index-session-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_index_safety.py \
  tests/test_kvcache.py 2>&1 | tee "$out/pytest.log" | tail -5 || status=1
timeout 300 python3 bench/fuzz_index.py --cases "$cases" --json "$out/fuzz_index.json" \
  2>&1 | tee "$out/fuzz_index.log" | tail -5 || status=1
timeout 400 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 \
  python3 bench/fuzz_index.py --cases 40 > "$out/memcheck.log" 2>&1
summary=$(grep -E "ERROR SUMMARY" "$out/memcheck.log" | tail -1)
echo "memcheck: ${summary:-no summary (see $out/memcheck.log)}"
echo "$summary" | grep -qE "ERROR SUMMARY: 0 " || status=1
exit $status
