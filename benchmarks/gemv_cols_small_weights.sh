# The column GEMV's launch options for the small 8B weights (qkv, o), where a program's serial chain of loads and
# the split-K sum, not the issue rate, is the cost: Q4_K / Q5_K / Q6_K with the K loop split at parts of a
# super-block (ColsConfig.parts), Q2_K / Q3_K with a super-block's words all loaded first, before the PDL wait
# (chunks 2). Alone (ggml_gemm.py --sweep-configs, each config checked against cuBLAS first; every layer for
# Q2_K / Q3_K, whose large weights take the option too), then in the engine (engine_configs.py, two alternating
# rounds): each type's small-weight config against the one before it.
#   usage: bash benchmarks/gemv_cols_small_weights.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
sweep() {  # NAME TYPES LAYERS CONFIGS
  staged 120 python3 benchmarks/ggml_gemm.py --types "$2" --layers "$3" --ms 1 --sweep --sweep-configs "$4" \
    --out "$OUT/gemv-cols-$1-sweep.json" > "$OUT/gemv-cols-$1-sweep.log" 2>&1
  python3 - "$OUT/gemv-cols-$1-sweep.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["type"], r["layer"], "planned", r["ggml_us"], {k[5:-3]: v for k, v in r.items() if k.startswith("cols_")})
PY
}
sweep parts q4_K,q6_K,q5_K qkv,o \
  "256,2,16,1,2;256,2,16,1,4;256,2,16,1,2,2;256,2,16,1,1,4;256,4,16,1,2;256,4,16,1,2,2;256,4,16,1,4"
sweep preload q2_K,q3_K qkv,o,gate_up,down "128,4,32,1,1;128,4,32,1,2;256,4,16,1,1;256,4,16,1,2;512,4,16,1,1;512,4,16,1,2"
G=quanta.kernels.ggml.gemv_cols
engine() {  # MODEL NAME VARIANT...: the build as it is against each variant
  local model=$1 name=$2; shift 2
  local variants=(--variant ""); for v in "$@"; do variants+=(--variant "$v"); done
  staged 240 python3 benchmarks/engine_configs.py --model "synthetic:llama3-8b:$model" --output-len 128 --rounds 2 \
    "${variants[@]}" --out "$OUT/gemv-cols-$name-engine.json" 2>&1 | grep "tok/s" | cut -c1-60
}
# the build against the small weights' configs before it (whole super-blocks a split; Q2_K / Q3_K at chunks 1)
small() { echo "$G:CONFIGS={**CONFIGS, '$1': (ColsConfig($2), CONFIGS['$1'][1])}"; }
engine gguf-q4_K_M q4-small "$(small q4_K "256, 2, 16.0, 1, 2")" "$(small q4_K "256, 2, 16.0, 1, 4")"
engine gguf-q5_K q5-small "$(small q5_K "256, 4, 16.0, 1, 4")" "$(small q5_K "256, 2, 16.0, 1, 2, 2")"
engine gguf-q6_K q6-small "$(small q6_K "256, 4, 16.0, 1, 1")"
engine gguf-q2_K q2-small "$(small q2_K "128, 4, 32.0, 1, 1")"
engine gguf-q3_K q3-small "$(small q3_K "256, 4, 16.0, 1, 1")"
