#!/usr/bin/env bash
# FP8 W8A8 quality on a GPU (issue 42): the checkpoint SRC quantized to FP8 (`quanta quantize --method fp8`, per-channel
# e4m3 weights, per-token dynamic e4m3 activations), and SRC itself, each scored by `quanta validate` on the GPU in
# float16 against REF, a reference saved on the CPU in float32 (`quanta validate SRC --kernel dequantized --dtype
# float32 --save-reference REF`). A 512-token window runs the W8A8 tensor-core GEMMs, so their activation rounding
# is in the figure; the CPU's FP8 path is weight-only. No network. JSON in $OUT; a table last.
#   SRC=.carry/fp8q/second REF=.carry/fp8q/second-ref.pt TEXT=.carry/fp8q/second/eval.txt \
#       bash benchmarks/fp8_quality_gpu.sh
source "$(dirname "$0")/gpu_env.sh"
SRC=${SRC:?a checkpoint directory}; REF=${REF:?a reference file}; TEXT=${TEXT:?a text file}
WINDOWS=${WINDOWS:-20}
WORK=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -m quanta.cli.main -q quantize "$SRC" --method fp8 --out "$WORK/fp8" --json > "$OUT/fp8.quantize.json"
for name in fp16 fp8; do
    model=$SRC; [[ $name == fp8 ]] && model=$WORK/fp8
    python -m quanta.cli.main -q validate "$model" --reference "$REF" --text "$TEXT" --windows "$WINDOWS" \
        --device cuda --dtype float16 --no-layer-errors --json > "$OUT/$name.validate.json"
done
python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| weights (GPU, float16) | perplexity | reference | KL | top-1 |")
print("|---|---|---|---|---|")
for name in ("fp16", "fp8"):
    r = json.loads((out / f"{name}.validate.json").read_text())
    print(f"| {name} | {r['perplexity']:.3f} | {r['reference_perplexity']:.3f} | {r['kl']['mean']:.5f} | "
          f"{r['kl']['top1_agreement']:.4f} |")
PY
