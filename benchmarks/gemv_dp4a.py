"""Q2_K, Q3_K (gemv_dp4a) and IQ4_NL, IQ4_XS (gemv_iq4) at M = 1 on the dp4a GEMVs against 8-bit activations
beside the GEMV the plan gives them without (gemv_cols' packed halves; IQ4's table GEMV, gemv.py), on the Llama-3 8B
shapes: µs of each (dp4a quantizing x in its programs, given x's codes, and quantize_rows alone as a launch), launch
configs of the dp4a GEMV, gate_up with the SwiGLU epilogue as the engine runs it, and each one's error against the
float32 product (the dp4a one's is x's rounding to 8 bits).
   usage: python3 benchmarks/gemv_dp4a.py --out gemv-dp4a.json [--types q2_K] [--configs '256,4,16,1;256,2,16,1']
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ggml_gemm import parse_configs, random_gguf  # noqa: E402
from linears import SHAPES, bench, copies, rel_norm_err, start_run, write_run  # noqa: E402

from quanta.kernels import activation, ggml_gemm  # noqa: E402
from quanta.kernels.ggml import gemv, gemv_cols, gemv_dp4a, gemv_iq4  # noqa: E402

CONFIGS = {"q": "256,4,16,1;256,2,16,1;128,4,16,1;256,4,8,1", "iq4": "32,4,8,2;64,4,8,2;128,4,8,2;64,4,16,1;128,8,8,2"}


def _kernels(name: str):
    """(the dp4a GEMV's module, the baseline's matmul(x, st, glu=False), x's quantize_rows) of a type."""
    if name.startswith("iq4"):
        def table(x, st, glu=False):
            y = gemv.matmul(x, st)
            return activation.silu_and_mul(y) if glu else y
        return gemv_iq4, table, lambda x: gemv_dp4a.quantize_rows(x, interleave=True)
    return gemv_dp4a, gemv_cols.matmul, gemv_dp4a.quantize_rows


def run_layer(name: str, layer: str, configs: tuple, copy_bw: float) -> dict:
    """One 8B layer's record in GGML type `name`: each kernel's µs, share of copy bandwidth and error."""
    n, k = SHAPES["8b"][layer]
    w = random_gguf(n, k, name)
    st = copies(lambda: ggml_gemm.prepare(w, torch.device("cuda"), torch.float16), w.nbytes)
    xs = [torch.randn(1, k, device="cuda").half() for _ in range(4)]
    ref = xs[0].float() @ w.dequantize(torch.float32).cuda().t()
    glu = layer == "gate_up"
    dp4a, base, quantize = _kernels(name)
    rec = {"type": name, "layer": layer, "n": n, "k": k, "bytes": w.nbytes}
    rec["err_cols"] = rel_norm_err(base(xs[0], st[0]), ref)
    rec["err_dp4a"] = rel_norm_err(dp4a.matmul(xs[0], st[0]), ref)
    assert rec["err_cols"] < 1e-2 and rec["err_dp4a"] < 2e-2, rec
    rec["cols_us"] = bench(lambda x, s: base(x, s), xs, st, w.nbytes)
    rec["dp4a_us"] = bench(lambda x, s: dp4a.matmul(x, s), xs, st, w.nbytes)
    quantized = [quantize(x) for x in xs]
    qx = [(x, q) for x, q in zip(xs, quantized)]
    rec["dp4a_given_us"] = bench(lambda xq, s: dp4a.matmul(xq[0], s, quantized=xq[1]), qx, st, w.nbytes)
    rec["quantize_us"] = bench(quantize, xs)
    for cfg in configs[name.startswith("iq4")]:
        rec[f"dp4a_{'_'.join(map(str, cfg))}_us"] = bench(
            lambda xq, s: dp4a.matmul(xq[0], s, None, cfg, quantized=xq[1]), qx, st, w.nbytes)
    if glu:
        small = xs[0] / 64                           # silu(gate) * up of random blocks' scales within fp16
        fused = dp4a.matmul(small, st[0], glu=True)
        assert rel_norm_err(fused, activation.silu_and_mul(dp4a.matmul(small, st[0]))) < 1e-2
        rec["cols_glu_us"] = bench(lambda x, s: base(x, s, glu=True), xs, st, w.nbytes)
        rec["dp4a_glu_us"] = bench(lambda x, s: dp4a.matmul(x, s, glu=True), xs, st, w.nbytes)
    for key in ("cols_us", "dp4a_given_us"):
        rec[key.replace("_us", "_of_copy")] = round(w.nbytes / rec[key] / 1e3 / copy_bw, 3)
    return {key: round(v, 2) if isinstance(v, float) and key.endswith("_us") else v for key, v in rec.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--types", default=",".join(gemv_dp4a.TYPES + gemv_iq4.TYPES))
    ap.add_argument("--layers", default=",".join(SHAPES["8b"]))
    ap.add_argument("--configs", default=CONFIGS["q"], help="Q2_K / Q3_K launch configs: ';'-separated ColsConfig "
                    "fields")
    ap.add_argument("--iq4-configs", default=CONFIGS["iq4"], help="IQ4 launch configs: GemvConfig fields")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0, meta = start_run()
    results = []
    for name in args.types.split(","):
        for layer in args.layers.split(","):
            configs = (parse_configs(args.configs), parse_configs(args.iq4_configs))
            results.append(run_layer(name, layer, configs, meta["copy_GBps"]))
            print(results[-1], flush=True)
    write_run(args.out, meta, t0, results=results)
    print(f"\n{meta['device']}  copy {meta['copy_GBps']:.0f} GB/s; M = 1, µs")
    print(f"{'type':>6} {'layer':>8} {'before':>7} {'dp4a':>7} {'given':>7} {'quant':>6} {'best cfg':>16} {'cols%':>6} "
          f"{'dp4a%':>6} {'err cols':>9} {'err dp4a':>9}")
    for r in results:
        best = min((key for key in r if key.startswith("dp4a_") and key.count("_") > 2), key=r.get)
        print(f"{r['type']:>6} {r['layer']:>8} {r['cols_us']:>7.1f} {r['dp4a_us']:>7.1f} {r['dp4a_given_us']:>7.1f} "
              f"{r['quantize_us']:>6.1f} {best[5:-3] + ' ' + str(r[best]):>16} {r['cols_of_copy']:>6.0%} "
              f"{r['dp4a_given_of_copy']:>6.0%} {r['err_cols']:>9.2e} {r['err_dp4a']:>9.2e}")
        if "cols_glu_us" in r:
            print(f"{'':>6} {'  +glu':>8} {r['cols_glu_us']:>7.1f} {r['dp4a_glu_us']:>7.1f}")


if __name__ == "__main__":
    main()
