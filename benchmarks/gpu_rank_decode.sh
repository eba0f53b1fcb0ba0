#!/usr/bin/env bash
# One tensor-parallel rank's decode work on one GPU: the 70B TP = 4 rank's share as a whole model
# (synthetic llama3-70b-rank-of-4: its GEMV shapes, heads and vocabulary piece, no all-reduces), then its GEMVs
# alone under Nsight Compute and over the launch configs of GEMV_CONFIGS (default: block shapes x split counts).
#   usage: bash benchmarks/gpu_rank_decode.sh      (STAGES="latency ncu sweep", GEMV_CONFIGS="[...]", GEMV_STAGES="1, 3", GEMV_MODELS=8b,70b-tp4)
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
if [[ $STAGES == *stalls* ]]; then
  echo "== Nsight Compute: where the 70b-tp4 GEMVs' warps stall (cycles per issued instruction, by reason)"
  timeout 180 ncu --clock-control none --kernel-name regex:gemv --launch-count 12 --csv --metrics \
    "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size" \
    python3 benchmarks/profile_gemv.py --models 70b-tp4 > "$OUT/ncu-stalls-70b-tp4.csv" 2>&1
  python3 - "$OUT/ncu-stalls-70b-tp4.csv" <<'PY'
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
col = {h: i for i, h in enumerate(head)}
by_id = collections.defaultdict(dict)
for r in rows:
    by_id[int(r[col["ID"]])][r[col["Metric Name"]]] = r[col["Metric Value"]]
for i, m in sorted(by_id.items()):
    if i % 3 != 2:
        continue                                     # the third call of each shape
    stalls = sorted(((float(v.replace(",", "")), k.split("stalled_")[1].split("_per_issue")[0]) for k, v in m.items()
                     if "stalled_" in k), reverse=True)[:7]
    print(f"grid {m['launch__grid_size']} regs {m['launch__registers_per_thread']} "
          f"{m['gpu__time_duration.sum']} ns, {m['smsp__inst_executed.sum']} warp instrs, "
          f"warps active {m['sm__warps_active.avg.pct_of_peak_sustained_active']}%, "
          f"issue active {m['smsp__issue_active.avg.pct_of_peak_sustained_active']}%")
    print("   " + ", ".join(f"{k} {v:.2f}" for v, k in stalls))
PY
fi
if [[ $STAGES == *sweep* ]]; then
  echo "== GEMV launch configs at one rank's 70B TP = 4 shapes"
  # block shapes x K tiles a program (64 waves: as many splits as min_tiles allows) x pipeline stages
  CONFIGS=${GEMV_CONFIGS:-$(python3 -c "
print([None] + [(bn, rs, w, 64.0, t, True, s) for bn, rs, w in ((64, 8, 1), (64, 16, 2), (128, 8, 2),
       (128, 16, 4), (256, 4, 2), (256, 8, 4)) for t in (1, 2, 4, 8) for s in (${GEMV_STAGES:-1, 2, 3, 4})
       if s == 1 or t > 1])")}
  timeout 420 python3 benchmarks/profile_gemv.py --sweep --models "${GEMV_MODELS:-70b-tp4}" --configs "$CONFIGS" \
    --out "$OUT/gemv-sweep-70b-tp4.json" 2>&1 | grep -v '^{' | tail -n 80
fi
