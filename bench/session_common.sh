# The start that the device-call scripts (bench/*_session.sh) share, sourced by them:
#   session_start NAME
# sets $out, the logs' folder ($OUT on the device machine, else results/NAME-<date>), a JIT
# cache folder and unbuffered Python for what follows, and records the GPU's name and clocks
# in $out/gpu.txt.
session_start() {
  out="${OUT:-results/$1-$(date +%Y%m%d-%H%M%S)}"
  mkdir -p "$out"
  export PYTHONUNBUFFERED=1 FLASH_CUTE_CACHE_DIR="${FLASH_CUTE_CACHE_DIR:-/tmp/fc-cache}"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
}
