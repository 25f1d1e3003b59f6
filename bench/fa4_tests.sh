#!/usr/bin/env bash
# FA4's own tests through an import shim (GPU), the "drop-in for FA4" check:
#   bash bench/fa4_tests.sh TEST_FILE [pytest args...]
# TEST_FILE is e.g. tests/cute/test_flash_attn_fast.py of the flash-attention repository
# (the version matching the installed flash-attn-4). It runs in a scratch directory beside
# bench/fa4_shim.py as its conftest.py, with this checkout's flash_cute first on the path.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bash bench/fa4_tests.sh TEST_FILE [pytest args...]"; exit 2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
test_file="$(realpath "$1")"; shift
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cp "$test_file" "$scratch/"
# The mod definitions FA4's score_mod / mask_mod tests import from beside them.
cp "$(dirname "$test_file")"/*_definitions.py "$scratch/" 2>/dev/null || true
cp "$root/bench/fa4_shim.py" "$scratch/conftest.py"
cd "$scratch" && PYTHONPATH="$root:${PYTHONPATH:-}" python3 -m pytest -p no:cacheprovider \
  -o addopts="" "$@" "$(basename "$test_file")"
