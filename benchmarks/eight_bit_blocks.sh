# fp16 8-bit codes on the wgmma kernel, K tiles of one word block (64 columns) against two (wgmma.EIGHT_BIT_BLOCKS,
# 128 columns: half the tile's waits and barriers a column): the 8-bit GPU tests in both settings, Q8_0's paths at
# M = 16 / 64 / 256 in each (ggml_gemm.py --as-loaded --paths, checked against cuBLAS first), offline Q8_0 1000 x
# 512/128 in each (engine_configs.py --bench throughput), then w4g128 offline with the unsplit batch decode in 4
# warps against 8 (paged_attention.DECODE_WARPS_UNSPLIT).
#   usage: bash benchmarks/eight_bit_blocks.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
T0=$(date +%s)
tests_pass tests 200 -m gpu tests/test_affine_wgmma.py -k eight_bit -x
echo "T=$(( $(date +%s) - T0 ))"
for blocks in 1 2; do
  staged 90 python3 -c "
import runpy, sys
import quanta.kernels.affine.wgmma as w
w.EIGHT_BIT_BLOCKS = $blocks
sys.argv = ['ggml_gemm.py', '--types', 'q8_0', '--ms', '16,64,256', '--as-loaded', '--paths',
            '--out', '$OUT/q8-blocks$blocks.json']
runpy.run_path('benchmarks/ggml_gemm.py', run_name='__main__')" > "$OUT/q8-blocks$blocks.log" 2>&1
  python3 - "$OUT/q8-blocks$blocks.json" $blocks <<'PY'
import json, sys, collections
t = collections.defaultdict(lambda: collections.defaultdict(float))
for r in json.load(open(sys.argv[1]))["results"]:
    print("blocks", sys.argv[2], r["layer"], r["m"], "wgmma", r.get("wgmma_us"), "mma", r.get("mma_us"),
          "fp16", r["fp16_us"])
    for k in ("wgmma_us", "mma_us", "fp16_us"): t[r["m"]][k] += r.get(k) or 0
for m, v in t.items(): print("SUM blocks", sys.argv[2], m, {k: round(x, 1) for k, x in v.items()})
PY
done
echo "T=$(( $(date +%s) - T0 ))"
staged 330 python3 benchmarks/engine_configs.py --bench throughput --model synthetic:llama3-8b:gguf-q8_0 \
  --input-len 512 --output-len 128 --rounds 1 --variant "" --variant "quanta.kernels.affine.wgmma:EIGHT_BIT_BLOCKS=2" \
  --timeout 150 --out "$OUT/q8-blocks-throughput.json" 2>&1 | tail -n 3
# w4g128 beside it, and whether the unsplit batch decode wants 8 warps too (f1ca307 kept it at 4)
staged 330 python3 benchmarks/engine_configs.py --bench throughput --model synthetic:llama3-8b:w4g128 \
  --input-len 512 --output-len 128 --rounds 1 --variant "" \
  --variant "quanta.kernels.paged_attention:DECODE_WARPS_UNSPLIT=8" --timeout 150 \
  --out "$OUT/w4-unsplit-warps-throughput.json" 2>&1 | tail -n 3
echo "T=$(( $(date +%s) - T0 ))"
