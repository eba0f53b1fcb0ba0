# Q2_K / Q3_K at batch 1 on the dp4a GEMV (gemv_dp4a: x rounded to 8 bits by its own programs) against the
# packed-half GEMV: its GPU tests, the kernels alone at the 8B shapes (gemv_dp4a.py: µs, share of copy, error, launch
# configs), then decode tok/s in the engine with plan.DP4A_TYPES set against as built (engine_configs.py, two
# alternating rounds) for Q2_K, Q3_K and the Q3_K_M mix, and w4g128 beside them for the per-byte comparison.
#   usage: bash benchmarks/dp4a_decode.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
T0=$(date +%s)
staged 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ggml_dp4a.py 2>&1 | tail -n 3 \
  | tee "$OUT/tests.txt"
grep -q " passed" "$OUT/tests.txt" && ! grep -q "failed\|error" "$OUT/tests.txt" || { echo "TESTS FAILED"; exit 1; }
staged 150 python3 benchmarks/gemv_dp4a.py --out "$OUT/gemv-dp4a.json" > "$OUT/gemv-dp4a.log" 2>&1
tail -n 14 "$OUT/gemv-dp4a.log"
echo "T=$(( $(date +%s) - T0 ))"
DP4A="quanta.kernels.ggml.plan:DP4A_TYPES=('q2_K', 'q3_K')"
for model in gguf-q2_K gguf-q3_K gguf-q3_K_M; do
  staged 200 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:$model --output-len 256 --rounds 2 \
    --variant "" --variant "$DP4A" --timeout 90 --out "$OUT/dp4a-decode-$model.json" 2>&1 | tail -n 5
done
staged 100 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:w4g128 --output-len 256 --rounds 1 \
  --variant "" --timeout 90 --out "$OUT/dp4a-decode-w4g128.json" 2>&1 | tail -n 2
echo "T=$(( $(date +%s) - T0 ))"
