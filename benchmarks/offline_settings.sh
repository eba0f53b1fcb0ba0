# Offline 1000 x 512/128 output tok/s by format, KV cache dtype and the engine's step budgets (max_num_seqs,
# max_num_batched_tokens), after the ceiling those runs are measured against (offline_ceiling.py); a table last.
#   usage: [FORMATS="w4g128 fp8"] [KV="auto fp8"] [SETTINGS="256,8192 1024,16384"] [CEILING=1] [PROFILE=0] \
#          bash benchmarks/offline_settings.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
[ "${CEILING:-1}" = 1 ] && staged 150 python3 benchmarks/offline_ceiling.py --out "$OUT/offline-ceiling.json" \
  2>&1 | grep -v '^{'
for fmt in ${FORMATS:-w4g128 fp8}; do
  for s in ${SETTINGS:-256,8192 1024,16384}; do
    seqs=${s%,*} tokens=${s#*,}
    staged 300 python3 benchmarks/throughput.py --model "synthetic:llama3-8b:$fmt" --num-prompts 1000 \
      --input-len 512 --output-len 128 --kv-cache-dtype ${KV:-auto fp8} --max-num-seqs "$seqs" \
      --max-num-batched-tokens "$tokens" --profile "${PROFILE:-0}" --quiet \
      --out "$OUT/offline-$fmt-$seqs-$tokens.json" 2>&1 | grep -v '^{' | tail -n 30
  done
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| format | max_num_seqs | batched tokens | KV | output tok/s | KV capacity | preemptions | late compiles |")
print("|---|---|---|---|---|---|---|---|")
for f in sorted(Path(sys.argv[1]).glob("offline-*-*-*.json")):
    fmt, seqs, tokens = f.stem.removeprefix("offline-").rsplit("-", 2)
    for r in json.loads(f.read_text())["runs"]:
        print(f"| {fmt} | {seqs} | {tokens} | {r['kv_cache_dtype']} | {r['output_tokens_per_s']:,} | "
              f"{r['kv_capacity_tokens']:,} | {r['preemptions']} | {len(r['compiled_during_run'])} |")
PY
