# Decode tok/s of the Q4_K_M mix with the column GEMV's launch configs patched (gemv_cols.SMALL / LARGE), two
# alternating rounds (engine_configs.py): what the configs do inside the engine's chain of kernels, which
# ggml_gemm.py --sweep (alone) misses.
#   usage: bash benchmarks/gemv_cols_engine_configs.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
G=quanta.kernels.ggml.gemv_cols
staged 900 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:gguf-q4_K_M --output-len 128 --rounds 2 \
  --variant "" \
  --variant "$G:LARGE=GemvConfig(256, 2, 8.0, 2)" \
  --variant "$G:SMALL=GemvConfig(256, 2, 32.0, 1); $G:LARGE=GemvConfig(256, 2, 32.0, 1)" \
  --variant "$G:SMALL=GemvConfig(128, 1, 32.0, 1)" --out "$OUT/gemv-cols-engine-configs.json"
