# Batch-1 decode attention with fewer, longer splits over short contexts: DECODE_MIN_SPLIT_KEYS keys a split at the
# least, so that a sequence one split covers writes its output with no partials, count or merge. The attention
# tests on the GPU, the kernel alone at 128 / 384 / 1,024 keys in each floor (attention.py --decode-configs), then
# the w4g128 engine's batch-1 decode (input 128, output 256) in each, alternating (engine_configs.py).
#   usage: [KEYS="64 128 256 512"] [ROUNDS=2] bash benchmarks/decode_split_keys.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
KEYS=${KEYS:-64 128 256 512}
staged 120 python3 -m pytest -q -p no:cacheprovider tests/test_paged_attention.py 2>&1 | tail -n 2 \
  | tee "$OUT/attention-tests.txt"
grep -q " passed" "$OUT/attention-tests.txt" && ! grep -q "failed\|error" "$OUT/attention-tests.txt" \
  || { echo "TESTS FAILED"; exit 1; }
CONFIGS=$(for k in $KEYS; do printf "8,64,%s;" "$k"; done)
staged 150 python3 benchmarks/attention.py --decode-configs "${CONFIGS%;}" --out "$OUT/attention-split-keys.json" \
  2>&1 | grep "µs"
P=quanta.kernels.paged_attention
VARIANTS=()
for k in $KEYS; do VARIANTS+=(--variant "$P:DECODE_MIN_SPLIT_KEYS=$k"); done
staged 330 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:w4g128 --rounds "${ROUNDS:-2}" \
  "${VARIANTS[@]}" --timeout 60 --out "$OUT/decode-split-keys-engine.json" 2>&1 | grep "tok/s"
