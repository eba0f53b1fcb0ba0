# Q2_K / Q3_K (gemv_dp4a) and IQ4_NL / IQ4_XS (gemv_iq4) at batch 1 on the dp4a GEMVs (x rounded to 8 bits by their
# own programs) against the GEMVs before them: their GPU tests, the kernels alone at the 8B shapes (gemv_dp4a.py:
# µs, share of copy, error, launch configs), then decode tok/s in the engine with plan.DP4A_TYPES set against as
# built (engine_configs.py, two alternating rounds), and w4g128 beside them for the per-byte comparison.
#   usage: MODELS="q2_K q3_K iq4_xs" bash benchmarks/dp4a_decode.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
T0=$(date +%s)
staged 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ggml_dp4a.py tests/test_ggml_iq4_dp4a.py 2>&1 \
  | tail -n 3 | tee "$OUT/tests.txt"
grep -q " passed" "$OUT/tests.txt" && ! grep -q "failed\|error" "$OUT/tests.txt" || { echo "TESTS FAILED"; exit 1; }
if [ -z "$SKIP_KERNELS" ]; then
  staged 200 python3 benchmarks/gemv_dp4a.py --out "$OUT/gemv-dp4a.json" > "$OUT/gemv-dp4a.log" 2>&1
  tail -n 24 "$OUT/gemv-dp4a.log"
fi
echo "T=$(( $(date +%s) - T0 ))"
DP4A="quanta.kernels.ggml.plan:DP4A_TYPES=${DP4A_TYPES:-('q2_K', 'q3_K', 'iq4_nl', 'iq4_xs')}"
APART="$DP4A; quanta.kernels.ggml.gemv_dp4a:QUANTIZE_IN_PROGRAMS=False"     # x rounded by a launch of its own
for model in ${MODELS:-q2_K q3_K iq4_xs}; do
  staged 150 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:gguf-$model --output-len 256 \
    --rounds ${ROUNDS:-1} --variant "" --variant "$DP4A" --variant "$APART" --timeout 90 \
    --out "$OUT/dp4a-decode-$model.json" 2>&1 | tail -n 5
  echo "T=$(( $(date +%s) - T0 ))"
done
staged 100 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:w4g128 --output-len 256 --rounds 1 \
  --variant "" --timeout 90 --out "$OUT/dp4a-decode-w4g128.json" 2>&1 | tail -n 2
echo "T=$(( $(date +%s) - T0 ))"
