#!/usr/bin/env bash
# The acceptance table of `quanta quantize` (issue 27): each scheme on the default model (SmolLM2-135M
# Q4_1 GGUF), then `quanta validate` against the source's own weights dequantized to float32 (the GGUF
# itself under --kernel dequantized --dtype float32): perplexity, KL divergence, top-1 agreement over
# WINDOWS windows of 512 tokens of WikiText-2 test, the second half of each window scored.
#
#   bash benchmarks/quant_quality.sh                   # JSON per run in $OUT, the markdown table on stdout
#   WINDOWS=20 SAMPLES=32 OUT=/tmp/qq bash benchmarks/quant_quality.sh
#   LLMC_PY=/work/venv-fp8/bin/python bash benchmarks/quant_quality.sh   # + llm-compressor's FP8 (llmc_fp8.py)
#   SRC=/work/second GROUP=128 TEXT=eval.txt CALIB=calibration.txt SCHEMES="rtn awq gptq" \
#       bash benchmarks/quant_quality.sh      # another checkpoint (train_second_model.py), its own texts
#
# The default model's hidden_size 576 is not a multiple of 128 (576 = 4.5 x 128), so group 128 cannot tile the
# q/k/v/gate/up inputs: the integer schemes use group 64 (GROUP) on it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-benchmarks/results/quant-quality-$(date +%F)}
WINDOWS=${WINDOWS:-10}
SAMPLES=${SAMPLES:-32}
SEQLEN=${SEQLEN:-512}
SRC=${SRC:-$($PY -c "from quanta.cli.default_model import default_model_path; print(default_model_path())")}
GROUP=${GROUP:-64}
SCHEMES=${SCHEMES:-"rtn awq gptq gptq-act-order nf4 fp8 gptq-fp8 q8_0 q4_0 q4_k_m"}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$OUT" "$WORK"
EVAL=(--reference "$SRC" --windows "$WINDOWS" --ctx 512 --kernel dequantized --dtype float32 --no-layer-errors --json)
[[ -n "${TEXT:-}" ]] && EVAL+=(--text "$TEXT")
DATA=(--samples "$SAMPLES" --seqlen "$SEQLEN")
[[ -n "${CALIB:-}" ]] && DATA+=(--calibration "$CALIB")

run() {
    local scheme=$1 name=$2; shift 2
    [[ " $SCHEMES " == *" $scheme "* ]] || return 0
    local dst="$WORK/$name" data=()
    [[ " $* " == *" gguf "* ]] && dst="$dst.gguf"
    [[ " $* " == *" gguf "* || " $* " == *" rtn "* || " $* " == *" nf4 "* || " $* " == *"--method fp8"* ]] \
        || data=("${DATA[@]}")
    echo "== $name: quanta quantize $*" >&2
    $PY -m quanta.cli.main -q quantize "$SRC" "$@" "${data[@]}" --out "$dst" \
        --overwrite --json > "$OUT/$name.quantize.json"
    $PY -m quanta.cli.main -q validate "$dst" "${EVAL[@]}" > "$OUT/$name.validate.json"
    rm -rf "$dst"
}

$PY -m quanta.cli.main -q validate "$SRC" "${EVAL[@]}" > "$OUT/reference.validate.json"
run rtn rtn-w4g$GROUP --method rtn --group-size "$GROUP"
run awq awq-w4g$GROUP --method awq --group-size "$GROUP"
run gptq gptq-w4g$GROUP --method gptq --group-size "$GROUP"
run gptq-act-order gptq-w4g$GROUP-act-order --method gptq --group-size "$GROUP" --act-order
run nf4 nf4 --method nf4
run fp8 fp8 --method fp8
run gptq-fp8 gptq-fp8 --method gptq --scheme fp8
run q8_0 q8_0 --method gguf --type Q8_0
run q4_0 q4_0 --method gguf --type Q4_0
run q4_k_m q4_k_m --method gguf --type Q4_K_M

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
