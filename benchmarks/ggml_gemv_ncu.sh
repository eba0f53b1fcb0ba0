# Where a K-quant GEMV's time goes at M = 1 (8B gate/up, the planned GEMV, then W4A16 g128's on the same shape):
# ncu's speed of light, memory workload, warp states and scheduler, for Q2_K, Q3_K and Q4_K (TYPES to change):
# why Q2_K / Q3_K's large weights run at 47-65% of copy while W4's reach ~90%.
# DP4A=1 plans Q2_K / Q3_K on the dp4a GEMV (gemv_dp4a) first; IQ4 is planned on its dp4a GEMV (gemv_iq4) as built.
#   usage: [TYPES="q2_K q3_K q4_K"] [DP4A=1] bash benchmarks/ggml_gemv_ncu.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
PLAN=""
[ -n "${DP4A:-}" ] && PLAN="import quanta.kernels.ggml.plan as p; p.DP4A_TYPES += ('q2_K', 'q3_K'); "
for t in ${TYPES:-q2_K q3_K q4_K}; do
  staged 150 ncu --clock-control none --kernel-name regex:"cols_kernel|h2_kernel|gemv|dp4a_kernel|iq4_kernel" \
    --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    --section Occupancy --section SchedulerStats python3 -c "${PLAN}import runpy, sys; sys.argv = ['ggml_gemm.py', \
    '--out', '/dev/null', '--profile', '$t']; runpy.run_path('benchmarks/ggml_gemm.py', run_name='__main__')" \
    > "$OUT/ncu-$t.txt" 2>&1
  echo "== $t"
  grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Mem Busy|Issue Slots Busy" \
    "$OUT/ncu-$t.txt" | head -n 24
  grep -E "Warp Cycles Per Issued|Eligible Warps|Achieved Occupancy|Registers Per|Stall" "$OUT/ncu-$t.txt" | head -n 24
done
