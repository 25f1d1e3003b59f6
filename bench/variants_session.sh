#!/usr/bin/env bash
# One device call for the variants work (issue 24): the mods GPU tests, the length sweep (one
# process per case, in parallel: each compiles its own kernels), then `bench/variants.py`
# with FlexAttention and FA4 beside us.
# Usage (GPU host, repo root, after `source .gpu-host/setup.sh`):
#   bash bench/variants_session.sh [pytest -k expression] [--no-sweep] [--no-bench] [--suite]
# --suite: the whole GPU suite (`pytest -m gpu tests/`, about 200 s at -n 14) in place of the
# mods tests.
set -uo pipefail
source "$(dirname "$0")/session_common.sh"
session_start variants
kexpr="${1:-}"
shift || true
tests="tests/test_mods_gpu.py tests/test_sink.py"
workers=8
case " $* " in *" --suite "*) tests="tests/"; workers=14 ;; esac
timeout 300 python3 -m pytest -m gpu -q -n $workers -p no:cacheprovider $tests \
  ${kexpr:+-k "$kexpr"} --tb=short 2>&1 | grep -v Warn | tee "$out/pytest-mods.log" | tail -30
case " $* " in
  *" --no-sweep "*) ;;
  *) for c in causal alibi document sliding softcap; do
       timeout 220 python3 bench/variants.py --sweep --cases "$c" > "$out/sweep-$c.log" 2>&1 &
     done
     wait
     grep -h "^\[" "$out"/sweep-*.log ;;
esac
case " $* " in
  *" --no-bench "*) ;;
  *) timeout 420 python3 bench/variants.py --rounds 3 2>&1 | grep -v Warn \
       | tee "$out/variants.log" | tail -40 ;;
esac
