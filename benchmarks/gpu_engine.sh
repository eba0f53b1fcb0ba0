#!/usr/bin/env bash
# The paged engine on one GPU, in one call: GPU engine + paged-attention tests, then throughput
# (synthetic Llama-3-8B W4 g128, 1000 x 512 in / 128 out, fp16 vs fp8 KV, transformers fp16 baseline)
# and batch-1 latency. No network. JSON lands in $OUT (default ./gpu_engine_out); a table is printed last.
#   bash benchmarks/gpu_engine.sh            # N=1000 requests; N=200 for a quicker pass
#   STAGES="tests latency" bash benchmarks/gpu_engine.sh     # a subset of: tests latency nopdl nosync profile throughput
#   HF_BASELINE=0 bash benchmarks/gpu_engine.sh              # without the transformers generate baseline
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_engine_out}"; mkdir -p "$OUT"
N="${N:-1000}"
STAGES="${STAGES:-tests latency throughput}"
MODEL="${MODEL:-synthetic:llama3-8b:w4g128}"
export PYTHONPATH="$PWD:$PWD/tests:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"

if [[ $STAGES == *tests* ]]; then
echo "== tests (paged attention kernels + GPU engine)"
timeout ${TEST_TIMEOUT:-400} python -m pytest -q -m "" -p no:cacheprovider --durations=5 ${TESTS:-tests/test_paged_attention.py tests/test_engine_gpu.py} \
    2>&1 | tail -25 | tee "$OUT/tests.txt"
fi

if [[ $STAGES == *latency* ]]; then
echo "== latency (batch 1)"
timeout 150 python benchmarks/latency.py --model "$MODEL" --input-len 128 --output-len 256 --runs 3 \
    --out "$OUT/latency.json" 2>&1 | grep -v '^loading' | tail -3
fi

if [[ $STAGES == *nopdl* ]]; then
echo "== latency (batch 1) without programmatic dependent launch (QUANTA_PDL=0)"
QUANTA_PDL=0 timeout 150 python benchmarks/latency.py --model "$MODEL" --input-len 128 --output-len 256 --runs 3 \
    --out "$OUT/latency_nopdl.json" 2>&1 | grep -v '^loading' | tail -3
fi

if [[ $STAGES == *nosync* ]]; then
echo "== latency (batch 1) without async scheduling"
timeout 150 python benchmarks/latency.py --model "$MODEL" --input-len 128 --output-len 256 --runs 3 \
    --no-async-scheduling --out "$OUT/latency_noasync.json" 2>&1 | grep -v '^loading' | tail -3
fi

if [[ $STAGES == *profile* ]]; then
echo "== batch-1 decode profile (GPU time per token by kernel, and the part of it no other kernel overlaps; PDL off)"
QUANTA_PDL=0 timeout 150 python benchmarks/latency.py --model "$MODEL" --input-len 128 --output-len 64 --runs 1 --profile 32 \
    2>&1 | grep -v 'loading\|warn' | tail -24 | tee "$OUT/profile.txt"
fi

if [[ $STAGES == *throughput* ]]; then
echo "== throughput"
timeout ${THROUGHPUT_TIMEOUT:-420} python benchmarks/throughput.py --model "$MODEL" --num-prompts "$N" --input-len 512 --output-len 128 \
    --kv-cache-dtype auto fp8 $([ "${HF_BASELINE:-1}" = 1 ] && echo --hf-baseline --hf-batch-sizes 16,32,64) --quiet \
    --out "$OUT/throughput.json" 2>&1 | grep -v '^loading' | tail -8
fi

python - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = []
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None
lat, thr, nopdl = load("latency.json"), load("throughput.json"), load("latency_nopdl.json")
noasync = load("latency_noasync.json")
print("\n| metric | value |\n|---|---|")
if lat:
    print(f"| batch-1 decode tok/s ({lat['model']}) | {lat['decode_tokens_per_s']} ({lat['decode_ms_per_token']} ms/token) |")
    if "share_of_roofline" in lat:
        print(f"| roofline tok/s (bytes/token {lat['weight_bytes_per_token']/1e9:.2f} GB, copy {lat['copy_bandwidth_GBps']} GB/s) "
              f"| {lat['roofline_tokens_per_s']} -> share {lat['share_of_roofline']:.1%} (target >= 60%) |")
if nopdl:
    print(f"| batch-1 decode tok/s with QUANTA_PDL=0 | {nopdl['decode_tokens_per_s']} "
          f"(share {nopdl.get('share_of_roofline', float('nan')):.1%}) |")
if noasync:
    print(f"| batch-1 decode tok/s without async scheduling | {noasync['decode_tokens_per_s']} "
          f"(share {noasync.get('share_of_roofline', float('nan')):.1%}) |")
if thr:
    hf = thr.get("transformers_fp16", {})
    if hf:
        print(f"| transformers fp16 generate, best batch {hf['best_batch']} | {hf['best_output_tokens_per_s']} output tok/s |")
    for r in thr["runs"]:
        extra = f", x{r['speedup_vs_transformers']} vs transformers (target >= 20)" if "speedup_vs_transformers" in r else ""
        cap = f", capacity x{r['capacity_vs_first']} / throughput x{r['throughput_vs_first']} vs auto" if "capacity_vs_first" in r else ""
        print(f"| quanta {thr['num_prompts']}x{thr['input_len']}/{thr['output_len']} kv={r['kv_cache_dtype']} "
              f"| {r['output_tokens_per_s']} output tok/s, {r['requests_per_s']} req/s, KV {r['kv_capacity_tokens']} tokens{extra}{cap} |")
PY
