# Where a K-quant GEMV's time goes at M = 1 (8B gate/up, the planned GEMV, then W4A16 g128's on the same shape):
# ncu's speed of light, memory workload, warp states and scheduler, for Q2_K, Q3_K and Q4_K (TYPES to change):
# why Q2_K / Q3_K's large weights run at 47-65% of copy while W4's reach ~90%.
#   usage: [TYPES="q2_K q3_K q4_K"] bash benchmarks/ggml_gemv_ncu.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
for t in ${TYPES:-q2_K q3_K q4_K}; do
  staged 150 ncu --clock-control none --kernel-name regex:"cols_kernel|h2_kernel|gemv" --launch-skip 2 \
    --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    --section Occupancy --section SchedulerStats python3 benchmarks/ggml_gemm.py --out /dev/null --profile $t \
    > "$OUT/ncu-$t.txt" 2>&1
  echo "== $t"
  grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Mem Busy|Issue Slots Busy" \
    "$OUT/ncu-$t.txt" | head -n 24
  grep -E "Warp Cycles Per Issued|Eligible Warps|Achieved Occupancy|Registers Per|Stall" "$OUT/ncu-$t.txt" | head -n 24
done
