# The unsplit decode launch (batches of 33 and more on 132 SMs: one program a sequence and kv head) with its next
# step's K / V loaded before this step's arithmetic (paged_attention.DECODE_PREFETCH_UNSPLIT), in its 4 warps and
# in 8, against as built: the attention tests on the GPU, then offline 1000 x 512/128 w4g128 output tok/s
# (engine_configs.py --bench throughput, fp16 KV), the variants alternating round after round.
#   usage: [ROUNDS=1] [ARGS="--kv-cache-dtype fp8 --max-num-seqs 1024"] bash benchmarks/unsplit_prefetch.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
tests_pass attention-tests 120 tests/test_paged_attention.py
P=quanta.kernels.paged_attention
staged 560 python3 benchmarks/engine_configs.py --bench throughput --model synthetic:llama3-8b:w4g128 \
  --input-len 512 --output-len 128 --num-prompts 1000 --rounds "${ROUNDS:-1}" --timeout 150 --variant "" \
  --variant "$P:DECODE_PREFETCH_UNSPLIT=True" --variant "$P:DECODE_PREFETCH_UNSPLIT=True; $P:DECODE_WARPS_UNSPLIT=8" \
  --out "$OUT/unsplit-prefetch-throughput.json" ${ARGS:-} 2>&1 | grep "tok/s"
