#!/usr/bin/env bash
# Context parallelism on a machine of several GPUs, one device call per part, each under the
# 10-minute limit (a 1M-token causal step on 2 GPUs takes about 25 s):
#   bash bench/parallel_session.sh check   # correctness at every world size the machine has
#   bash bench/parallel_session.sh 128k    # zigzag ring and Ulysses, fwd and bwd, all GPUs
#   bash bench/parallel_session.sh 512k
#   bash bench/parallel_session.sh 1m      # the ring only, with the transfers' overlap
# (GPU host, repo root, after `source .gpu-host/setup.sh`.) NVLink multicast stays off in
# every process. Results: $out/<part>*/parallel.json and the logs beside them.
set -uo pipefail
source "$(dirname "$0")/session_common.sh"
session_start "parallel-${1:?part: check, 128k, 512k or 1m}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)
launch() {  # launch WORLD LOG ARGS...: one torchrun of `bench parallel`
  local world=$1 log=$2
  shift 2
  timeout 540 torchrun --standalone --nproc-per-node "$world" -m flash_cute bench parallel \
    "$@" > "$out/$log.log" 2>&1
  echo "$log: exit $?"
  grep -v Warning "$out/$log.log" | tail -12
}
case "$1" in
  check)
    for world in 2 4 8; do
      [ "$world" -le "$gpus" ] && launch "$world" "check-$world" --check --out "$out/check-$world"
    done ;;
  128k) launch "$gpus" tp-128k --tokens 131072 --overlap --out "$out/tp-128k" ;;
  512k) launch "$gpus" tp-512k --tokens 524288 --out "$out/tp-512k" ;;
  1m) launch "$gpus" tp-1m --tokens 1048576 --kinds ring --reps 3 --overlap --out "$out/tp-1m" ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
