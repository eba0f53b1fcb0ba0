#!/usr/bin/env bash
# GGUF at its own bytes on a GPU: the ggml kernel and engine GPU tests, the ggml kernels against cuBLAS fp16 and
# the W4A16 g128 kernels (the packed-half GEMV's configs swept), then the engine: batch-1 decode and offline
# throughput of w4g128 and GGUF formats at the Llama-3-8B shape (quanta bench), the 70B Q4_K_M mix under an 80 GB
# card's cap and the 8B mix as a T4; ncu profiles the Q4_K and W4A16 GEMVs. STAGES picks stages (tests kernels
# bench fit ncu), TESTS / TESTS_K the tests,
# TYPES and MS the kernel benchmark's types and M.
#   usage: bash benchmarks/gpu_ggml.sh
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
STAGES=${STAGES:-tests kernels bench fit}
for stage in $STAGES; do
  start=$SECONDS
  case $stage in
    tests)
      echo "== ggml GPU tests"
      staged ${TESTS_TIMEOUT:-300} python3 -m pytest -m gpu -q -rf --tb=short -p no:cacheprovider \
        -k "${TESTS_K:-}" ${TESTS:-tests/test_ggml_gemm.py tests/test_gguf_engine_gpu.py} 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 12 ;;
    kernels)
      echo "== ggml kernels"
      staged ${KERNELS_TIMEOUT:-240} python3 benchmarks/ggml_gemm.py --out "$OUT/ggml-gemm.json" \
        --types "${TYPES:-q4_K,q6_K}" --ms "${MS:-1,16,256,2048}" ${KERNEL_FLAGS:---paths --sweep} \
        > "$OUT/ggml-gemm.log" 2>&1; sed -n '/copy .* GB\/s/,$p' "$OUT/ggml-gemm.log" | tail -n 60 ;;
    bench)
      echo "== engine: quanta bench"
      staged ${BENCH_TIMEOUT:-240} python3 -m quanta.cli.main bench llama-3-8b -q \
        --formats "${FORMATS:-awq,gguf:Q4_K_M}" --num-prompts "${PROMPTS:-200}" --out "$OUT/bench" \
        > "$OUT/bench.log" 2>&1; tail -n 25 "$OUT/bench.log" ;;
    fit)
      echo "== 70B Q4_K_M under 79 GiB; 8B Q4_K_M as a T4"
      for case in ${FIT_CASES:-70b t4}; do
        cap=""; [ "$case" = 70b ] && cap="--max-gpu-memory 79GiB"
        staged ${FIT_TIMEOUT:-200} python3 benchmarks/memory_fit.py $case --weights gguf-q4_K_M $cap \
          --out "$OUT/memory-fit-$case-q4km.json" 2>&1 | tail -n 1
      done ;;
    ncu)
      echo "== Nsight Compute: Q4_K and W4A16 GEMVs at gate/up, M = 1"
      staged ${NCU_TIMEOUT:-120} ncu --clock-control none --kernel-name "regex:gemv|h2_kernel|cols_kernel" --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 benchmarks/ggml_gemm.py --out /dev/null --profile > "$OUT/ncu.txt" 2>&1
      grep -E "^  [a-z_0-9]+(gemv|h2|cols)_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots|Stall|Block Size|Grid Size" "$OUT/ncu.txt" | head -n 60 ;;
  esac
  echo "-- $stage: $((SECONDS - start)) s"
done
