# Q2_K / Q3_K (gemv_dp4a) and IQ4_NL / IQ4_XS (gemv_iq4) at batch 1 on the dp4a GEMVs (x rounded to 8 bits) against
# the GEMVs before them: their GPU tests; decode tok/s in the engine with plan.DP4A_TYPES set against as built
# (engine_configs.py; x rounded in the GEMVs' programs, or by a launch of its own), w4g128 beside them for the
# per-byte comparison; then the kernels alone at the 8B shapes (gemv_dp4a.py: µs, share of copy, error, configs).
#   usage: MODELS="q2_K q3_K" ROUNDS=1 bash benchmarks/dp4a_decode.sh  (IQ4 models run on the codebook kernels in fp16)
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
T0=$(date +%s)
tests_pass tests 120 -m gpu tests/test_ggml_dp4a.py tests/test_ggml_iq4_dp4a.py
echo "T=$(( $(date +%s) - T0 ))"
DP4A="quanta.kernels.ggml.plan:DP4A_TYPES=${DP4A_TYPES:-('q2_K', 'q3_K', 'iq4_nl', 'iq4_xs')}"
IN="$DP4A; quanta.kernels.ggml.gemv_dp4a:QUANTIZE_IN_PROGRAMS=True"     # x rounded by the GEMVs' programs
for model in ${MODELS:-q2_K q3_K}; do
  staged 100 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:gguf-$model --output-len 256 \
    --rounds ${ROUNDS:-1} --variant "" --variant "$DP4A" --variant "$IN" --timeout 60 \
    --out "$OUT/dp4a-decode-$model.json" 2>&1 | tail -n 4
  echo "T=$(( $(date +%s) - T0 ))"
done
staged 50 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:w4g128 --output-len 256 --rounds 1 \
  --variant "" --timeout 45 --out "$OUT/dp4a-decode-w4g128.json" 2>&1 | tail -n 2
echo "T=$(( $(date +%s) - T0 ))"
if [ -z "${SKIP_KERNELS:-}" ]; then
  staged 110 python3 benchmarks/gemv_dp4a.py --out "$OUT/gemv-dp4a.json" --types "${KTYPES:-q2_K,q3_K,iq4_nl,iq4_xs}" \
    --configs "256,4,16,1;256,4,8,1" --iq4-configs "32,4,8,2;128,4,8,2;64,4,16,1" > "$OUT/gemv-dp4a.log" 2>&1
  tail -n 24 "$OUT/gemv-dp4a.log"
fi
echo "T=$(( $(date +%s) - T0 ))"
