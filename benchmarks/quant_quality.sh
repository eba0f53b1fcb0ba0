#!/usr/bin/env bash
# The acceptance table of `quanta quantize` (issue 27): each scheme on the default model (SmolLM2-135M
# Q4_1 GGUF), then `quanta validate` against the source's own weights dequantized to float32 (the GGUF
# itself under --kernel dequantized --dtype float32): perplexity, KL divergence, top-1 agreement over
# WINDOWS windows of 512 tokens of WikiText-2 test, the second half of each window scored.
#
#   bash benchmarks/quant_quality.sh                   # JSON per run in $OUT, the markdown table on stdout
#   WINDOWS=20 SAMPLES=32 OUT=/tmp/qq bash benchmarks/quant_quality.sh
#   LLMC_PY=/work/venv-fp8/bin/python bash benchmarks/quant_quality.sh   # + llm-compressor's FP8 (llmc_fp8.py)
#
# hidden_size 576 is not a multiple of 128 (576 = 4.5 x 128), so group 128 cannot tile the q/k/v/gate/up
# inputs: the integer schemes use group 64 on this model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-benchmarks/results/quant-quality-$(date +%F)}
WINDOWS=${WINDOWS:-10}
SAMPLES=${SAMPLES:-32}
SEQLEN=${SEQLEN:-512}
SRC=$($PY -c "from quanta.cli.default_model import default_model_path; print(default_model_path())")
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$OUT" "$WORK"
EVAL=(--reference "$SRC" --windows "$WINDOWS" --ctx 512 --kernel dequantized --dtype float32 --no-layer-errors --json)

run() {
    local name=$1; shift
    local dst="$WORK/$name"
    [[ " $* " == *" gguf "* ]] && dst="$dst.gguf"
    echo "== $name: quanta quantize $*" >&2
    $PY -m quanta.cli.main -q quantize "$SRC" "$@" --samples "$SAMPLES" --seqlen "$SEQLEN" --out "$dst" \
        --overwrite --json > "$OUT/$name.quantize.json"
    $PY -m quanta.cli.main -q validate "$dst" "${EVAL[@]}" > "$OUT/$name.validate.json"
    rm -rf "$dst"
}

$PY -m quanta.cli.main -q validate "$SRC" "${EVAL[@]}" > "$OUT/reference.validate.json"
run rtn-w4g64 --method rtn --group-size 64
run awq-w4g64 --method awq --group-size 64
run gptq-w4g64 --method gptq --group-size 64
run gptq-w4g64-act-order --method gptq --group-size 64 --act-order
run nf4 --method nf4
run fp8 --method fp8
run gptq-fp8 --method gptq --scheme fp8
run q8_0 --method gguf --type Q8_0
run q4_0 --method gguf --type Q4_0
run q4_k_m --method gguf --type Q4_K_M

if [[ -n "${LLMC_PY:-}" ]]; then     # the outside baseline: llm-compressor on the same float32 weights and windows
    $PY -m quanta.cli.main -q convert "$SRC" --to hf --dtype float32 --out "$WORK/hf32" --no-validate --force
    $PY -c "import sys, torch; from quanta.loaders import load; from quanta.quant.calibration import load_calibration
torch.save(load_calibration(load(sys.argv[1]).tokenizer, n_samples=$SAMPLES, seqlen=$SEQLEN).tokens, sys.argv[2])" \
        "$SRC" "$WORK/calibration.pt"
    for mode in rtn gptq; do
        echo "== llm-compressor FP8_DYNAMIC $mode" >&2
        $LLMC_PY benchmarks/llmc_fp8.py "$WORK/hf32" "$WORK/llmc-$mode" $mode "$OUT/llmc-fp8-$mode.quantize.json" \
            "$WORK/calibration.pt" >&2
        $PY -m quanta.cli.main -q validate "$WORK/llmc-$mode" "${EVAL[@]}" > "$OUT/llmc-fp8-$mode.validate.json"
        rm -rf "$WORK/llmc-$mode"
    done
    rm -rf "$WORK/hf32"
fi

$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
ref = json.loads((out / "reference.validate.json").read_text())
print("| scheme | bits/weight (linears) | size MiB | quantize s | perplexity | Δ ppl | KL | top-1 |")
print("|---|---|---|---|---|---|---|---|")
print(f"| reference (source, float32) | | | | {ref['perplexity']:.3f} | | | |")
for q in sorted(out.glob("*.quantize.json")):
    name = q.name.removesuffix(".quantize.json")
    s, v = json.loads(q.read_text()), json.loads((out / f"{name}.validate.json").read_text())
    print(f"| {s['scheme']} | {s['linear_bits_per_weight']:.3f} | {s['bytes_on_disk'] / 2**20:.1f} | "
          f"{s['seconds']:.0f} | {v['perplexity']:.3f} | {100 * (v['perplexity'] / ref['perplexity'] - 1):+.2f}% | "
          f"{v['kl']['mean']:.4f} | {v['kl']['top1_agreement']:.3f} |")
EOF
