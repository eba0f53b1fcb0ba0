"""Kernel benchmark on Llama-3 8B / 70B linear shapes: quanta's Triton kernels vs torch fp16 (cuBLAS) and
bitsandbytes NF4, in one run, against the measured device-to-device copy bandwidth.

    python benchmarks/linears.py --out results.json [--quick]

GPU time per call, as a decode step under CUDA graphs sees it: each variant's calls are captured into one
CUDA graph cycling over enough weight copies (and 4 activation buffers) that more than 150 MB lies between
two uses of a weight (the H100's L2 is 50 MB), the graph is replayed, and the median replay time over the
calls is taken. Eager (Python launch) times of the layer figure are reported beside it. GB/s counts the
bytes a kernel must move: the weight as stored (QTensor.nbytes: codes at their bit width + 16-bit
scales), activations and output. Data are random and non-zero.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from quanta.kernels import affine, codebook_gemm, fp8_gemm  # noqa: E402
from quanta.kernels.affine import plan, splitk  # noqa: E402
from quanta.kernels.affine.gemv import matmul as gemv  # noqa: E402
from quanta.kernels.device_caps import device_caps  # noqa: E402
from quanta.quant.kinds import NF4_TABLE, Affine, Codebook, Fp8  # noqa: E402

SHAPES = {"8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
          "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
          # Llama-3.2: not in the default tables, for probes of launch configs on smaller weights
          "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
          "3b": {"qkv": (5120, 3072), "o": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)},
          # one rank's pieces of 70B at tensor-parallel size 4 (its 16 query and 2 KV heads, a quarter of the MLP)
          "70b-tp4": {"qkv": (2560, 8192), "o": (8192, 2048), "gate_up": (14336, 8192), "down": (8192, 7168)}}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


ROTATE_BYTES = 150e6
WARMUP_US = 20e3                     # GPU time each timed graph replays before it is timed (3 replays at least)


def bench(fn, xs: list[torch.Tensor], weights: list | None = None, nbytes: int = 0) -> float:
    """Median µs of one fn(x[, w]) call inside a CUDA graph that rotates over xs and weight copies."""
    ws = weights or [None]
    calls = max(len(ws), len(xs), min(64, math.ceil(ROTATE_BYTES / max(nbytes, 1)) * 2))
    run = (lambda i: fn(xs[i % len(xs)])) if weights is None else (lambda i: fn(xs[i % len(xs)], ws[i % len(ws)]))
    for i in range(min(calls, 2 * len(ws))):
        run(i)                                       # compile and warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            run(i)
    warm, replays = 0.0, 0                # without this, the first timings after the host built new weights ran
    while warm < WARMUP_US or replays < 3:    # up to 12% slow (8B qkv fp16 at M = 1 24.6 µs, at M = 2 21.9)
        warm += replay_us(g, calls) * calls
        replays += 1
    times = sorted(replay_us(g, calls) for _ in range(7))
    del g
    return times[len(times) // 2]


def replay_us(g: torch.cuda.CUDAGraph, calls: int) -> float:
    """µs per call of one replay of graph `g` holding `calls` calls."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return 1e3 * a.elapsed_time(b) / calls


def copies(make, nbytes: int) -> list:
    """Enough copies of a weight that ROTATE_BYTES lie between two uses of one."""
    return [make() for _ in range(max(1, math.ceil(ROTATE_BYTES / nbytes)))]


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = 1e3 * triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    return 2 * a.numel() / us / 1e3                      # GB/s, read + write


def prepared_copies(w, dtype: torch.dtype = torch.float16) -> list:
    """Rotating copies (`copies`) of the quantized weight `w` in kernel layout for `dtype`, by the kernels of its
    kind: codebook_gemm for table codes, affine for affine ones."""
    kernels = codebook_gemm if isinstance(w, Codebook) else affine
    return copies(lambda: kernels.prepare(w, "cuda", dtype), w.nbytes)


def fp16_weights(n: int, k: int) -> list:
    """Rotating copies of a random fp16 weight [n, k], the cuBLAS operand every table compares with."""
    return copies(lambda: (torch.randn(n, k, device="cuda") * 0.02).half(), 2 * n * k)


def dense_us(xs: list[torch.Tensor], weights: list[torch.Tensor]) -> float:
    """Median µs of cuBLAS x @ w.t() over rotating dense weights (fp16_weights, or their bf16 copies)."""
    return bench(lambda x, w: x @ w.t(), xs, weights, weights[0].numel() * weights[0].element_size())


