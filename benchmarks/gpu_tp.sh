#!/usr/bin/env bash
# Tensor parallelism on a multi-GPU host: the TP GPU tests (eager first, then CUDA graphs), then
# benchmarks/tp_decode.py (batch-1 decode and throughput at TP = N beside TP = 1 in the same call, greedy tokens
# compared), each stage under its own limit. A stage that hangs is stopped with SIGABRT, on which every Python
# process of the stage (the ranks included) prints where it was (PYTHONFAULTHANDLER).
#   usage: bash benchmarks/gpu_tp.sh            (TP=2 MODEL=... TP_ARGS=... to change)
source "$(dirname "$0")/gpu_env.sh"
export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device-tp.txt"
for mode in eager graphs; do
  echo "== TP GPU tests ($mode)"
  timeout -s ABRT -k 10 ${TESTS_TIMEOUT:-150} python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -k "$mode" \
    tests/test_tensor_parallel_gpu.py 2>&1 | tee "$OUT/tp-tests-$mode.log" | tail -n ${TEST_LINES:-8}
done
echo "== tp_decode TP=${TP:-2}"
timeout -s ABRT -k 10 ${DECODE_TIMEOUT:-240} python3 benchmarks/tp_decode.py --model "${MODEL:-synthetic:llama3-8b:w4g128}" \
  --tp "${TP:-2}" ${TP_ARGS:-} --out "$OUT/tp-decode-${TP:-2}.json" 2>&1 | tee "$OUT/tp-decode.log" | tail -n 6
