#!/usr/bin/env bash
# The GPU run's remaining points that need no new code, in one device call:
#   bash bench/wave_session.sh [suite|fp8tiles|decode|timeline|fa4|check ...]
#                                                           (default: decode timeline)
#   suite:    the whole GPU suite but the ring's (pytest -m gpu, 14 workers);
#   fp8tiles: the FP8 forward's key-tile ablation (bench/fp8_tiles.py);
#   decode:   the two-CTA decode schedule's GPU test and its ablation against the default
#             (bench/decode_ablation.py, base (the pair) and one interleaved, 1 x 8k and 1 x 32k);
#   timeline: the hopper forward's and backward's measured warp-role timelines at hdim 128,
#             8k tokens, causal and not (python -m flash_cute profile);
#   fa4:      FA4's own tests through the shim (bench/fa4_tests.sh) from $FA4_TESTS
#             (default .gpu-host/fa4tests): the fast file, test_score_mod, test_mask_mod;
#   ring:     context parallelism with the kernels, ranks sharing the GPU over gloo
#             (tests/test_parallel_gpu.py, world sizes 2 and 4);
#   check:    the install check a user runs first (python -m flash_cute check).
# Run after `source .gpu-host/setup.sh`; logs go to $OUT (or results/wave-<date>).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/session_common.sh"
session_start wave
parts="${*:-decode timeline}"
status=0
for part in $parts; do
  case "$part" in
    suite)
      timeout "${SUITE_TIMEOUT:-420}" python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider tests/ \
        --ignore=tests/test_parallel_gpu.py 2>&1 | tee "$out/suite.log" | tail -25 || status=1 ;;
    fp8tiles)
      timeout "${FP8TILES_TIMEOUT:-170}" python3 "$here/fp8_tiles.py" --rounds 3 2>&1 \
        | tee "$out/fp8_tiles.log" | tail -20 || status=1 ;;
    check)
      timeout 120 python3 -m flash_cute check 2>&1 | tee "$out/check.log" | tail -30 || status=1 ;;
    decode)
      timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py \
        -k two_cta 2>&1 | tee "$out/decode_test.log" | tail -3 || status=1
      timeout 300 python3 bench/decode_ablation.py --cells 1x8192,1x32768 --pages 0,64 --variants base,one \
        --rounds 5 2>&1 | tee "$out/decode_ablation.log" | tail -20 || status=1 ;;
    timeline)
      for extra in "" "--causal" "--backward" "--backward --causal"; do
        name="fwd"; [[ $extra == *backward* ]] && name="bwd"
        [[ $extra == *causal* ]] && name="$name-causal"
        timeout 200 python3 -m flash_cute profile --seqlen 8192 $extra \
          --out "$out/profile/$name" 2>&1 | tee "$out/profile-$name.log" | tail -8 || status=1
      done ;;
    fa4)
      tests="${FA4_TESTS:-.gpu-host/fa4tests}"
      workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 5" || echo "")
      for f in test_flash_attn_fast.py test_score_mod.py test_mask_mod.py; do
        timeout "${FA4_TIMEOUT:-170}" bash "$here/fa4_tests.sh" "$tests/$f" -q $workers \
          --maxfail=30 2>&1 | tee "$out/fa4-$f.log" | tail -6
      done ;;
    ring)
      timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_parallel_gpu.py \
        2>&1 | tee "$out/ring.log" | tail -5 || status=1 ;;
    *) echo "unknown part: $part"; status=2 ;;
  esac
done
exit $status
