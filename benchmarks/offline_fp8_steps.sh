# The fp8 offline run's one-pass steps on a GPU: their GPU tests, then 1000 x 512/128 output tok/s (FP8 KV, step
# budgets 1024 / 16384): the draw kernel on (sampler.GPU_DRAW_KERNEL) against off, alternating; with BASELINE (a
# checkout without the SwiGLU product quantized in its launch, e.g. 80c507f) this build against it.
#   usage: [BASELINE=DIR] [ROUNDS=2] bash benchmarks/offline_fp8_steps.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
tests_pass fp8-steps-tests 240 -m gpu tests/test_draw.py tests/test_sampler.py tests/test_fp8_gemm.py \
  tests/test_activation.py
ARGS="--kv-cache-dtype fp8 --max-num-seqs 1024 --max-num-batched-tokens 16384"
staged 560 python3 benchmarks/engine_configs.py --bench throughput --model synthetic:llama3-8b:fp8 --input-len 512 \
  --output-len 128 --num-prompts 1000 --rounds "${ROUNDS:-2}" --timeout 150 --variant "" \
  --variant "quanta.engine.sampler:GPU_DRAW_KERNEL=True" --out "$OUT/fp8-draw-kernel.json" $ARGS 2>&1 | grep "tok/s"
if [ -n "${BASELINE:-}" ]; then
  MODEL=synthetic:llama3-8b:fp8 STAGES=throughput THROUGHPUT_ARGS="$ARGS" ROUNDS=${ROUNDS:-2} \
    bash benchmarks/gpu_regression.sh 2>&1 | grep -A3 "== throughput" | grep -v '^--'
fi
