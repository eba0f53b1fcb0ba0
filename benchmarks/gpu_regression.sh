#!/usr/bin/env bash
# One call that checks a refactor against the committed figures: the linear kernels at M = 1, 16, 256, 1024 on
# the Llama-3 8B and 70B shapes, engine batch-1 decode and offline throughput (1000 x 512 / 128, KV in fp16),
# then the GGUF GPU tests and the engine's GPU tests as an sm75 chip. Each stage has its own time limit, so
# a slow one leaves the others' results in $OUT.
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
echo "== kernels"
timeout ${KERNELS_TIMEOUT:-230} python3 benchmarks/kernels.py --out "$OUT/kernels.json" --models 8b,70b --ms 1,16,256,1024 \
  2>&1 | grep -v '^{' | tail -n 40
echo "== latency"
timeout 110 python3 benchmarks/latency.py --input-len 128 --output-len 256 --runs 3 --out "$OUT/latency.json" 2>&1 \
  | grep -v '^loading' | tail -n 2
echo "== throughput"
timeout 150 python3 benchmarks/throughput.py --num-prompts 1000 --input-len 512 --output-len 128 --kv-cache-dtype auto \
  --quiet --out "$OUT/throughput.json" 2>&1 | grep -v '^loading' | tail -n 3
echo "== GGUF on the GPU"
timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gguf_engine_gpu.py tests/test_affine_gguf.py 2>&1 | tail -n 4
echo "== engine GPU tests as sm75"
QUANTA_DEVICE_CAPS=sm75 timeout 100 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_engine_gpu.py 2>&1 | tail -n 4
