#!/usr/bin/env bash
# The tensor-parallel issue's four-GPU figures: benchmarks/tp_fit.py for the Llama-3-70B-shaped model at TP = 4,
# each rank capped at 22 GiB, FP8 KV cache, in each layout of LAYOUTS (W4 g128, then GPTQ act-order), each under
# its own limit (gpu_env.sh's staged). A table last.
#   usage: bash benchmarks/gpu_tp_fit.sh       (LAYOUTS="w4g128 w4g128act" TP=4 CAP=22GiB FIT_ARGS=... to change)
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device-tp-fit.txt"
for layout in ${LAYOUTS:-w4g128 w4g128act}; do
  echo "== tp_fit llama3-70b:$layout TP=${TP:-4}"
  staged ${FIT_TIMEOUT:-280} python3 benchmarks/tp_fit.py --model "synthetic:llama3-70b:$layout" --tp "${TP:-4}" \
    --max-gpu-memory "${CAP:-22GiB}" ${FIT_ARGS:-} --out "$OUT/tp-fit-$layout.json" 2>&1 \
    | tee "$OUT/tp-fit-$layout.log" | grep -v '^{' | tail -n 8
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("tp-fit-*.json")):
    r = json.loads(f.read_text())
    d, t, l = r.get("decode", {}), r.get("throughput", {}), r.get("long", {})
    print(f"{r['model']} TP={r['tp']} cap {r['max_gpu_memory']}: decode {d.get('decode_tokens_per_s')} tok/s "
          f"({d.get('share_of_roofline', 0):.0%} of roofline {d.get('roofline_tokens_per_s')}) | "
          f"{t.get('num_prompts')}x{t.get('input_len')}/{t.get('output_len')}: {t.get('output_tokens_per_s')} out tok/s | "
          f"{l.get('concurrent_contexts')} x {l.get('prompt_tokens_each')} ctx: {l.get('decode_tokens_per_s')} tok/s | "
          f"peak/plan per GPU {r['peak_used_vs_plan_budget']} | KV {r['kv_capacity_tokens']:,} (plan {r['plan_kv_capacity_tokens']:,})")
PY
