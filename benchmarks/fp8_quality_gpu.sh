#!/usr/bin/env bash
# FP8 W8A8 quality on a GPU (issue 42): each MODELS entry (name=checkpoint; for FP8 `quanta quantize --method fp8`'s
# output: per-channel e4m3 weights, per-token dynamic e4m3 activations) scored by `quanta validate` on the GPU in
# float16 against REF, a reference saved on the CPU in float32 (`quanta validate SRC --kernel dequantized --dtype
# float32 --save-reference REF`), twice: with the engine's kernels (a 512-token window runs the W8A8 tensor-core
# GEMMs, activations rounded to e4m3 per token) and with --kernel dequantized (the weights in float16, activations
# kept): the difference is the activation rounding. No network. JSON in $OUT; a table last.
#   MODELS="fp8=.carry/fp8q/second-fp8" REF=.carry/fp8q/second-ref.pt TEXT=.carry/fp8q/eval.txt \
#       bash benchmarks/fp8_quality_gpu.sh
source "$(dirname "$0")/gpu_env.sh"
MODELS=${MODELS:?name=checkpoint ...}; REF=${REF:?a reference file}; TEXT=${TEXT:?a text file}
WINDOWS=${WINDOWS:-20}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
for entry in $MODELS; do
    python -m quanta.cli.main -q inspect "${entry#*=}" --device cuda > "$OUT/${entry%%=*}.inspect.txt" 2>&1
    for kernel in auto dequantized; do
        python -m quanta.cli.main -q validate "${entry#*=}" --reference "$REF" --text "$TEXT" --windows "$WINDOWS" \
            --device cuda --dtype float16 --kernel $kernel --no-layer-errors --json \
            > "$OUT/${entry%%=*}-$kernel.validate.json"
    done
done
python - "$OUT" $MODELS <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| weights (GPU, float16) | kernel | perplexity | reference | KL | top-1 |")
print("|---|---|---|---|---|---|")
for entry in sys.argv[2:]:
    for kernel in ("auto", "dequantized"):
        name = entry.split("=")[0]
        r = json.loads((out / f"{name}-{kernel}.validate.json").read_text())
        print(f"| {name} | {kernel} | {r['perplexity']:.3f} | {r['reference_perplexity']:.3f} | "
              f"{r['kl']['mean']:.5f} | {r['kl']['top1_agreement']:.4f} |")
PY
