#!/usr/bin/env bash
# The GPU evidence for the Triton kernels, on a machine with no network: GPU tests at real shapes against
# the references, then benchmarks/linears.py (full JSON to $OUT/kernels.json, a short table printed last).
#   usage: [SKIP_TESTS=1] bash benchmarks/gpu_suite.sh [linears.py args, e.g. --models 8b --sweep]
# bitsandbytes (the NF4 peer) comes as a wheel in .whl/ (../shared/tools/gpu-wheels.sh .whl).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/quanta-gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit \
  --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
[ "${SKIP_TESTS:-0}" = 1 ] || python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests/test_affine_gemm.py tests/test_affine_mma.py tests/test_affine_gguf.py tests/test_codebook_gemm.py tests/test_rotary.py \
  tests/test_fp8_gemm.py tests/test_fused_norm.py} 2>&1 | tee "$OUT/pytest.log" | tail -n 25
# SM clock, power and throttle reasons every 0.5 s while the benchmarks run, each bench.log line stamped, so that a
# figure can be matched to the clocks it ran at (70B M = 256 ran 15-20% slower late in the suite than alone)
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 500 > "$OUT/clocks.csv" 2>/dev/null &
CLOCKS=$!
capped() { nvidia-smi -q -d PERFORMANCE | grep -m1 "SW Power Capping" | grep -o '[0-9]* us'; }   # driver's counter
CAPPED0=$(capped)
python3 benchmarks/linears.py --out "$OUT/kernels.json" "$@" 2>&1 | while IFS= read -r line; do
  printf '%s %s\n' "$(date +%H:%M:%S.%N | cut -c1-12)" "$line"; done | tee "$OUT/bench.log" | grep -v '^[0-9:.]* {'
kill $CLOCKS 2>/dev/null
echo "time under the software power cap (driver counter): $CAPPED0 before the benchmarks, $(capped) after"
python3 - "$OUT/clocks.csv" <<'PY'
import sys
rows = [r.split(", ") for r in open(sys.argv[1]).read().splitlines() if r.count(",") >= 4]
mhz = sorted(int(r[1].split()[0]) for r in rows if r[1].split()[0].isdigit())
if mhz:
    reasons = sorted({r[4] for r in rows})
    print(f"SM clock over {len(mhz)} samples: min {mhz[0]} MHz, median {mhz[len(mhz) // 2]}, max {mhz[-1]}; "
          f"throttle reasons seen: {' '.join(reasons)}")
PY