def w4_shapes(models: str, weight: str = "w4", dtype: torch.dtype = torch.float16):
    """For each Llama shape of `models` ("8b,70b"): (model, layer, n, k, a W4A16 g128 weight, or with `weight`
    "nf4" a bnb NF4 one (nf4_w), rotating copies of it prepared for `dtype`, rotating dense copies in `dtype` for
    cuBLAS)."""
    for model in models.split(","):
        for layer, (n, k) in SHAPES[model].items():
            w4 = affine_w(n, k, 4, 128) if weight == "w4" else nf4_w(n, k)
            yield model, layer, n, k, w4, prepared_copies(w4, dtype), [w.to(dtype) for w in fp16_weights(n, k)]
            torch.cuda.empty_cache()


def w4_points(models: str, ms: str, weight: str = "w4", dtype: torch.dtype = torch.float16):
    """For each Llama shape of `models` and each M of `ms` ("4,16"): (its record: model, layer, n, k, m and the
    cuBLAS µs in `dtype` (key "fp16" also for bf16); four activations [M, K]; the W4A16 g128 weight, or `weight`
    as in w4_shapes; its rotating copies prepared for `dtype`)."""
    for model, layer, n, k, w4, st4, fp16 in w4_shapes(models, weight, dtype):
        for m in map(int, ms.split(",")):
            xs = [torch.randn(m, k, device="cuda").to(dtype) for _ in range(4)]
            yield ({"model": model, "layer": layer, "n": n, "k": k, "m": m, "fp16": round(dense_us(xs, fp16), 2)},
                   xs, w4, st4)


def m1_cases(layers, bits: int = 4, group: int = 128, weight: str = "affine"):
    """For each (model, layer) of `layers` at M = 1: (model, layer, n, k, the affine weight (or with `weight`
    "nf4" a bnb NF4 one, nf4_w), its rotating copies prepared for fp16, four activations [1, K], the reference
    dense_reference(xs[0], w))."""
    for model, layer in layers:
        n, k = SHAPES[model][layer]
        w = affine_w(n, k, bits, group) if weight == "affine" else nf4_w(n, k)
        sts = prepared_copies(w)
        xs = [torch.randn(1, k, device="cuda").half() for _ in range(4)]
        yield model, layer, n, k, w, sts, xs, dense_reference(xs[0], w)
        torch.cuda.empty_cache()


def write_run(path: str, meta: dict, t0: float, **parts) -> None:
    """The run's JSON: its meta (with the seconds since t0) and `parts`."""
    meta["seconds"] = round(time.time() - t0, 1)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, **parts}, indent=1))


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def add_dtype_arg(ap: argparse.ArgumentParser) -> None:
    """--dtype of a probe's activations (fp16 or bf16; its torch dtype is DTYPES[args.dtype])."""
    ap.add_argument("--dtype", default="fp16", choices=list(DTYPES),
                    help="activations (and the cuBLAS baseline, still keyed 'fp16')")


def sweep_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of a sweep: --out (its JSON) and --models; the sweep adds its own, then parses."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="8b,70b")
    return ap


def start_run(**extra) -> tuple[float, dict]:
    """(start time, run_meta(**extra)) of a run, the meta printed first as a JSON line."""
    t0 = time.time()
    meta = run_meta(**extra)
    print(json.dumps(meta), flush=True)
    return t0, meta


def add_versions_args(ap: argparse.ArgumentParser, required: bool = True) -> None:
    """What a comparison of saved kernel modules takes: --before (their paths, by ',') and --unchecked (the names of
    diagnostic versions wrong on purpose: timed, not checked)."""
    ap.add_argument("--before", required=required, default="", help="module paths, by ','")
    ap.add_argument("--unchecked", default="", help="versions wrong on purpose (diagnostics): timed, not checked")


def variants_parser(doc: str, reps: int) -> argparse.ArgumentParser:
    """sweep_parser plus add_versions_args and --reps (timings of each version, interleaved)."""
    ap = sweep_parser(doc)
    add_versions_args(ap)
    ap.add_argument("--reps", type=int, default=reps, help="time each version this many times, interleaved")
    return ap


def load_versions(now, paths: str) -> dict:
    """{"now": the working tree's module, then each module saved at the ','-separated `paths` by its file name}."""
    return {"now": now} | {Path(p).stem: load_module(p) for p in paths.split(",") if p}


