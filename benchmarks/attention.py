"""Paged attention on the GPU at Llama-3-8B head shapes (32 query heads, 8 kv heads, d 128, blocks of 16):
decode (one query per sequence) and prefill (512-token prompts), with the cache in fp16 and in fp8 e4m3
read by bit operations or by the sm89+ conversion instruction. Reports µs per call and the KV bytes read
per µs (GB/s, against the device-to-device copy bandwidth).

    python benchmarks/attention.py [--out attention.json]
    python benchmarks/attention.py --decode-configs "4,64;8,64;8,64,256,1" [--out ...]

--decode-configs: batch-1 decode over short contexts as the engine runs it (its CUDA graphs' splits, 32 on this
GPU for a long max_model_len) in each (DECODE_WARPS, DECODE_BLOCK_N[, DECODE_MIN_SPLIT_KEYS[, DECODE_PREFETCH]]),
fp16 cache: the per-layer cost a batch-1 token pays where the program's chain of loads, not its bytes, is the time.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from linears import bench, copy_bandwidth  # noqa: E402

from quanta.kernels import paged_attention, paged_kv  # noqa: E402

HQ, HK, D, BLOCK = 32, 8, 128, 16
DECODE = ((1, 512), (1, 8192), (64, 1024), (256, 640), (256, 2048))       # (batch, context)
PREFILL = ((16, 512),)                                                     # (prompts, length)
READS = {"fp16": (None, None), "e4m3_bits": ("fp8_e4m3", False), "e4m3_cvt": ("fp8_e4m3", True)}


def paged_cache(batch: int, ctx: int, fmt: paged_kv.Fp8Format | None):
    """Random K/V caches holding `batch` sequences of `ctx` tokens in shuffled blocks, and their tables."""
    per_seq = math.ceil(ctx / BLOCK)
    blocks = batch * per_seq
    shape = (blocks, BLOCK, HK, D)
    if fmt is None:
        k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(2))
    else:   # random finite codes of magnitude below 2^4
        k, v = (torch.randint(0, 0x5F, shape, device="cuda", dtype=torch.uint8)
                | (torch.randint(0, 2, shape, device="cuda", dtype=torch.uint8) << 7) for _ in range(2))
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return k, v, tables, seq_lens


def measure(kind: str, batch: int, ctx: int, read: str, splits: int | None = None) -> dict:
    name, hardware = READS[read]
    fmt = paged_kv.FP8_FORMATS[name] if name else None
    paged_kv.HARDWARE_FP8_READ = hardware
    kv_bytes = 2 * batch * ctx * HK * D * (1 if fmt else 2)
    caches = [paged_cache(batch, ctx, fmt) for _ in range(max(1, math.ceil(150e6 / kv_bytes)))]
    scales = dict(k_scale=torch.full((HK,), 0.02, device="cuda"), v_scale=torch.full((HK,), 0.02, device="cuda"),
                  fmt=fmt) if fmt else {}
    if kind == "decode":
        splits = splits or paged_attention.default_num_splits(batch, HK, ctx)
        qs = [torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16) for _ in range(4)]
        us = bench(lambda q, c: paged_attention.decode(q, *c, 0.088, num_splits=splits, **scales), qs, caches,
                   kv_bytes)
    else:
        starts = torch.arange(0, (batch + 1) * ctx, ctx, device="cuda", dtype=torch.int32)
        qs = [torch.randn(batch * ctx, HQ, D, device="cuda", dtype=torch.float16) for _ in range(4)]
        us = bench(lambda q, c: paged_attention.prefill(q, *c, starts, ctx, 0.088, **scales), qs, caches, kv_bytes)
        splits = None
    paged_kv.HARDWARE_FP8_READ = None
    return {"kind": kind, "batch": batch, "ctx": ctx, "kv": read, "splits": splits, "us": round(us, 2),
            "kv_GBps": round(kv_bytes / us / 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--decode-configs", help="WARPS,BLOCK_N[,MIN_SPLIT_KEYS[,PREFETCH 0/1]];...: batch-1 "
                    "short-context decode in each")
    args = ap.parse_args()
    bw = copy_bandwidth()
    if args.decode_configs:
        decode_configs(args.decode_configs, bw, args.out)
        return
    rows = [measure("decode", b, c, r) for b, c in DECODE for r in READS]
    rows += [measure("prefill", b, c, r) for b, c in PREFILL for r in READS]
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps": round(bw, 1),
                                              "rows": rows}, indent=1))
    print(f"\ncopy bandwidth {bw:.0f} GB/s\n| kind | batch x ctx | splits | " + " | ".join(READS) + " |")
    print("|---|---|---|" + "---|" * len(READS))
    for i in range(0, len(rows), len(READS)):
        group = rows[i:i + len(READS)]
        r0 = group[0]
        cells = [f"{r['us']} µs ({r['kv_GBps'] / bw:.0%})" for r in group]
        print(f"| {r0['kind']} | {r0['batch']} x {r0['ctx']} | {r0['splits']} | " + " | ".join(cells) + " |")


def decode_configs(spec: str, bw: float, out: str | None) -> None:
    """Batch-1 decode, fp16 cache, at 128 / 384 / 1,024 keys and the engine's splits, in each config of spec."""
    splits = paged_attention.default_num_splits(1, HK, 1 << 15)
    rows = []
    for item in spec.split(";"):
        warps, block_n, min_keys, prefetch = ([int(v) for v in item.split(",")] + [0, 0])[:4]
        paged_attention.DECODE_WARPS, paged_attention.DECODE_BLOCK_N = warps, block_n
        paged_attention.DECODE_MIN_SPLIT_KEYS = min_keys or block_n
        if hasattr(paged_attention, "DECODE_PREFETCH"):
            paged_attention.DECODE_PREFETCH = bool(prefetch)
        for ctx in (128, 384, 1024):
            rows.append(dict(measure("decode", 1, ctx, "fp16", splits), warps=warps, block_n=block_n,
                             min_split_keys=min_keys or block_n, prefetch=bool(prefetch)))
            print(f"warps {warps} block_n {block_n} min split keys {min_keys or block_n} prefetch {prefetch} "
                  f"ctx {ctx}: {rows[-1]['us']} µs", flush=True)
    if out:
        Path(out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps": round(bw, 1),
                                         "splits": splits, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
