"""GEMV launch configs for the mid-size Llama shapes at M = 1, each timed twice (graphed), with its error against
the dequantized weight: OUT=dir python benchmarks/probes/gemv_config_probe.py
(CFGS='[[256, 4, 2, 8.0, 2], ...]' and REPS=3 in the environment replace the configs and the two repetitions,
BITS=8 times int8 codes, GROUP=-1 per-channel scales, WEIGHTS=nf4 bnb NF4 codes (blocks of 64), LAYERS='8b qkv,8b o'
other shapes)"""
import json
import os
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import bench, copy_bandwidth, m1_cases, parse_layers, rel_norm_err  # noqa: E402

from quanta.kernels.affine_gemv import gemv  # noqa: E402

# (BLOCK_N, word rows per step, num_warps, waves, least K tiles per split); the first is the default
CFGS = [(256, 4, 2, 8.0, 2), (256, 4, 2, 8.0, 3), (256, 4, 2, 8.0, 4), (256, 4, 2, 6.0, 2), (256, 4, 2, 10.0, 2),
        (256, 4, 2, 12.0, 1), (256, 2, 2, 8.0, 2), (256, 8, 2, 8.0, 2), (512, 4, 4, 8.0, 2), (256, 4, 2, 4.0, 4)]
CFGS = [tuple(c) for c in json.loads(os.environ["CFGS"])] if "CFGS" in os.environ else CFGS
bw = copy_bandwidth()
out = []
BITS = int(os.environ.get("BITS", 4))
GROUP = int(os.environ.get("GROUP", 128))
LAYERS = parse_layers(os.environ.get("LAYERS", "8b down,70b o,70b qkv,8b gate_up"))
WEIGHTS = os.environ.get("WEIGHTS", "affine")
for model, layer, n, k, w, sts, xs, ref in m1_cases(LAYERS, BITS, GROUP, WEIGHTS):
    for rep in range(int(os.environ.get("REPS", 2))):
        for cfg in CFGS:
            err = rel_norm_err(gemv(xs[0], sts[0], config=cfg), ref)
            us = bench(lambda x, st: gemv(x, st, config=cfg), xs, sts, w.nbytes)
            out.append({"shape": f"{model} {layer}", "config": cfg, "rep": rep, "us": round(us, 2), "rel_err": err})
Path(os.environ["OUT"] + "/gemv_cfg.json").write_text(json.dumps({"copy_GBps": bw, "bits": BITS, "group": GROUP,
                                                                 "weights": WEIGHTS, "results": out}))
for shape in dict.fromkeys(r["shape"] for r in out):
    print(shape, " ".join(f"{'_'.join(map(str, c))}:" + "/".join(str(r["us"]) for r in out if r["shape"] == shape and tuple(r["config"]) == c) for c in CFGS))
print("max rel err", max(r["rel_err"] for r in out))