def load_module(path: str):
    """A kernel module saved at `path` (a variant of one in quanta/kernels), imported under its file name."""
    spec = importlib.util.spec_from_file_location("variant_" + Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dense_reference(x: torch.Tensor, w) -> torch.Tensor:
    """x @ Wᵀ in float32 from the quantized weight `w` dequantized to x's dtype: what a kernel variant must match."""
    return x.float() @ w.dequantize().to(x.device, x.dtype).float().t()


def rel_norm_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """|y - ref| / |ref| (Frobenius norms, y in float32): how far a kernel's output is from its float reference."""
    return ((y.float() - ref).norm() / ref.norm()).item()


def check_close(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Stop a sweep whose kernel variant `what` strays from the float reference by more than 1% (relative norm)."""
    err = rel_norm_err(y, ref)
    assert err < 1e-2, (what, err)


def checked_bench(run, xs: list[torch.Tensor], states: list, nbytes: int, ref: torch.Tensor, what: str,
                  check: bool = True) -> float:
    """bench's µs of run(x, state), to 0.01, once run's output for xs[0] matched `ref` (check_close); `check` False
    for a diagnostic wrong on purpose (run once all the same)."""
    y = run(xs[0], states[0])
    if check:
        check_close(y, ref, what)
    return round(bench(run, xs, states, nbytes), 2)


def parse_layers(text: str) -> list[tuple[str, str]]:
    """(model, layer) pairs of SHAPES from "8b qkv,70b o"."""
    return [tuple(x.split()) for x in text.split(",")]


def parse_config(text: str) -> tuple:
    """A launch config from comma-separated fields: ints, floats where a field has a '.', None for 'None'."""
    return tuple(None if v == "None" else float(v) if "." in v else int(v) for v in text.split(","))


def parse_configs(text: str) -> list[tuple[tuple | None, bool]]:
    """Launch configs from ';'-separated entries, as (config, stream-K): 'default' is (None, False), the launcher's
    own; else comma-separated fields (parse_config), 'stream:' before them for stream-K."""
    return [(None, False) if c == "default" else (parse_config(c.removeprefix("stream:")), c.startswith("stream:"))
            for c in text.split(";")]


def with_m_bucket(config: tuple | None, m: int) -> tuple | None:
    """`config` with its first field, BLOCK_M, set to M's bucket (the power of two >= M, 16 at least); None stays."""
    return config and (max(16, triton.next_power_of_2(m)),) + tuple(config[1:])


def run_meta(**extra) -> dict:
    """The device, versions, date, copy bandwidth and command line of a benchmark run, for its JSON."""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            **extra, "date": time.strftime("%Y-%m-%d"), "copy_GBps": round(copy_bandwidth(), 1),
            "command": " ".join(sys.argv)}


def affine_w(n: int, k: int, bits: int, group: int) -> Affine:
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, device="cuda")
    g = k // group if group > 0 else 1
    scales = (torch.rand(n, g, device="cuda") * 0.01 + 0.001).half()
    return Affine(codes=codes, scales=scales, bits=bits, group_size=group if group > 0 else k,
                  zeros=2 ** (bits - 1))


