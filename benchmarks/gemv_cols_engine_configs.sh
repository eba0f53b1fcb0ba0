# Decode tok/s of the Q4_K_M mix with the column GEMV's launch configs patched (gemv_cols.SMALL / LARGE), two
# alternating rounds: what the configs do inside the engine's chain of kernels, which ggml_gemm.py --sweep (alone) misses.
#   usage: bash benchmarks/gemv_cols_engine_configs.sh
source benchmarks/gpu_env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
M=synthetic:llama3-8b:gguf-q4_K_M
run() {
  staged 60 python3 -c "
import sys, runpy
from quanta.kernels.ggml import gemv_cols as g
from quanta.kernels.ggml.gemv import GemvConfig
g.SMALL, g.LARGE = GemvConfig(*$1), GemvConfig(*$2)
sys.argv = ['latency.py', '--model', '$M', '--output-len', '128', '--runs', '3']
runpy.run_path('benchmarks/latency.py', run_name='__main__')" 2>/dev/null | grep -o '"decode_tokens_per_s": [0-9.]*' | sed "s/^/small=$1 large=$2 /"
}
for rep in 1 2; do
  run "(256,2,16.0,1)" "(256,2,8.0,2)"
  run "(256,2,16.0,1)" "(256,2,16.0,1)"
  run "(256,2,32.0,1)" "(256,2,32.0,1)"
  run "(128,1,32.0,1)" "(256,2,16.0,1)"
done
