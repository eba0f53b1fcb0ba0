# Batch-1 decode attention over short contexts in fewer, longer splits: each split at least DECODE_MIN_SPLIT_KEYS
# keys (a sequence one split covers writes its output with no partials, count or merge), DECODE_BLOCK_N keys a
# step, the next step's K / V loaded before this step's arithmetic or not (DECODE_PREFETCH). The attention tests on
# the GPU; the kernel alone at 128 / 384 / 1,024 keys in each (block_n, floor, prefetch) (attention.py
# --decode-configs); the w4g128 engine's batch-1 decode (input 128, output 256) in each, alternating
# (engine_configs.py). BASELINE=DIR (a checkout of another commit): its kernel and engine as built, too.
#   usage: [SPLITS="64,64,0 64,128,1 128,128,0"] [ROUNDS=2] [BASELINE=.base] bash benchmarks/decode_split_keys.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
SPLITS=${SPLITS:-64,64,0 64,64,1 64,128,1 64,256,1 128,128,0}
tests_pass attention-tests 120 tests/test_paged_attention.py
CONFIGS=$(for s in $SPLITS; do printf "8,%s;" "$s"; done)
staged 150 python3 benchmarks/attention.py --decode-configs "${CONFIGS%;}" --out "$OUT/attention-split-keys.json" \
  2>&1 | grep "µs"
engine_baseline() {
  [ -n "${BASELINE:-}" ] && (cd "$BASELINE" && export PYTHONPATH=$PWD:$PYTHONPATH \
    && staged 100 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:w4g128 --rounds 1 --variant "" \
      --timeout 60 --out "$OUT/decode-split-keys-baseline-$1.json" 2>&1 | grep "tok/s" | sed 's/^/baseline /')
}
if [ -n "${BASELINE:-}" ]; then
  (cd "$BASELINE" && export PYTHONPATH=$PWD:$PYTHONPATH \
    && staged 100 python3 benchmarks/attention.py --decode-configs "8,64" 2>&1 | grep "µs" | sed 's/^/baseline /')
fi
P=quanta.kernels.paged_attention
VARIANTS=()
for s in $SPLITS; do
  IFS=, read -r n keys prefetch <<< "$s"
  VARIANTS+=(--variant "$P:DECODE_BLOCK_N=$n; $P:DECODE_MIN_SPLIT_KEYS=$keys; $P:DECODE_PREFETCH=${prefetch:-0} == 1")
done
engine_baseline 1
staged 330 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:w4g128 --rounds "${ROUNDS:-2}" \
  "${VARIANTS[@]}" --timeout 60 --out "$OUT/decode-split-keys-engine.json" 2>&1 | grep "tok/s"
engine_baseline 2
