# Batch-1 decode attention over short contexts, where a token pays a program's chain of dependent loads, barriers
# and the split merge in every layer: the kernel alone in each (DECODE_WARPS, DECODE_BLOCK_N) at the engine's
# splits (attention.py --decode-configs), then the w4g128 engine in the promising ones (engine_configs.py, two
# alternating rounds), and ncu on the default one. BASELINE=DIR (a checkout of another commit): its kernel at the
# default config too.
#   usage: [BASELINE=.base] bash benchmarks/decode_attention_configs.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
CONFIGS="4,64;8,64;16,64;8,32;16,32;4,16"
staged 240 python3 benchmarks/attention.py --decode-configs "$CONFIGS" --out "$OUT/attention-decode-configs.json" \
  2>&1 | grep "µs"
if [ -n "${BASELINE:-}" ]; then
  (cd "$BASELINE" && export PYTHONPATH=$PWD:$PYTHONPATH \
    && staged 120 python3 benchmarks/attention.py --decode-configs "4,64" --out "$OUT/attention-decode-baseline.json" \
    2>&1 | grep "µs" | sed 's/^/baseline /')
fi
P=quanta.kernels.paged_attention
staged 300 python3 benchmarks/engine_configs.py --model synthetic:llama3-8b:w4g128 --output-len 128 --rounds 2 \
  --variant "" --variant "$P:DECODE_WARPS=8" --variant "$P:DECODE_WARPS=16" \
  --variant "$P:DECODE_WARPS=8; DECODE_BLOCK_N=32" --out "$OUT/attention-decode-engine.json" 2>&1 | grep "tok/s"
# where one decode program's time goes (default config, 128 keys): stall reasons, issue slots, occupancy
if command -v ncu >/dev/null; then
  staged 150 ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 20 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
    python3 benchmarks/attention.py --decode-configs "4,64" > "$OUT/attention-decode-ncu.txt" 2>&1
  grep -E "Duration|Warp Cycles Per Issued|Stall|Registers Per|Achieved Occupancy|Issue Slots|Block Size|Grid Size" \
    "$OUT/attention-decode-ncu.txt" | head -n 40
fi
