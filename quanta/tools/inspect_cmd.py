"""`quanta inspect PATH`: format, architecture, per-layer scheme, bytes, bits per weight, and the
kernel each linear layer would run on this machine's device (with the registry's reason)."""
from __future__ import annotations

import argparse
import json
from collections import Counter

import torch

from quanta.quant.errors import QuantaError
from quanta.quant.qtensor import QTensor


def inspect_checkpoint(path: str, device: str | None = None, dtype: str = "auto") -> dict:
    """A JSON-able description of the checkpoint at `path`."""
    from quanta.engine.config import EngineConfig
    from quanta.kernels import registry
    from quanta.loaders import detect, load

    ckpt = load(path)
    engine = EngineConfig(model=path, dtype=dtype, device=device)
    dev, compute = torch.device(engine.device), engine.compute_dtype(ckpt.config.torch_dtype)
    layers, total_bytes, total_params = [], 0, 0
    for name, t in ckpt.tensors.items():
        nbytes = t.nbytes if isinstance(t, QTensor) else t.numel() * t.element_size()
        numel = t.numel if isinstance(t, QTensor) else t.numel()
        total_bytes, total_params = total_bytes + nbytes, total_params + numel
        entry = {"name": name, "shape": list(t.shape), "bytes": nbytes, "bits_per_weight": round(8 * nbytes / numel, 4),
                 "scheme": t.describe() if isinstance(t, QTensor) else f"dense {t.dtype}".replace("torch.", "")}
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            try:
                kernel, reason = registry.select(t, dev, compute)
                entry.update(kernel=kernel.NAME, reason=reason)
            except QuantaError as e:   # report it in the listing rather than abort
                entry.update(kernel=None, reason=str(e))
        layers.append(entry)
    cfg = ckpt.config
    if cfg.tie_word_embeddings and "lm_head.weight" not in ckpt.tensors:
        embed = ckpt.tensors["model.embed_tokens.weight"]
        kernel, reason = registry.select(embed, dev, compute)
        layers.append({"name": "lm_head.weight (tied)", "shape": list(embed.shape), "bytes": 0,
                       "bits_per_weight": 0.0, "scheme": layers[[l["name"] for l in layers].index(
                           "model.embed_tokens.weight")]["scheme"], "kernel": kernel.NAME, "reason": reason})
    return {"path": str(path), "format": detect(path), "architecture": cfg.model_type,
            "device": str(dev), "compute_dtype": str(compute).replace("torch.", ""),
            "config": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                    "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim", "tie_word_embeddings")},
            "parameters": total_params, "bytes": total_bytes, "bits_per_weight": round(8 * total_bytes / total_params, 4),
            "schemes": dict(Counter(layer["scheme"] for layer in layers if layer["bytes"])),
            "kernels": dict(Counter(f"{layer['scheme']} -> {layer['kernel']}" for layer in layers if "kernel" in layer)),
            "layers": layers}


def cmd_inspect(args) -> None:
    info = inspect_checkpoint(args.path, device=args.device, dtype=args.dtype)
    if args.json:
        print(json.dumps(info, indent=2))
        return
    print(f"{info['path']}\n  format {info['format']}, architecture {info['architecture']}, "
          f"{info['parameters'] / 1e6:.1f}M parameters, {info['bytes'] / 2**20:.1f} MiB, "
          f"{info['bits_per_weight']:.3f} bits/weight")
    print(f"  kernels on {info['device']} ({info['compute_dtype']}):")
    for what, count in info["kernels"].items():
        print(f"    {count:4d} x {what}")
    reasons = {(layer["kernel"], layer["reason"]) for layer in info["layers"] if layer.get("reason", "first choice") != "first choice"}
    for kernel, reason in sorted(reasons, key=str):
        print(f"  note: {kernel}: {reason}")
    if args.layers:
        for layer in info["layers"]:
            print(f"  {layer['name']:50s} {str(layer['shape']):16s} {layer['scheme']:28s} "
                  f"{layer['bits_per_weight']:7.3f} bpw  {layer.get('kernel') or ''}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a checkpoint: format, schemes, sizes, kernels")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.add_argument("--layers", action="store_true", help="list every tensor")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.set_defaults(func=cmd_inspect)
