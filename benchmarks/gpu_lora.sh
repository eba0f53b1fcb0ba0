#!/usr/bin/env bash
# LoRA over a quantized base on one GPU, in one call: the LoRA kernel tests (slot kernels inside CUDA graphs, the
# GEMV epilogue), then lora_throughput.py (synthetic Llama-3-8B W4 g128; 8 rank-16 adapters over a batch of 64
# against no LoRA; batch-1 decode with one adapter against none), and with STAGES "slots" lora_slots.py (the slot
# kernels against the W4 GEMM at a batch's rows). No network. JSON in $OUT (default ./gpu_lora_out); table last.
#   bash benchmarks/gpu_lora.sh
#   STAGES="bench slots" ADAPTERS=8 BATCH=64 PROFILE=1 bash benchmarks/gpu_lora.sh    (PROFILE: where a batch-1 token goes)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_lora_out}"; mkdir -p "$OUT"
STAGES="${STAGES:-tests bench}"
MODEL="${MODEL:-synthetic:llama3-8b:w4g128}"
export PYTHONPATH="$PWD:$PWD/tests:$PWD/benchmarks:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [[ $STAGES == *tests* ]]; then
  echo "== tests"
  timeout ${TEST_TIMEOUT:-240} python -m pytest -q -p no:cacheprovider tests/test_lora_epilogue.py \
      tests/test_lora_gpu.py tests/test_lora_kernel.py -k "not engine_gpu_path" > "$OUT/tests.txt" 2>&1
  tail -8 "$OUT/tests.txt"
fi
if [[ $STAGES == *bench* ]]; then
  echo "== throughput and decode"
  timeout ${BENCH_TIMEOUT:-420} python benchmarks/lora_throughput.py --model "$MODEL" --adapters "${ADAPTERS:-8}" \
      --rank "${RANK:-16}" --batch "${BATCH:-64}" ${PROFILE:+--profile} --out "$OUT/lora.json" > "$OUT/bench.txt" 2>&1
  grep -E "^(==|per token)" "$OUT/bench.txt"; tail -2 "$OUT/bench.txt" | cut -c1-300
fi
if [[ $STAGES == *slots* ]]; then
  echo "== slot kernels against the W4 GEMM"
  timeout ${SLOTS_TIMEOUT:-180} python benchmarks/lora_slots.py --rows "${SLOT_ROWS:-16,64,256}" \
      --block-n "${BLOCK_N:-256}" --out "$OUT/slots.json" > "$OUT/slots.txt" 2>&1
  grep -E "^\|" "$OUT/slots.txt"; tail -1 "$OUT/slots.txt"
fi
python - "$OUT" <<'PY'
import json, pathlib, sys
f = pathlib.Path(sys.argv[1]) / "lora.json"
if f.exists():
    r = json.loads(f.read_text())
    print(f"| {r['device']} | batch {r['batch']}: base {r['base_batch_tok_s']:.0f} tok/s, {r['adapters']} adapters "
          f"{r['lora_batch_tok_s']:.0f} ({r['batch_ratio']:.3f}x, target 0.85) | batch 1: base "
          f"{r['base_decode_tok_s']:.1f}, one adapter {r['lora_decode_tok_s']:.1f} ({r['decode_ratio']:.3f}x, "
          f"target 0.9) | batch prefill {r['batch_prefill_ratio']:.3f}x, decode steps "
          f"{r['batch_decode_ratio']:.3f}x | slots {r['lora_slot_bytes'] / 2**20:.0f} MiB |")
PY
