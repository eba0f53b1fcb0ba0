#!/usr/bin/env bash
# The check of a change against the committed figures: the linear kernels at M = 1, 16, 256, 1024 on the Llama-3
# 8B and 70B shapes, engine batch-1 decode and offline throughput (1000 x 512 / 128, KV in fp16), then the GGUF
# GPU tests and the engine's GPU tests as an sm75 chip. Each stage has its own time limit, so a slow one leaves
# the others' results in $OUT.
#   STAGES="kernels ggml latency throughput gguf sm75"   the stages to run (default: all but ggml)
#   BASELINE=DIR     a checkout of the build to compare with (quanta/ and benchmarks/ of another commit): the
#                    ggml, latency and throughput stages then run it too, alternating with this build, on one machine
#   MODEL=synthetic:llama3-8b:FMT   the latency and throughput stages' model (default w4g128)
#   THROUGHPUT_ARGS="--kv-cache-dtype fp8 --max-num-seqs 1024"   more throughput.py flags (later ones win)
#   ROUNDS=N         throughput runs of each build, alternating (default 1; files throughput-BUILD[-ROUND].json)
#   GGML_TYPES=q4_K,q6_K            the ggml stage's types (its kernels at M = 1 on the Llama-3-8B shapes)
#   KERNELS_TIMEOUT, GGUF_TIMEOUT, SM75_TIMEOUT   seconds for those stages (a cold machine compiles every kernel
#                    the tests run first: the GGUF stage's 80 s ended it after four tests)
source "$(dirname "$0")/gpu_env.sh"
STAGES=${STAGES:-kernels latency throughput gguf sm75}
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"

# engine ROOT NAME CMD...: run a benchmark script of the checkout at ROOT (its quanta/ first on the path), the last
# $TAIL_LINES (3) lines of its output shown
engine() {
  local root=$1 name=$2; shift 2
  (cd "$root" && PYTHONPATH=$PWD:$PYTHONPATH "$@" --out "$OUT/$name.json") 2>&1 | grep -v '^loading' \
    | tail -n "${TAIL_LINES:-3}"
}
builds=(". this")
[ -n "${BASELINE:-}" ] && builds+=("$BASELINE baseline")

if has kernels; then
  echo "== kernels"
  timeout "${KERNELS_TIMEOUT:-230}" python3 benchmarks/linears.py --out "$OUT/kernels.json" --models 8b,70b \
    --ms 1,16,256,1024 2>&1 | grep -v '^{' | tail -n 40
fi
if has ggml; then
  for b in "${builds[@]}"; do set -- $b
    echo "== ggml kernels at M = 1 ($2)"
    TAIL_LINES=30 engine "$1" "ggml-$2" timeout 120 python3 benchmarks/ggml_gemm.py \
      --types "${GGML_TYPES:-q4_K,q6_K}" --ms 1
  done
fi
if has latency; then
  for b in "${builds[@]}"; do set -- $b
    echo "== latency ($2)"
    engine "$1" "latency-$2" timeout 110 python3 benchmarks/latency.py --input-len 128 --output-len 256 --runs 3 \
      --model "${MODEL:-synthetic:llama3-8b:w4g128}"
  done
fi
if has throughput; then
  for r in $(seq "${ROUNDS:-1}"); do
    for b in "${builds[@]}"; do set -- $b
      echo "== throughput ($2, round $r)"
      engine "$1" "throughput-$2$([ "$r" = 1 ] || echo "-$r")" timeout 150 python3 benchmarks/throughput.py \
        --num-prompts 1000 --input-len 512 --output-len 128 --kv-cache-dtype auto --quiet \
        --model "${MODEL:-synthetic:llama3-8b:w4g128}" ${THROUGHPUT_ARGS:-}
    done
  done
fi
if has gguf; then
  echo "== GGUF on the GPU"
  timeout "${GGUF_TIMEOUT:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gguf_engine_gpu.py \
    tests/test_affine_gguf.py 2>&1 | tail -n 4
fi
if has sm75; then
  echo "== engine GPU tests as sm75"
  QUANTA_DEVICE_CAPS=sm75 timeout "${SM75_TIMEOUT:-150}" python3 -m pytest -m gpu -q -x -p no:cacheprovider \
    tests/test_engine_gpu.py 2>&1 | tail -n 4
fi
