#!/usr/bin/env bash
# One tensor-parallel rank's decode work on one GPU: the 70B TP = 4 rank's share as a whole model
# (synthetic llama3-70b-rank-of-4: its GEMV shapes, heads and vocabulary piece, no all-reduces), then its GEMVs
# alone under Nsight Compute and over the launch configs of GEMV_CONFIGS (default: block shapes x split counts).
#   usage: bash benchmarks/gpu_rank_decode.sh      (STAGES="latency ncu sweep", GEMV_CONFIGS="[...]", GEMV_STAGES="1, 3")
source "$(dirname "$0")/gpu_env.sh"
STAGES=${STAGES:-latency ncu sweep}
MODEL=synthetic:llama3-70b-rank-of-4:w4g128
if [[ $STAGES == *latency* ]]; then
  echo "== batch-1 decode of $MODEL, FP8 KV cache, and its profile"
  timeout 240 python3 benchmarks/latency.py --model "$MODEL" --kv-cache-dtype fp8 --input-len 32 --output-len 128 \
    --profile 64 --out "$OUT/rank-decode.json" 2>&1 | grep -v '^loading' | tail -n 30
fi
if [[ $STAGES == *ncu* ]]; then
  echo "== Nsight Compute: the 70b-tp4 GEMVs at their default configs (third call of each shape)"
  timeout 180 ncu --clock-control none --kernel-name regex:gemv --launch-count 12 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 benchmarks/profile_gemv.py --models 70b-tp4 > "$OUT/ncu-gemv-70b-tp4.txt" 2>&1
  grep -iE "^  _affine|stall|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Grid Size|Block Limit Reg|Warp Cycles Per Issued|Stall|Waves Per SM|L2 Hit" \
    "$OUT/ncu-gemv-70b-tp4.txt" | head -n 200
fi
if [[ $STAGES == *sweep* ]]; then
  echo "== GEMV launch configs at one rank's 70B TP = 4 shapes"
  # block shapes x K tiles a program (64 waves: as many splits as min_tiles allows) x pipeline stages
  CONFIGS=${GEMV_CONFIGS:-$(python3 -c "
print([None] + [(bn, rs, w, 64.0, t, True, s) for bn, rs, w in ((64, 8, 1), (64, 16, 2), (128, 8, 2),
       (128, 16, 4), (256, 4, 2), (256, 8, 4)) for t in (1, 2, 4, 8) for s in (${GEMV_STAGES:-1, 2, 3, 4})
       if s == 1 or t > 1])")}
  timeout 420 python3 benchmarks/profile_gemv.py --sweep --models 70b-tp4 --configs "$CONFIGS" \
    --out "$OUT/gemv-sweep-70b-tp4.json" 2>&1 | grep -v '^{' | tail -n 80
fi
