"""The MMA kernel's default path at the Llama-3-8B / 70B shapes, graphed: one variant of the code per run, for A/B
comparisons in one device call (results/mma-pdl-h100-2026-11-25.json compared three placements of the PDL release,
each then selected by a temporary environment switch).
    python benchmarks/probes/mma_pdl.py --ms 4,16,32,64 --out x.json"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import bench, w4_shapes  # noqa: E402

from quanta.kernels import affine_mma  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--ms", default="4,16,32,64")
ap.add_argument("--out", required=True)
args = ap.parse_args()
rows = []
for model, layer, n, k, w4, st4, _ in w4_shapes("8b,70b"):
    for m in map(int, args.ms.split(",")):
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
        us = bench(lambda x, st: affine_mma.matmul(x, st), xs, st4, w4.nbytes)
        rows.append({"model": model, "layer": layer, "m": m, "us": round(us, 2)})
print(" ".join(f"{r['model']}-{r['layer']}-{r['m']}:{r['us']}" for r in rows))
Path(args.out).write_text(json.dumps(rows))
