"""GGUF K-quant and IQ4 linears at their file's bytes (the ggml kernels) against cuBLAS on the dequantized fp16
weight and the W4A16 g128 affine kernels, on the Llama-3-8B shapes, with the copy bandwidth measured in the same run.

    python benchmarks/ggml_gemm.py --out benchmarks/results/ggml-gemm-h200.json [--types q4_K,q6_K]
                                   [--ms 1,16,256,2048] [--layers qkv,o,gate_up,down] [--paths]

Weights are random valid blocks (random bytes, the fp16 d / dmin fields small and finite), made on the GPU. Each
timing is linears.py's: the median of CUDA-event-timed CUDA graph replays after a warm-up, rotating over enough
weight copies that the L2 holds none between two uses. Every kernel's output is first checked against the cuBLAS
product of the dequantized weight (1% relative). GB/s counts the weight's stored bytes (GgmlState.nbytes, the
file's) at M = 1, and its share of the copy bandwidth. `--paths` also times each of the ggml paths forced at every
M up to 16, to place the plan's GEMV threshold; `--sweep` the packed-half GEMV's launch configs at M = 1;
`--wgmma-configs` the wgmma path's at M >= 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from linears import SHAPES, affine_w, bench, check_close, copies, prepared_copies, start_run, write_run  # noqa: E402

from quanta.kernels import ggml_gemm, registry  # noqa: E402
from quanta.kernels.affine import plan as affine_plan  # noqa: E402
from quanta.kernels.device_caps import device_caps  # noqa: E402
from quanta.kernels.ggml import gemv_cols, mma, plan, wgmma  # noqa: E402
from quanta.quant.ggml.types import GGML_TYPES_BY_NAME  # noqa: E402
from quanta.quant.kinds.gguf import Gguf  # noqa: E402

TYPES = ("q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs")
# the Llama-3-8B GEMMs, and k (or v) alone: a Q4_K_M mix runs q, k, v apart where v is another type (--layers kv)
LAYERS = {**SHAPES["8b"], "kv": (1024, 4096)}
# Byte offsets of each type's fp16 fields (d, and dmin / m), from ggml-common.h: random bytes there could be inf.
FP16_FIELDS = {"q2_K": (80, 82), "q3_K": (108,), "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,), "iq4_nl": (0,),
               "iq4_xs": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,)}


def random_gguf(n: int, k: int, name: str, seed: int = 0) -> Gguf:
    """Random valid blocks [n, k] of GGML type `name` on the GPU, each fp16 field in +-[2**-9, 2**-8]."""
    t = GGML_TYPES_BY_NAME[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // t.block_size, t.type_size), generator=g, device="cuda", dtype=torch.uint8)
    for at in FP16_FIELDS[name]:
        half = (torch.rand(n, k // t.block_size, 1, generator=g, device="cuda") * 0.5 + 0.5) * 2.0 ** -8
        half = half * (torch.randint(0, 2, half.shape, generator=g, device="cuda") * 2 - 1)
        raw[:, :, at:at + 2] = half.half().view(torch.uint8)
    return Gguf(data=raw.reshape(n, -1), ggml_type=t.id, shape=(n, k))


def timed(fn, xs: list[torch.Tensor], weights: list, nbytes: int, ref: torch.Tensor, what: str) -> float:
    """bench's median µs of fn(x, w), once fn's output for xs[0] matched `ref`."""
    check_close(fn(xs[0], weights[0]), ref, what)
    return round(bench(fn, xs, weights, nbytes), 2)


# Launch configs (BLOCK_N, warps, waves, min tiles, chunks) --sweep times for the packed-half GEMV (gemv_cols) at
# M = 1: the launch shapes at one, two and four K-loop steps an iteration (Q6_K takes at most two).
COLS_SWEEP = tuple(cfg + (chunks,) for cfg in ((256, 2, 16.0, 1), (256, 2, 8.0, 2), (256, 2, 32.0, 1),
                                               (128, 1, 16.0, 1), (128, 2, 16.0, 1), (256, 4, 16.0, 1),
                                               (512, 4, 16.0, 1)) for chunks in (1, 2, 4))


def run_type(name: str, layers: list[str], ms: list[int], paths: bool, results: list, w4: dict, w4_us: dict,
             sweep: tuple = (), as_loaded: bool = False, wgmma_sweep: tuple = ()) -> None:
    """Time the ggml kernels on GGML type `name` at each layer shape and M, beside cuBLAS and the W4A16 kernels
    (`w4`: layer -> (the affine weight, its prepared copies); `w4_us` caches their times by (layer, M)).
    `as_loaded`: the kernels the registry gives the type instead (the affine ones for Q4_0 .. Q8_0, the codebook
    ones for IQ4_NL), as a model's load would. `wgmma_sweep`: WgmmaConfig fields timed on the wgmma path at every
    M >= 2 where it runs."""
    for layer in layers:
        n, k = LAYERS[layer]
        w = random_gguf(n, k, name)
        module = registry.select(w, torch.device("cuda"), torch.float16)[0] if as_loaded else ggml_gemm
        st = copies(lambda: module.prepare(w, torch.device("cuda"), torch.float16), w.nbytes)
        dense = copies(lambda: w.dequantize(torch.float16), 2 * n * k)
        for m in ms:
            xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
            ref = xs[0].float() @ dense[0].float().t()
            rec = {"type": name, "layer": layer, "n": n, "k": k, "m": m, "bytes": w.nbytes,
                   "kernel": module.NAME, "path": module.path(st[0], m)[0].rpartition("/")[2]}
            rec["ggml_us"] = timed(module.apply, xs, st, w.nbytes, ref, f"{name} {layer} M={m}")
            rec["fp16_us"] = timed(lambda x, d: x @ d.t(), xs, dense, 2 * n * k, ref, "cuBLAS")
            if paths and m <= 16 and module is ggml_gemm:
                for path in plan.TABLE.by_name:
                    kernel = {"gemv_cols": gemv_cols, "mma": mma, "wgmma": wgmma}.get(path)
                    if kernel is not None and kernel.applies(st[0], device_caps("cuda")) is not None:
                        continue
                    rec[f"{path}_us"] = timed(lambda x, s: plan.matmul(x, s, path=path), xs, st, st[0].nbytes,
                                              ref, f"{name} {layer} M={m} {path}")
            if paths and as_loaded and module.NAME == "triton_affine":
                caps = device_caps("cuda")
                for p in affine_plan.TABLE.paths:
                    if p.name in ("wgmma", "mma") and p.fits(st[0], caps, m) is None:
                        rec[f"{p.name}_us"] = timed(lambda x, s: affine_plan.matmul(x, s, path=p.name), xs, st,
                                                    w.nbytes, ref, f"{name} {layer} M={m} {p.name}")
            if module is ggml_gemm and sweep and m == 1 and gemv_cols.applies(st[0]) is None:
                for cfg in sweep:
                    rec[f"cols_{'_'.join(map(str, cfg))}_us"] = timed(
                        lambda x, s: gemv_cols.matmul(x, s, None, cfg), xs, st, st[0].nbytes, ref, f"cols {cfg}")
            if module is ggml_gemm and wgmma_sweep and m >= 2 and wgmma.applies(st[0], device_caps("cuda")) is None:
                for cfg in wgmma_sweep:
                    try:
                        rec[f"wgmma_{'_'.join(map(str, cfg))}_us"] = timed(
                            lambda x, s: wgmma.matmul(x, s, None, cfg), xs, st, st[0].nbytes, ref, f"wgmma {cfg}")
                    except OutOfResources as e:           # a config whose stages outgrow shared memory
                        print(f"wgmma {cfg}: {e}", flush=True)
            if (layer, m) not in w4_us:                   # the W4A16 g128 kernels on the same shape, once a run
                weight, states = w4[layer]
                w4_us[(layer, m)] = round(bench(affine_plan.matmul, xs, states, weight.nbytes), 2)
            rec["w4a16_us"] = w4_us[(layer, m)]
            rec["ggml_GBps"] = round(rec["bytes"] / rec["ggml_us"] / 1e3, 1)
            results.append(rec)
            print(rec, flush=True)
        del st, dense
        torch.cuda.empty_cache()


def summary(meta: dict, results: list[dict]) -> None:
    bw = meta["copy_GBps"]
    print(f"\n{meta['device']}  copy {bw:.0f} GB/s  (x16 = speed-up over fp16 cuBLAS on the dequantized weight; "
          "xw4 = over the W4A16 g128 affine kernels; share = weight bytes / µs against the copy, at M = 1)")
    print(f"{'type':>7} {'layer':>8} {'M':>5} {'path':>5} {'ggml us':>9} {'fp16 us':>9} {'w4a16 us':>9} "
          f"{'x16':>6} {'xw4':>6} {'GB/s':>7} {'share':>6}")
    for r in results:
        share = f"{r['ggml_GBps'] / bw:>6.0%}" if r["m"] == 1 else f"{'':>6}"
        gbps = f"{r['ggml_GBps']:>7.0f}" if r["m"] == 1 else f"{'':>7}"
        print(f"{r['type']:>7} {r['layer']:>8} {r['m']:>5} {r['path']:>5} {r['ggml_us']:>9.1f} {r['fp16_us']:>9.1f} "
              f"{r['w4a16_us']:>9.1f} {r['fp16_us'] / r['ggml_us']:>6.2f} {r['w4a16_us'] / r['ggml_us']:>6.2f} "
              f"{gbps} {share}")


def config_sums(results: list[dict]) -> None:
    """Each swept wgmma config's µs summed over the layers, by type and M, against fp16's sum and the plan's."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["type"], r["m"]), []).append(r)
    for (name, m), rows in groups.items():
        keys = sorted({k for r in rows for k in r if k.startswith("wgmma_")})
        if not keys:
            continue
        fp16, planned = sum(r["fp16_us"] for r in rows), sum(r["ggml_us"] for r in rows)
        print(f"\n{name} M = {m} over {len(rows)} layers: fp16 {fp16:.1f} µs; planned {planned:.1f} µs "
              f"({fp16 / planned:.2f}x)")
        for key in keys:
            if all(key in r for r in rows):
                total = sum(r[key] for r in rows)
                print(f"  {key[6:-3]:>24} {total:>8.1f} µs {fp16 / total:>6.2f}x  "
                      + " / ".join(f"{r[key]:.1f}" for r in rows))


