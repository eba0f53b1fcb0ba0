# fp16 8-bit codes (Q8_0) above M = 128 on the weights wider than deep (qkv, gate_up): the wgmma kernel against the
# MMA kernel per shape at M = 96..256 on the 8B and 70B shapes (crossover.py), then offline Q8_0 1000 x 512/128 with
# plan.WGMMA_EIGHT_BIT_WIDE_MAX_M at 256 (as built: wgmma to 256 everywhere) and 128, alone and with
# wgmma.EIGHT_BIT_BLOCKS = 2, w4g128 beside them; last the two-bit K-quant GEMVs' launch configs at M = 1.
#   usage: bash benchmarks/eight_bit_wide.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
T0=$(date +%s)
staged 100 python3 benchmarks/crossover.py --types q8_0 --ms 96,128,192,256 --out "$OUT/q8-wide-8b.json" 2>&1 \
  | tail -n 5
staged 120 python3 benchmarks/crossover.py --types q8_0 --model 70b --ms 128,256 --out "$OUT/q8-wide-70b.json" 2>&1 \
  | tail -n 3
python3 - "$OUT"/q8-wide-8b.json "$OUT"/q8-wide-70b.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    for r in json.load(open(f))["results"]:
        print(r["model"], r["layer"], r["m"], "wgmma", r.get("wgmma_us"), "mma", r.get("mma_us"), "fp16", r["fp16_us"])
PY
echo "T=$(( $(date +%s) - T0 ))"
WIDE="quanta.kernels.affine.plan:WGMMA_EIGHT_BIT_WIDE_MAX_M=128"
staged 330 python3 benchmarks/engine_configs.py --bench throughput --model synthetic:llama3-8b:gguf-q8_0 \
  --input-len 512 --output-len 128 --rounds 2 --variant "" --variant "$WIDE" \
  --variant "$WIDE; quanta.kernels.affine.wgmma:EIGHT_BIT_BLOCKS=2" \
  --timeout 150 --out "$OUT/q8-wide-throughput.json" 2>&1 | tail -n 7
staged 100 python3 benchmarks/engine_configs.py --bench throughput --model synthetic:llama3-8b:w4g128 \
  --input-len 512 --output-len 128 --rounds 1 --variant "" --timeout 90 --out "$OUT/w4-throughput.json" 2>&1 \
  | tail -n 2
echo "T=$(( $(date +%s) - T0 ))"
staged 60 python3 benchmarks/ggml_gemm.py --types q2_K,q3_K --ms 1 --layers gate_up,down --sweep \
  --sweep-configs "256,4,16,1,1;256,4,8,1,1;256,4,8,1,2;256,4,12,1,1;512,4,8,1,1;128,4,16,1,1;128,2,16,1,1" \
  --out "$OUT/q23-configs.json" > "$OUT/q23-configs.log" 2>&1
python3 - "$OUT/q23-configs.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["type"], r["layer"], "planned", r["ggml_us"], {k[5:-3]: v for k, v in r.items() if k.startswith("cols_")})
PY
echo "T=$(( $(date +%s) - T0 ))"
