# Sourced by the GPU scripts: the repository root as cwd, $OUT, the import path, and the wheels in .whl/ (the GPU
# machine has no network) installed aside in /tmp/site.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/quanta-gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then         # once per machine: scripts may run side by side
  [ -f /tmp/site/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl && touch /tmp/site/.done; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} PYTHONFAULTHANDLER=1

# staged LIMIT CMD...: run CMD; past LIMIT seconds CMD and every tensor-parallel rank it spawned get SIGABRT,
# on which each prints where its threads were (PYTHONFAULTHANDLER), so a hang shows where it hangs.
staged() {
  local limit=$1; shift
  # the watchdog's output goes nowhere: a sleep left holding the caller's pipe would keep `... | tail` waiting
  ( sleep "$limit"; pkill -ABRT -f worker_entry ) >/dev/null 2>&1 & local dog=$!
  timeout -s ABRT -k 15 "$limit" "$@"; local rc=$?
  pkill -P "$dog" 2>/dev/null; kill "$dog" 2>/dev/null
  return $rc
}

# tests_pass NAME LIMIT PYTEST_ARGS...: run pytest (quiet, no cache) under staged, its last lines shown and kept in
# $OUT/NAME.txt; a script stops here ("TESTS FAILED") unless they pass, so no figure is measured on a broken build.
tests_pass() {
  local name=$1 limit=$2; shift 2
  staged "$limit" python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -n 3 | tee "$OUT/$name.txt"
  grep -q " passed" "$OUT/$name.txt" && ! grep -q "failed\|error" "$OUT/$name.txt" || { echo "TESTS FAILED"; exit 1; }
}
