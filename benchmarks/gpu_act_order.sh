#!/usr/bin/env bash
# Act-order W4 g128 (GPTQ desc_act) against the same weights without it, on one machine: the GPU tests of the wgmma
# kernel's gathered input, the paths forced on 8B o and down (crossover.py), then batch-1 decode and offline
# throughput (1000 x 512 / 128) of w4g128, w4g128act and w4g128act with the wgmma kernel withheld (its gathered
# input off: plan.WGMMA_GATHER_MIN_M patched past every M), alternating in two rounds.
#   usage: [ROUNDS=2] bash benchmarks/gpu_act_order.sh        (results in $OUT)
source "$(dirname "$0")/gpu_env.sh"; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
echo "== tests"
staged 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_affine_wgmma.py -k act_order 2>&1 | tail -n 3
echo "== crossover"
staged 200 python3 benchmarks/crossover.py --types w4g128,w4g128-act --layers o,down \
  --ms 2,16,32,64,128,256,512,1024 --out "$OUT/crossover-act-order.json" 2>&1 | grep -v "^{" | tail -n 20

# engine NAME FORMAT GATHER SCRIPT ARGS...: a benchmark script on synthetic:llama3-8b:FORMAT, WGMMA_GATHER_MIN_M = GATHER
engine() {
  local name=$1 fmt=$2 gather=$3 script=$4; shift 4
  staged 170 python3 -c "
import runpy, sys
from quanta.kernels.affine import plan
plan.WGMMA_GATHER_MIN_M = $gather
sys.argv = ['$script', '--model', 'synthetic:llama3-8b:$fmt', '--out', '$OUT/$name.json'] + sys.argv[1:]
runpy.run_path('benchmarks/$script', run_name='__main__')" "$@" 2>&1 | grep -v '^loading' | tail -n 1
}
DEFAULT=$(python3 -c "from quanta.kernels.affine import plan; print(plan.WGMMA_GATHER_MIN_M)")
for round in $(seq 1 "${ROUNDS:-2}"); do
  for case in "w4g128 w4g128 $DEFAULT" "act w4g128act $DEFAULT" "act-mma w4g128act 1<<30"; do set -- $case
    echo "== $1 round $round"
    engine "latency-$1-$round" "$2" "$3" latency.py --input-len 128 --output-len 256 --runs 2
    engine "throughput-$1-$round" "$2" "$3" throughput.py --num-prompts 1000 --input-len 512 --output-len 128 --quiet
  done
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def val(name, key):
    docs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-[0-9]*.json"))]
    return [(d["runs"][0] if "runs" in d else d).get(key) for d in docs]
print(f"{'case':10} {'decode tok/s':>22} {'throughput tok/s':>24}")
for case in ("w4g128", "act", "act-mma"):
    print(f"{case:10} {str(val('latency-' + case, 'decode_tokens_per_s')):>22} "
          f"{str(val('throughput-' + case, 'output_tokens_per_s')):>24}")
PY