def nf4_w(n: int, k: int) -> Codebook:
    blocks = n * k // 64
    return Codebook(codes=torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda"),
                    table=torch.tensor(NF4_TABLE, device="cuda"), blocksize=64,
                    absmax=torch.randint(0, 256, (blocks,), dtype=torch.uint8, device="cuda"),
                    nested_table=torch.linspace(-1, 1, 256, device="cuda"),
                    nested_absmax=torch.rand(-(-blocks // 256), device="cuda"), quant_type="nf4")


def row(rec: dict, name: str, us: float, nbytes: int, flops: float) -> None:
    rec[name] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1), "TFLOPs": round(flops / us / 1e6, 2)}


def clone_state(st):
    return dataclasses.replace(st, packed=st.packed.clone()) if hasattr(st, "packed") else \
        dataclasses.replace(st, w_t=st.w_t.t().clone().t())


GEMV_SWEEP = ((256, 4, 2, 8.0, 2), (128, 8, 2, 16.0, 1), (128, 16, 2, 16.0, 1), (128, 4, 2, 16.0, 1),
              (64, 8, 2, 16.0, 1))   # (BLOCK_N, RS, num_warps, waves, min_tiles); profile_gemv.py sweeps more
GEMM_SWEEP = {16: ((16, 64, 4, 3, 4.0), (16, 128, 4, 3, 2.0), (16, 64, 4, 4, 8.0), (16, 128, 8, 4, 4.0)),
              256: ((64, 128, 4, 3, 1.0), (128, 128, 8, 3, 1.0), (128, 256, 8, 3, 1.0),
                    (256, 128, 8, 2, 1.0), (256, 64, 8, 3, 1.0), (128, 128, 4, 2, 1.0), (128, 64, 4, 2, 1.0)),
              1024: ((128, 128, 8, 3, 1.0), (128, 256, 8, 3, 1.0), (64, 256, 4, 3, 1.0), (128, 128, 4, 4, 1.0),
                     (256, 128, 8, 2, 1.0), (256, 64, 8, 3, 1.0), (128, 128, 4, 2, 1.0), (128, 64, 4, 2, 1.0))}
# BLOCK_M = 256 (176 / 225 KB of shared memory on sm90): each weight tile decoded once for 256 rows instead
# of twice; 128 x 128 and 128 x 64 with 4 warps and 2 stages fit two programs per SM (110 / 88 KB, <= 255
# registers), so that one program's decoding can overlap the other's wgmma, which Triton serializes within
# a program (the decoded tile's shared-memory buffer is waited on every K step)


def run_shape(model: str, layer: str, n: int, k: int, ms, bnb, results: list, sweep: bool) -> None:
    w4 = affine_w(n, k, 4, 128)
    st4 = prepared_copies(w4)
    st4_bf16 = prepared_copies(w4, torch.bfloat16)
    w8 = affine_w(n, k, 8, -1)
    st8 = prepared_copies(w8)
    nf4 = nf4_w(n, k)
    st_nf4 = prepared_copies(nf4)
    fp16 = fp16_weights(n, k)
    bf16 = [w.bfloat16() for w in fp16]
    fp8 = Fp8(data=(torch.randn(n, k, device="cuda") * 30).clamp(-440, 440).to(torch.float8_e4m3fn),
              scale=torch.rand(n, device="cuda") * 1e-3 + 1e-4)
    st_fp8 = (copies(lambda: clone_state(fp8_gemm.prepare(fp8, "cuda", torch.bfloat16)), n * k)
              if torch.cuda.get_device_capability() >= (8, 9) else None)
    bnb_w = None
    if bnb is not None:
        packed, qs = bnb.functional.quantize_4bit(fp16[0], quant_type="nf4", compress_statistics=True)
        bnb_w = [(packed.clone(), qs) for _ in range(len(st_nf4))]
    for m in ms:
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
        xb = [x.bfloat16() for x in xs]
        act = 2 * (m * k + m * n)
        fl = 2.0 * m * n * k
        rec = {"model": model, "layer": layer, "n": n, "k": k, "m": m}
        row(rec, "fp16", dense_us(xs, fp16), 2 * n * k + act, fl)
        row(rec, "bf16", dense_us(xb, bf16), 2 * n * k + act, fl)
        rec["w4_path"] = plan.choose(st4[0], device_caps("cuda"), m).path.name
        row(rec, "w4a16", bench(plan.matmul, xs, st4, w4.nbytes), w4.nbytes + act, fl)
        row(rec, "w4a16_bf16", bench(plan.matmul, xb, st4_bf16, w4.nbytes), w4.nbytes + act, fl)
        row(rec, "w8a16", bench(plan.matmul, xs, st8, w8.nbytes), w8.nbytes + act, fl)
        row(rec, "nf4", bench(plan.matmul, xs, st_nf4, nf4.nbytes), nf4.nbytes + act, fl)
        if bnb_w is not None:
            row(rec, "bnb_nf4", bench(lambda x, w: bnb.matmul_4bit(x, w[0].t(), quant_state=w[1]), xs, bnb_w,
                                      nf4.nbytes), nf4.nbytes + act, fl)
        if st_fp8 is not None:
            row(rec, "fp8_w8a8", bench(fp8_gemm.apply, xb, st_fp8, n * k), n * k + 4 * n + act, fl)
        if sweep:                                   # the other paths and configs, to place the thresholds
            for path in ("gemv", "wgmma", "mma", "splitk", "cublas"):
                if path != rec["w4_path"] and (path != "gemv" or m <= 16) and (path != "mma" or m <= 1024) \
                        and (path != "wgmma" or m <= plan.WGMMA_MAX_M):
                    row(rec, f"w4a16_{path}", bench(lambda x, st: plan.matmul(x, st, path=path), xs, st4,
                                                    w4.nbytes), w4.nbytes + act, fl)
            for cfg in GEMV_SWEEP if m == 1 else ():
                row(rec, "w4_gemv_" + "_".join(map(str, cfg)),
                    bench(lambda x, st: gemv(x, st, config=cfg), xs, st4, w4.nbytes), w4.nbytes + act, fl)
            for cfg in GEMM_SWEEP.get(m, ()):
                row(rec, "w4_gemm_" + "_".join(map(str, cfg)),
                    bench(lambda x, st: splitk.matmul(x, st, config=cfg), xs, st4, w4.nbytes),
                    w4.nbytes + act, fl)
        results.append(rec)
        print(json.dumps(rec), flush=True)


def layer_figure(model: str, ms=(1,)) -> list[dict]:
    """The four GEMMs of one decoder layer back to back: eager (Python launches included) and graphed."""
    out = []
    shapes = list(SHAPES[model].values())
    layers = [affine.prepare(affine_w(n, k, 4, 128), "cuda", torch.float16) for n, k in shapes]
    fp16 = [(torch.randn(n, k, device="cuda") * 0.02).half() for n, k in shapes]
    for m in ms:
        xs = {k: [torch.randn(m, k, device="cuda").half() for _ in range(2)] for _, k in shapes}
        nbytes = sum(n * k // 2 + n * (k // 128) * 2 + 2 * m * (n + k) for n, k in shapes)

        def four(x, ws):
            for st in ws:
                plan.matmul(xs[st.k][0], st)

        def four16(x, ws):
            for w in ws:
                xs[w.shape[1]][0] @ w.t()
        # eager: do_bench clears the L2 before every call, so the weights come from HBM
        us_eager = 1e3 * triton.testing.do_bench(lambda: four(None, layers), warmup=10, rep=50, return_mode="median")
        us_graph = bench(four, [None], [layers, [clone_state(st) for st in layers]], nbytes)
        us16 = bench(four16, [None], [fp16], 4 * nbytes)
        out.append({"model": model, "m": m, "bytes": nbytes, "w4a16_eager_us": round(us_eager, 2),
                    "w4a16_graph_us": round(us_graph, 2), "fp16_graph_us": round(us16, 2),
                    "GBps_eager": round(nbytes / us_eager / 1e3, 1), "GBps_graph": round(nbytes / us_graph / 1e3, 1)})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="8B shapes and M in {1, 16, 256, 1024} only")
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--ms", help="comma-separated M values instead of all ten (e.g. 1 for the decode GEMVs)")
    ap.add_argument("--sweep", action="store_true", help="also time the other paths and GEMV configs")
    args = ap.parse_args()
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        print(f"bitsandbytes not importable ({exc}): its column is left out")
        bnb = None
    torch.manual_seed(0)
    t0, meta = start_run(bitsandbytes=getattr(bnb, "__version__", None))
    results, layers = [], []
    ms = tuple(map(int, args.ms.split(","))) if args.ms else (1, 16, 256, 1024) if args.quick else MS
    for model in args.models.split(","):
        for layer, (n, k) in SHAPES[model].items():
            run_shape(model, layer, n, k, ms, bnb, results, args.sweep)
            torch.cuda.empty_cache()
        layers += layer_figure(model, (1, 16))
    write_run(args.out, meta, t0, results=results, layers=layers)
    summary(meta, results, layers)


def summary(meta: dict, results: list[dict], layers: list[dict]) -> None:
    bw = meta["copy_GBps"]
    print(f"\n{meta['device']}  copy {bw:.0f} GB/s  (share = GB/s / copy; x = speed-up over fp16 cuBLAS; "
          "w4bf16 = W4A16 with bf16 activations, speed-up over bf16 cuBLAS)")
    print(f"{'shape':>14} {'M':>5} {'fp16us':>8} {'w4us':>8} {'share':>6} {'x16':>6} {'bnbus':>8} {'nf4us':>8} "
          f"{'w8x16':>6} {'fp8/bf16':>8} {'w4bf16':>7} path")
    for r in results:
        bnb_us = r.get("bnb_nf4", {}).get("us", math.nan)
        fp8 = r["bf16"]["us"] / r["fp8_w8a8"]["us"] if "fp8_w8a8" in r else math.nan
        w4_bf16 = r["bf16"]["us"] / r["w4a16_bf16"]["us"] if "w4a16_bf16" in r else math.nan
        print(f"{r['model'] + ' ' + r['layer']:>14} {r['m']:>5} {r['fp16']['us']:>8.1f} {r['w4a16']['us']:>8.1f} "
              f"{r['w4a16']['GBps'] / bw:>6.0%} {r['fp16']['us'] / r['w4a16']['us']:>6.2f} {bnb_us:>8.1f} "
              f"{r['nf4']['us']:>8.1f} {r['fp16']['us'] / r['w8a16']['us']:>6.2f} {fp8:>8.2f} {w4_bf16:>7.2f} "
              f"{r['w4_path']}")
    for la in layers:
        print(f"{la['model']} layer M={la['m']}: w4a16 graphed {la['w4a16_graph_us']} us "
              f"({la['GBps_graph'] / bw:.0%} of copy), eager {la['w4a16_eager_us']} us ({la['GBps_eager'] / bw:.0%}),"
              f" fp16 graphed {la['fp16_graph_us']} us")


if __name__ == "__main__":
    main()
