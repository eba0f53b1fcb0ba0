# The column GEMV's K loop split at parts of a super-block (ColsConfig.parts: halves, quarters) on the small 8B
# weights (qkv, o), where a program's serial chain of loads and the split-K sum, not the issue rate, is the cost:
# alone (ggml_gemm.py --sweep-configs, each config checked against cuBLAS first) for Q4_K, Q6_K and Q5_K, then the
# Q4_K_M mix's decode with Q4_K's small weights in halves (engine_configs.py, two alternating rounds).
#   usage: bash benchmarks/gemv_cols_parts.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
staged 120 python3 benchmarks/ggml_gemm.py --types q4_K,q6_K,q5_K --layers qkv,o --ms 1 --sweep \
  --sweep-configs "256,2,16,1,2;256,2,16,1,2,2;256,2,16,1,1,4;256,4,16,1,2;256,4,16,1,2,2;256,4,16,1,4" \
  --out "$OUT/gemv-cols-parts-sweep.json" > "$OUT/gemv-cols-parts-sweep.log" 2>&1
python3 - "$OUT/gemv-cols-parts-sweep.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["type"], r["layer"], "planned", r["ggml_us"], {k[5:-3]: v for k, v in r.items() if k.startswith("cols_")})
PY
G=quanta.kernels.ggml.gemv_cols
staged 200 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:gguf-q4_K_M --output-len 128 --rounds 2 \
  --variant "" --variant "$G:CONFIGS={**CONFIGS, 'q4_K': (ColsConfig(256, 2, 16.0, 1, 2, 2), PACKED_HALF)}" \
  --out "$OUT/gemv-cols-parts-engine.json" 2>&1 | grep "tok/s" | cut -c1-60
