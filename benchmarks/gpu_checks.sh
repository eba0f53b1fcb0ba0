#!/usr/bin/env bash
# The GPU tests, on this chip and as older chips: every `-m gpu` test with the device's own capabilities, then
# the engine, attention and kernel-plan tests under QUANTA_DEVICE_CAPS=sm80 and sm75 (fp16; the FP8 KV cache
# read by bit operations; no bf16, wgmma or PDL on sm75), with the affine plan's path at each M printed for
# each chip. No network; the gguf package comes as a wheel in .whl/ when the machine lacks it.
#   usage: bash benchmarks/gpu_checks.sh            (CAPS="sm80 sm75" TESTS=... to narrow)
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
echo "== every GPU test, device capabilities"
timeout ${ALL_TIMEOUT:-420} python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 15
for caps in ${CAPS:-sm80 sm75}; do
  echo "== QUANTA_DEVICE_CAPS=$caps"
  QUANTA_DEVICE_CAPS=$caps python3 - <<'PY'
import torch
from quanta.kernels import affine
from quanta.kernels.device_caps import device_caps
from quanta.quant.kinds import Affine
caps = device_caps("cuda")
for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
    w = Affine(codes=torch.randint(0, 16, (n, k), dtype=torch.uint8), scales=torch.rand(n, k // 128).half(),
               bits=4, group_size=128, zeros=8)
    st = affine.prepare(w, torch.device("cuda"), torch.float16)
    print(caps.name, f"{n}x{k}", {m: affine.path(st, m)[0].split("/")[1] for m in (1, 2, 16, 64, 256, 1024)})
PY
  QUANTA_DEVICE_CAPS=$caps timeout ${CAPS_TIMEOUT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_engine_gpu.py tests/test_paged_attention.py tests/test_affine_gguf.py 2>&1 | tee "$OUT/gpu-tests-$caps.log" | tail -n 6
done
