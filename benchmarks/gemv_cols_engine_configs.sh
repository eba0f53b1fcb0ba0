# Decode tok/s of the Q4_K_M mix with the column GEMV's launch configs patched (gemv_cols.PACKED_HALF, or the
# configs of Q4_K / Q6_K below and from LARGE_WEIGHT values through gemv_cols.CONFIGS), two alternating rounds
# (engine_configs.py): what the configs do inside the engine's chain of kernels, which ggml_gemm.py --sweep (alone)
# misses.
#   usage: bash benchmarks/gemv_cols_engine_configs.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
G=quanta.kernels.ggml.gemv_cols
by_size() {     # Q4_K and Q6_K: $1 below LARGE_WEIGHT values, $2 from there
  echo "$G:CONFIGS={**CONFIGS, 'q4_K': (GemvConfig$1, GemvConfig$2), 'q6_K': (GemvConfig$1, GemvConfig$2)}"
}
staged 900 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:gguf-q4_K_M --output-len 128 --rounds 2 \
  --variant "" \
  --variant "$(by_size "(256, 2, 16.0, 1)" "(256, 2, 8.0, 2)")" \
  --variant "$G:PACKED_HALF=GemvConfig(256, 2, 32.0, 1)" \
  --variant "$(by_size "(128, 1, 32.0, 1)" "(256, 2, 16.0, 1)")" --out "$OUT/gemv-cols-engine-configs.json"
