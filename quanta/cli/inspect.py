"""`quanta inspect PATH`: format, architecture, per-tensor scheme, bytes and bits per weight from the
checkpoint, and what runs, from the engine itself: the model is built on the device (with a one-block
KV cache) and asked `LLM.kernels()`, so merged q/k/v and gate/up, the lm_head's dtype and the path
taken at each batch size are reported as they run, not as a second reading of the registry."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
from collections import Counter

from quanta.cli.options import quiet_parent

BATCH_SIZES = (1, 16, 256)


def natural_key(name: str) -> list:
    """Sort key that orders `layers.2` before `layers.10`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@contextlib.contextmanager
def _engine_logs_silenced():
    """The engine logs kernel fallbacks while loading; inspect reports them itself, once."""
    logger = logging.getLogger("quanta")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _tensor_entry(name: str, t) -> dict:
    from quanta.quant.qtensor import QTensor
    nbytes = t.nbytes if isinstance(t, QTensor) else t.numel() * t.element_size()
    numel = t.numel if isinstance(t, QTensor) else t.numel()
    return {"name": name, "shape": list(t.shape), "bytes": nbytes, "parameters": numel,
            "bits_per_weight": round(8 * nbytes / numel, 4),
            "scheme": t.describe() if isinstance(t, QTensor) else f"dense {t.dtype}".replace("torch.", "")}


def _running_kernels(path: str, device: str | None, dtype: str) -> tuple[object, list[dict]]:
    """Build the model as the engine would and ask it what runs: (llm, its kernel table)."""
    from quanta.engine import LLM
    with _engine_logs_silenced():
        llm = LLM(model=path, device=device, dtype=dtype, max_model_len=16, block_size=16, num_kv_blocks=1,
                  enforce_eager=True, quiet=True)
    rows = llm.kernels(m=BATCH_SIZES)
    for row in rows:
        row["paths"] = {m: {"path": p.path, "reason": p.reason} for m, p in row["paths"].items()}
    return llm, rows


def inspect_checkpoint(path: str, device: str | None = None, dtype: str = "auto") -> dict:
    """A JSON-able description of the checkpoint at `path` and of the kernels it runs on `device`."""
    from quanta.loaders import detect, load

    ckpt = load(path)
    tensors = sorted((_tensor_entry(n, t) for n, t in ckpt.tensors.items()), key=lambda e: natural_key(e["name"]))
    llm, kernels = _running_kernels(path, device, dtype)
    total_bytes = sum(e["bytes"] for e in tensors)
    total_params = sum(e["parameters"] for e in tensors)
    cfg = ckpt.config
    return {"path": str(path), "format": detect(path), "architecture": cfg.model_type,
            "device": str(llm.device), "activation_dtype": str(llm.dtype).removeprefix("torch."),
            "config": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                    "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim", "tie_word_embeddings")},
            "parameters": total_params, "bytes": total_bytes,
            "bits_per_weight": round(8 * total_bytes / total_params, 4),
            "schemes": dict(Counter(e["scheme"] for e in tensors)),
            "kernels": dict(Counter(_kernel_summary(k) for k in kernels)),
            "gemms": sorted(kernels, key=lambda k: natural_key(k["name"])),
            "memory": {key: value for key, value in llm.memory().items()
                       if key in ("device", "weights", "load_peak")},
            "tensors": tensors}


def _kernel_summary(row: dict) -> str:
    """`scheme -> kernel`, the dtype it computes in, and its path at each M where it has several."""
    text = f"{row['scheme']} -> {row['kernel']}"
    if row["compute_dtype"] != row["dtype"]:
        text += f" (computes in {row['compute_dtype']}, output {row['dtype']})"
    else:
        text += f" ({row['dtype']})"
    paths = {m: p["path"] for m, p in row["paths"].items()}
    if set(paths.values()) != {row["kernel"]}:
        text += ": " + ", ".join(f"M={m} {p}" for m, p in paths.items())
    return text


def print_report(info: dict, layers: bool) -> None:
    """The human-readable report."""
    print(f"{info['path']}\n  format {info['format']}, architecture {info['architecture']}, "
          f"{info['parameters'] / 1e6:.1f}M parameters, {info['bytes'] / 2**20:.1f} MiB, "
          f"{info['bits_per_weight']:.3f} bits/weight")
    print(f"  on {info['device']}, activations in {info['activation_dtype']}; GEMMs:")
    for what, count in info["kernels"].items():
        print(f"    {count:4d} x {what}")
    notes = {(g["kernel"], g["reason"]) for g in info["gemms"] if g.get("reason", "first choice") != "first choice"}
    for kernel, reason in sorted(notes, key=str):
        print(f"  note: {kernel}: {reason}")
    lm_head = [g for g in info["gemms"] if g["name"].startswith("lm_head")]
    for g in lm_head:
        print(f"  lm_head: {g['scheme']} -> {g['kernel']} in {g['compute_dtype']}")
    weights = info["memory"]["weights"]
    peak = info["memory"].get("load_peak")
    peak = f" (at most {peak / 2**20:.1f} MiB while loading)" if peak else ""
    print(f"  held on {info['memory']['device']}: {weights['total'] / 2**20:.1f} MiB of weights{peak}")
    for what, entry in weights.items():
        if what == "total":
            continue
        grown = f", {entry['expanded_by']:.2f}x its {entry['stored_bytes'] / 2**20:.1f} MiB stored" \
            if "expanded_by" in entry else ""
        print(f"    {entry['bytes'] / 2**20:8.1f} MiB  {what} ({entry['layers']} tensors{grown})")
    if layers:
        for t in info["tensors"]:
            print(f"  {t['name']:50s} {str(t['shape']):16s} {t['scheme']:28s} {t['bits_per_weight']:7.3f} bpw")


def cmd_inspect(args) -> None:
    info = inspect_checkpoint(args.path, device=args.device, dtype=args.dtype)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print_report(info, args.layers)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a checkpoint: format, schemes, sizes, kernels",
                       parents=[quiet_parent()])
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.add_argument("--layers", action="store_true", help="list every tensor")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.set_defaults(func=cmd_inspect)
