# Decode tok/s of the Q4_K_M mix with the column GEMV's launch configs patched (gemv_cols.CONFIGS: Q4_K and Q5_K,
# and Q6_K, each one config below LARGE_WEIGHT values and one from there), two alternating rounds
# (engine_configs.py): what the configs do inside the engine's chain of kernels, which ggml_gemm.py --sweep (alone)
# misses. A config: (BLOCK_N, warps, waves, min tiles, chunks). The last variant gives the 8B o GEMV alone (below
# 20M values) a whole super-block an iteration, q/k/v two chunks; the next, q/k/v over a Q6_K v in two warps, not
# PAIR_WARPS' four (the pair then holds 255 registers: Q6_K's four columns a thread).
#   usage: bash benchmarks/gemv_cols_engine_configs.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
G=quanta.kernels.ggml.gemv_cols
C() { echo "ColsConfig($1)"; }
# configs Q45_SMALL Q45_LARGE Q6_SMALL Q6_LARGE
configs() {
  local q45="($(C "$1"), $(C "$2"))"
  echo "$G:CONFIGS={**CONFIGS, 'q4_K': $q45, 'q5_K': $q45, 'q6_K': ($(C "$3"), $(C "$4"))}"
}
staged 900 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:gguf-q4_K_M --output-len 128 --rounds 2 \
  --variant "" \
  --variant "$(configs "256, 2, 16.0, 1, 1" "256, 2, 16.0, 1, 1" "256, 2, 16.0, 1, 1" "256, 2, 16.0, 1, 1")" \
  --variant "$(configs "256, 2, 16.0, 1, 4" "256, 2, 16.0, 1, 2" "256, 4, 16.0, 1, 1" "256, 4, 16.0, 1, 1")" \
  --variant "$(configs "256, 2, 16.0, 1, 2" "256, 2, 16.0, 1, 1" "256, 4, 16.0, 1, 1" "256, 4, 16.0, 1, 1")" \
  --variant "$(configs "256, 2, 16.0, 1, 2" "256, 2, 8.0, 2, 2" "256, 4, 16.0, 1, 1" "256, 4, 16.0, 1, 1")" \
  --variant "$(configs "256, 2, 16.0, 1, 2" "256, 2, 16.0, 1, 2" "128, 2, 16.0, 1, 1" "128, 2, 16.0, 1, 1")" \
  --variant "$G:LARGE_WEIGHT=20_000_000;$(configs "256, 2, 16.0, 1, 4" "256, 2, 16.0, 1, 2" "256, 4, 16.0, 1, 1" \
             "256, 4, 16.0, 1, 1")" \
  --variant "$G:pair_config=lambda a, b: _config(a.name, (a.n + b.n) * a.k)._replace(warps=2)" \
  --out "$OUT/gemv-cols-engine-configs.json"
