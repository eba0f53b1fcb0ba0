"""The compute ceiling of an offline run (N prompts of IN tokens, OUT generated each) on this GPU, from rates measured
here: every token's linear layers at dense cuBLAS speed (fp16, and FP8 W8A8 as fp8_gemm runs it: per-token
quantization + `_scaled_mm`), measured on the model's shapes at M = a prefill step's tokens; the lm_head (fp16, as
the checkpoints and synthetic models keep it) once per output token; and decode attention reading each generated
token's context from the KV cache at copy bandwidth.

    python benchmarks/offline_ceiling.py [--model llama3-8b] [--num-prompts 1000 --input-len 512 --output-len 128]

Nothing else (prefill attention, norms, rotary, the cache write, sampling, launch gaps) is counted: a run at the
ceiling would spend all its time in tensor-core GEMMs at cuBLAS's rate and in streaming its KV cache. JSON on the
last line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_io import emit  # noqa: E402
from linears import bench, copies, copy_bandwidth  # noqa: E402

from quanta.kernels import fp8_gemm  # noqa: E402
from quanta.loaders.synthetic import model_config  # noqa: E402
from quanta.quant.quantize_model import linear_shapes  # noqa: E402


def gemm_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(N, K) of the engine's GEMMs of one decoder layer (quantize_model.linear_shapes' q / k / v and gate / up
    stacked, as the engine runs them) and of the lm_head."""
    s = linear_shapes(cfg)

    def stacked(*names: str) -> tuple[int, int]:
        return sum(s[n][0] for n in names), s[names[0]][1]
    return {"qkv": stacked("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": s["self_attn.o_proj"],
            "gate_up": stacked("mlp.gate_proj", "mlp.up_proj"), "down": s["mlp.down_proj"],
            "lm_head": (cfg.vocab_size, cfg.hidden_size)}


def gemm_us(n: int, k: int, m: int, fp8: bool = True) -> dict[str, float]:
    """Median µs of x [m, k] times a rotating weight [n, k]: fp16 cuBLAS, and (fp8) FP8 W8A8 with its x
    quantization."""
    xs = [torch.randn(m, k, device="cuda").half() for _ in range(2)]
    w16 = copies(lambda: (torch.randn(n, k, device="cuda") * 0.02).half(), 2 * n * k)
    fp16 = bench(lambda x, w: x @ w.t(), xs, w16, 2 * n * k)
    del w16
    if not fp8:
        return {"fp16": fp16}
    w8 = copies(lambda: (torch.randn(n, k, device="cuda") * 30).clamp(-440, 440).to(torch.float8_e4m3fn), n * k)
    ws = torch.rand(1, n, device="cuda") * 1e-3 + 1e-4

    def w8a8(x, w):
        q, s = fp8_gemm.quantize_rows(x)
        return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=ws, out_dtype=torch.float16, use_fast_accum=True)
    us = bench(w8a8, xs, w8, n * k)
    del w8
    torch.cuda.empty_cache()
    return {"fp16": fp16, "fp8": us}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--m", type=int, default=8192, help="rows of the timed GEMMs (a prefill step's tokens)")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = model_config(args.model, "fp16")
    shapes = gemm_shapes(cfg)
    times = {name: gemm_us(n, k, args.m, fp8=name != "lm_head") for name, (n, k) in shapes.items()}
    tflops = {name: {kind: round(2 * args.m * n * k / us / 1e6, 1) for kind, us in times[name].items()}
              for name, (n, k) in shapes.items()}
    gbs = copy_bandwidth()
    layers, n_prompts = cfg.num_hidden_layers, args.num_prompts
    tokens = n_prompts * (args.input_len + args.output_len)        # every token passes the decoder layers once
    out_tokens = n_prompts * args.output_len
    mean_context = args.input_len + (args.output_len + 1) / 2      # keys a generated token reads, on average
    kv_token = 2 * layers * cfg.num_key_value_heads * cfg.head_dim
    result = {"benchmark": "offline_ceiling", "model": args.model, "device": torch.cuda.get_device_name(),
              "m": args.m, "num_prompts": n_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "copy_gb_s": round(gbs, 1), "gemm_us": times, "gemm_tflops": tflops, "ceilings": {}}
    print(f"{result['device']}, copy {gbs:,.0f} GB/s; TFLOP/s at M = {args.m}:", flush=True)
    for name in shapes:
        print(f"  {name:8s} fp16 {tflops[name]['fp16']:7.1f}   fp8 W8A8 {tflops[name].get('fp8', '-')}")
    print("\n| compute | KV cache | layers s | lm_head s | attention s | ceiling output tok/s |")
    print("|---|---|---|---|---|---|")
    for kind in ("fp16", "fp8"):
        layer_s = tokens * layers * sum(times[g][kind] for g in ("qkv", "o", "gate_up", "down")) / args.m / 1e6
        head_s = out_tokens * times["lm_head"]["fp16"] / args.m / 1e6
        for kv_name, kv_bytes in (("fp16", 2), ("fp8", 1)):
            attn_s = out_tokens * mean_context * kv_token * kv_bytes / (gbs * 1e9)
            ceiling = out_tokens / (layer_s + head_s + attn_s)
            result["ceilings"][f"{kind}/{kv_name}"] = {"layers_s": round(layer_s, 2), "lm_head_s": round(head_s, 2),
                                                       "attention_s": round(attn_s, 2),
                                                       "output_tok_s": round(ceiling, 1)}
            print(f"| {kind} | {kv_name} | {layer_s:.2f} | {head_s:.2f} | {attn_s:.2f} | {ceiling:,.0f} |")
    emit(result, args.out)


if __name__ == "__main__":
    main()
