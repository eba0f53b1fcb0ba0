#!/usr/bin/env bash
# Tensor parallelism on a multi-GPU host: benchmarks/tp_decode.py (batch-1 decode and throughput at TP = N beside
# TP = 1 in the same call, greedy tokens compared), then the TP GPU tests (eager, then CUDA graphs), each stage
# under its own limit; a stage that hangs prints every rank's traceback (gpu_env.sh's staged) and ends the script.
#   usage: bash benchmarks/gpu_tp.sh            (TP=2 MODEL=... TP_ARGS=... STAGES="decode eager graphs")
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device-tp.txt"
for stage in ${STAGES:-decode eager graphs}; do
  echo "== TP stage $stage"
  if [ "$stage" = decode ]; then
    staged ${DECODE_TIMEOUT:-240} python3 benchmarks/tp_decode.py --model "${MODEL:-synthetic:llama3-8b:w4g128}" \
      --tp "${TP:-2}" ${TP_ARGS:-} --out "$OUT/tp-decode-${TP:-2}.json" 2>&1 | tee "$OUT/tp-decode.log" | tail -n 6
  else
    staged ${TESTS_TIMEOUT:-150} python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -k "$stage" \
      tests/test_tensor_parallel_gpu.py 2>&1 | tee "$OUT/tp-tests-$stage.log" | tail -n ${TEST_LINES:-8}
  fi
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ] || [ "$rc" -ge 128 ]; then echo "stage $stage stopped (rc $rc); see $OUT for tracebacks"; break; fi
done
