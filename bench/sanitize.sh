#!/usr/bin/env bash
# compute-sanitizer over one small case of every kernel family and variant (GPU):
#   bash bench/sanitize.sh [hopper|ampere]...        (default: both)
# The cases run once without the sanitizer first, so the kernels come from the disk cache and
# the sanitized runs do not compile. One summary line per tool and arch; logs under $OUT (or
# results/sanitize-<date>). Exit 1 if any tool reports an error.
set -uo pipefail
archs="${*:-hopper ampere}"
out="${OUT:-results/sanitize-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
status=0
for arch in $archs; do
  python3 bench/sanitize_cases.py --arch "$arch" > "$out/warm-$arch.log" 2>&1 || status=1
  for tool in memcheck racecheck synccheck initcheck; do
    extra="" cases=""
    [ "$tool" = memcheck ] && extra="--report-api-errors no"
    # initcheck counts no TMA store as a write (bench/initcheck_probe.py shows it): the
    # outputs hopper stores by TMA are zeroed first; every other buffer is checked as is.
    [ "$tool" = initcheck ] && [ "$arch" = hopper ] && cases="--zero-tma-outputs"
    log="$out/$tool-$arch.log"
    compute-sanitizer --tool "$tool" $extra --print-limit 20 \
      python3 bench/sanitize_cases.py --arch "$arch" $cases > "$log" 2>&1
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
    echo "$arch $tool: ${summary:-no summary (see $log)}"
    echo "$summary" | grep -qE "(ERROR|RACECHECK) SUMMARY: 0 " || status=1
  done
done
exit $status
