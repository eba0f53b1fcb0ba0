#!/usr/bin/env bash
# The server issue's GPU figures in one call: offline throughput of the Llama-3-8B-shaped W4 g128 model, then the
# same model behind `quanta serve`, driven by benchmarks/serving.py at several request rates up to saturation
# (all at once), the same 512-in / 128-out requests. A table last: output tokens/s per rate against offline,
# TTFT / TPOT percentiles, and CPU seconds per 1000 tokens of the load generator and of each server process.
# Both sides are timed warm, offline after an untimed pass of as many requests, the server after the lower rates,
# so neither pays Triton's compiles of new batch shapes inside its timed run; every pass and every rate draws its
# own random prompts, so none is served from the prefix cache.
source "$(dirname "$0")/gpu_env.sh"
MODEL=${MODEL:-synthetic:llama3-8b:w4g128}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
echo "== offline"
timeout ${OFFLINE_TIMEOUT:-200} python3 benchmarks/throughput.py --model "$MODEL" --num-prompts 1000 --input-len 512 \
  --output-len 128 --warmup-prompts 1000 --quiet --out "$OUT/offline.json" 2>&1 | grep -v '^loading' | tail -n 2
echo "== server"
python3 -m quanta.cli.main -q serve "$MODEL" --port 8000 > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 240); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; kill -0 $server 2>/dev/null || break; sleep 1; done
curl -sf http://127.0.0.1:8000/health >/dev/null || { echo "server did not start"; tail -n 20 "$OUT/server.log"; exit 1; }
seed=0
for spec in ${RATES:-8:160 16:320 32:640 48:960 inf:1000}; do
  rate=${spec%%:*} n=${spec##*:} seed=$((seed + 1))   # each rate its own prompts: no prefix-cache hits across rates
  timeout ${RATE_TIMEOUT:-100} python3 benchmarks/serving.py --num-prompts "$n" --request-rate "$rate" --input-len 512 \
    --output-len 128 --max-concurrency 1000 --seed $seed --server-pid $server --out "$OUT/serving-$rate.json" > /dev/null 2>&1 \
    || echo "rate $rate failed"
done
curl -s http://127.0.0.1:8000/metrics | grep -E '^quanta:(num_preemptions|request_success)' > "$OUT/server-metrics.txt"
kill $server; wait $server 2>/dev/null
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
offline = json.loads((out / "offline.json").read_text())["runs"][0]["output_tokens_per_s"]
rows = {"offline": {"output_throughput": offline}}
print(f"offline (LLM.generate, 1000 x 512/128): {offline:.1f} output tok/s")
print("rate      done  out tok/s  vs offline  TTFT med / p99 ms   TPOT med / p99 ms   CPU s/1k tokens: client | server procs")
for f in sorted(out.glob("serving-*.json"), key=lambda f: float(f.stem.split("-")[1])):
    r = json.loads(f.read_text())
    print(f"{f.stem.split('-')[1]:>6s} {r['completed']:5d}/{r['num_prompts']:<5d} {r['output_throughput']:8.1f} "
          f"{r['output_throughput'] / offline:9.1%}  {r['ttft']['median_ms']:8.1f} / {r['ttft']['p99_ms']:8.1f}"
          f"  {r['tpot']['median_ms']:7.2f} / {r['tpot']['p99_ms']:7.2f}   {r['client_cpu_s_per_1k_tokens']:.3f} | "
          + " ".join(f"{v:.3f}" for v in r["server_cpu_s_per_1k_tokens"].values()))
PY
