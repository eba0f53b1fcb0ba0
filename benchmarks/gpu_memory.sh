#!/usr/bin/env bash
# The memory issue's GPU figures in one call: the loaders unpacking on the device, the engine's GPU tests,
# then benchmarks/memory_fit.py's two cases (70B W4 with an FP8 KV cache on one GPU; the 8B W4 model as a
# 15 GiB sm75 card with four 8k contexts), each under its own time limit so one slow stage leaves the others'
# results in $OUT. A table last.
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
echo "== loaders on the device, engine memory"
timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short ${TESTS:-tests/test_quant_loaders.py \
  tests/test_engine_memory.py} 2>&1 | tee "$OUT/gpu-tests.log" | tail -n ${TEST_LINES:-6}
for case in 70b t4; do
  echo "== memory_fit $case"
  timeout ${FIT_TIMEOUT:-200} python3 benchmarks/memory_fit.py $case --out "$OUT/memory-fit-$case.json" 2>&1 | tail -n 3
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("memory-fit-*.json")):
    r = json.loads(f.read_text())
    g = lambda k: f"{r[k] / 2**30:.2f}" if r.get(k) is not None else "-"
    print(f"{r['case']:4s} load peak {g('load_peak_bytes')} GiB (plan {g('plan_load_peak_bytes')}, x{r['load_peak_vs_plan']}) | "
          f"weights {g('weights_bytes')} (plan {g('plan_weights_bytes')}) | used {g('device_used_after_startup_bytes')} "
          f"(budget {g('plan_budget_bytes')}, x{r['used_vs_plan_budget']}), peak {g('peak_device_use_bytes')} "
          f"(x{r['peak_use_vs_plan_budget']}) | KV {r['kv_capacity_tokens']:,} tok "
          f"(plan {r['plan_kv_capacity_tokens']:,}) | decode {r['decode_tokens_per_s']} tok/s"
          + (f" ({r['share_of_roofline']:.0%} of roofline)" if "share_of_roofline" in r else ""))
PY