def profile(name: str = "q4_K") -> None:
    """GGML type `name`'s gate/up at M = 1 on its planned GEMV, then the W4A16 g128 GEMV on the same shape: three
    calls each."""
    n, k = SHAPES["8b"]["gate_up"]
    st = ggml_gemm.prepare(random_gguf(n, k, name), torch.device("cuda"), torch.float16)
    w4 = prepared_copies(affine_w(n, k, 4, 128))[0]
    x = torch.randn(1, k, device="cuda").half()
    for _ in range(3):
        plan.matmul(x, st)
    for _ in range(3):
        affine_plan.matmul(x, w4)
    torch.cuda.synchronize()


def parse_configs(spec: str) -> tuple:
    """Launch configs from ';'-separated comma lists of their fields (the third, waves, a float)."""
    return tuple(tuple(float(v) if i == 2 else int(v) for i, v in enumerate(c.split(","))) for c in spec.split(";"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--layers", default=",".join(SHAPES["8b"]))
    ap.add_argument("--ms", default="1,16,256,2048")
    ap.add_argument("--paths", action="store_true", help="also time each ggml path forced, at M <= 16 (with "
                    "--as-loaded: the affine wgmma and MMA paths forced, at every M where they run)")
    ap.add_argument("--sweep", action="store_true", help="also time the packed-half GEMV's launch configs at M = 1")
    ap.add_argument("--sweep-configs", help="with --sweep, these configs instead of COLS_SWEEP: ';'-separated "
                    "ColsConfig fields, e.g. '256,2,16,1,2,2;256,2,16,1,1,4'")
    ap.add_argument("--wgmma-configs", help="also time the wgmma path at each M >= 2 in these configs: "
                    "';'-separated WgmmaConfig fields (block_m, stages, waves, min tiles, rows, lag, warps), "
                    "e.g. '16,3,3.0,2,256,2,4'")
    ap.add_argument("--as-loaded", action="store_true", help="time the kernels the registry gives each type (the "
                    "affine ones for Q4_0 .. Q8_0, the codebook ones for IQ4_NL) instead of the ggml ones")
    ap.add_argument("--profile", nargs="?", const="q4_K", default=None, metavar="TYPE",
                    help="only run TYPE's (default Q4_K) gate/up at M = 1 on its GEMV and the W4A16 kernels, three "
                    "calls each, ungraphed (for ncu --kernel-name 'regex:gemv|h2_kernel|cols_kernel')")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.profile:
        profile(args.profile)
        return
    sweep = () if not args.sweep else COLS_SWEEP if not args.sweep_configs else parse_configs(args.sweep_configs)
    wgmma_sweep = parse_configs(args.wgmma_configs) if args.wgmma_configs else ()
    t0, meta = start_run()
    layers = args.layers.split(",")
    w4 = {layer: (w := affine_w(*LAYERS[layer], 4, 128), prepared_copies(w)) for layer in layers}
    results: list[dict] = []
    w4_us: dict = {}
    for name in args.types.split(","):
        run_type(name, layers, [int(m) for m in args.ms.split(",")], args.paths, results, w4, w4_us, sweep,
                 args.as_loaded, wgmma_sweep)
    write_run(args.out, meta, t0, results=results)
    summary(meta, results)
    config_sums(results)


if __name__ == "__main__":
    main()
