"""compressed-tensors checkpoints (llm-compressor) -> Affine (int formats) or Fp8 (float formats).

Formats (compressed_tensors/compressors): `pack-quantized`: weight_packed int32 [N, ceil(K*b/32)], a dense
bit stream along K of values offset by 2**(b-1); weight_scale [N, G] (group) / [N, 1] (channel);
weight_zero_point packed the same way along N, [ceil(N*b/32), G], only when asymmetric; weight_shape;
optional weight_g_idx. `naive-quantized` / `int-quantized`: weight int8 [N, K] (signed), zero point int8.
`float-quantized` (or naive with type float): weight float8_e4m3fn, weight_scale [1] / [N, 1] / blocks,
input_scale when static. Dequantization: (x_q - zp) * scale in the scale's dtype.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from quanta.loaders.checkpoint import Checkpoint
from quanta.loaders.config_fields import get_block, get_dict, get_int, get_str_list
from quanta.loaders.quantized import build_checkpoint, kv_scale_names, need, quant_config, unpack_bits
from quanta.loaders.safetensors_io import TensorStore, read_config
from quanta.loaders.weight_format import WeightFormat, affine_format
from quanta.quant.errors import ConfigError, ShapeError, UnsupportedError
from quanta.quant.kinds import Affine, Fp8

INT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
STRATEGIES = ("tensor", "channel", "group", "block")


def groups(qc: dict[str, Any], source: Path) -> list[dict[str, Any]]:
    """The config groups as [{targets, weights, input_activations, format}], validated."""
    top = qc.get("format")
    out = []
    for gname, g in get_dict(qc, "config_groups", source, {}).items():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            raise ConfigError(f"{source}: config_groups.{gname}.weights is missing")
        where = f"{source}: config_groups.{gname}"
        fmt = g.get("format") or top
        if w.get("type", "int") == "int" and fmt not in INT_FORMATS or w.get("type") == "float" and fmt not in FLOAT_FORMATS:
            raise UnsupportedError(f"{source}: compressed-tensors format {fmt!r} with {w.get('type')} weights "
                                   "is not supported")
        if (w.get("strategy") or "tensor") not in STRATEGIES:
            raise UnsupportedError(f"{source}: config_groups.{gname}: weight strategy {w.get('strategy')!r} "
                                   f"is not supported ({STRATEGIES})")
        bits = get_int(w, "num_bits", f"{where}.weights", 8)
        if w.get("type") == "float" and bits != 8:
            raise UnsupportedError(f"{source}: {bits}-bit float weights are not supported (only FP8)")
        if w.get("type", "int") == "int" and not 2 <= bits <= 8:
            raise UnsupportedError(f"{where}: {bits}-bit int weights are not supported (2 to 8)")
        if (w.get("strategy") or "tensor") == "group":          # checked here, read by read_int
            get_int(w, "group_size", f"{where}.weights", None)
        if w.get("strategy") == "block":                        # checked here, read by read_float
            get_block(w, "block_structure", f"{where}.weights")
        targets = get_str_list(g, "targets", where)
        for t in targets:
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    raise ConfigError(f"{where}: target {t!r} is not a valid regular expression ({e})") from e
        act = get_dict(g, "input_activations", where, None)
        out.append({"targets": targets, "weights": w, "format": fmt, "input_activations": act})
    if not out:
        raise ConfigError(f"{source}: compressed-tensors config has no config_groups")
    return out


def _matches(target: str, prefix: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], prefix) is not None
    return target in ("Linear", "nn.Linear") or prefix == target or prefix.endswith("." + target)


def scheme_for(gs: list[dict[str, Any]], prefix: str) -> dict[str, Any] | None:
    """The first config group whose targets match module `prefix`."""
    return next((g for g in gs if any(_matches(t, prefix) for t in g["targets"])), None)


def read_int(store: TensorStore, prefix: str, shape: tuple[int, int], g: dict[str, Any]) -> Affine:
    """Affine from pack-quantized or naive int tensors."""
    n, k = shape
    w = g["weights"]
    bits, strategy = int(w["num_bits"]), w.get("strategy") or "tensor"
    mid = 1 << (bits - 1)
    scale = need(store, prefix + ".weight_scale", "compressed-tensors weight_scale")
    scale = scale.reshape(1, 1).expand(n, 1).contiguous() if scale.numel() == 1 else scale.reshape(n, -1)
    ngroups = scale.shape[1]
    group = int(w.get("group_size") or k) if strategy == "group" else k
    if -(-k // group) != ngroups:
        raise ShapeError(f"{store.path}: {prefix}.weight_scale has {ngroups} groups per row, expected "
                         f"{-(-k // group)} for K={k} (strategy {strategy}, group_size {w.get('group_size')})")
    if prefix + ".weight_packed" in store:
        packed = store[prefix + ".weight_packed"]
        if packed.shape[0] != n:
            raise ShapeError(f"{store.path}: {prefix}.weight_packed has {packed.shape[0]} rows, expected {n}")
        codes = unpack_bits(packed, bits, k, dim=1)
        zp = None
        if not w.get("symmetric", True):
            zp = unpack_bits(need(store, prefix + ".weight_zero_point", "compressed-tensors weight_zero_point"),
                             bits, n, dim=0)
    else:
        q = store[prefix + ".weight"]
        if tuple(q.shape) != (n, k) or q.is_floating_point():
            raise ShapeError(f"{store.path}: {prefix}.weight is {q.dtype} {list(q.shape)}, expected int8 [{n}, {k}]")
        codes = (q.to(torch.int16) + mid).to(torch.uint8)
        zp = None
        if not w.get("symmetric", True):
            z = need(store, prefix + ".weight_zero_point", "compressed-tensors weight_zero_point")
            zp = (z.to(torch.int16).reshape(n, -1) + mid).to(torch.uint8)
    if zp is not None and tuple(zp.shape) != (n, ngroups):
        raise ShapeError(f"{store.path}: {prefix}.weight_zero_point unpacks to {list(zp.shape)}, expected {[n, ngroups]}")
    g_idx = store[prefix + ".weight_g_idx"].to(torch.int32) if prefix + ".weight_g_idx" in store else None
    return Affine(codes=codes, scales=scale, bits=bits, group_size=group, zeros=mid if zp is None else zp,
                  g_idx=g_idx, shape=(n, k))


def read_float(store: TensorStore, prefix: str, shape: tuple[int, int], g: dict[str, Any]) -> Fp8:
    """Fp8 from float-quantized tensors (tensor / channel / block scales, optional static input scale)."""
    n, _ = shape
    w = g["weights"]
    data = store[prefix + ".weight"]
    scale = need(store, prefix + ".weight_scale", "compressed-tensors weight_scale")
    block = tuple(w["block_structure"]) if (w.get("strategy") == "block") else None
    if block is None:
        scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(n)
    act = g.get("input_activations") or {}
    input_scale = None
    if act and not act.get("dynamic", False):
        input_scale = need(store, prefix + ".input_scale", "compressed-tensors static input_scale")
    return Fp8(data=data, scale=scale, block_size=block, input_scale=input_scale, shape=shape)


def read_ct(store: TensorStore, prefix: str, shape: tuple[int, int], gs: list[dict[str, Any]],
            ignore: list[str]) -> Affine | Fp8 | None:
    """The quantized weight of `prefix`, or None when it is ignored / stored as plain float."""
    if any(_matches(t, prefix) for t in ignore if t != "Linear"):
        return None
    g = scheme_for(gs, prefix)
    if g is None:
        return None
    if prefix + ".weight_packed" not in store and prefix + ".weight_scale" not in store:
        return None
    return read_float(store, prefix, shape, g) if g["weights"].get("type") == "float" else read_int(store, prefix, shape, g)


def load_compressed_tensors(path: str | Path, *, tokenizer: bool | None = None) -> Checkpoint:
    """Load an llm-compressor checkpoint (pack/naive int, float FP8; KV-cache scales kept as plain tensors)."""
    path = Path(path)
    cfg = read_config(path)
    qc = quant_config(path, cfg)
    if str(qc.get("quant_method", "")).replace("_", "-") != "compressed-tensors":
        raise UnsupportedError(f"{path}: quant_method {qc.get('quant_method')!r} is not compressed-tensors")
    if qc.get("sparsity_config"):
        raise UnsupportedError(f"{path}: compressed-tensors sparsity_config is not supported")
    gs, ignore = groups(qc, path / "config.json"), get_str_list(qc, "ignore", path / "config.json")
    return build_checkpoint(path, "compressed-tensors", lambda st, p, sh: read_ct(st, p, sh, gs, ignore), qc, cfg=cfg,
                            tokenizer=tokenizer, kv_scales=kv_scale_names)


def weight_format(config, qc: dict[str, Any], path: Path) -> WeightFormat:
    """What a compressed-tensors checkpoint's linear weights are, for the memory plan: one integer scheme
    (per channel or in groups) or FP8 for every config group; a mix of schemes is not modelled."""
    source = path / "config.json"
    schemes = {(w.get("type", "int"), get_int(w, "num_bits", source, 8), w.get("strategy") or "tensor",
                w.get("group_size"), w.get("symmetric", True) is not False, bool(w.get("actorder")))
               for w in (g["weights"] for g in groups(qc, source))}
    if len(schemes) > 1:
        raise UnsupportedError(f"{source}: config groups of different schemes are not modelled by the memory plan")
    kind, bits, strategy, group, symmetric, act_order = schemes.pop()
    if kind == "float":
        return WeightFormat("fp8", "fp8")
    if strategy not in ("channel", "group"):
        raise UnsupportedError(f"{source}: {strategy}-wise integer weights are not modelled by the memory plan")
    return affine_format("compressed-tensors", bits, group if strategy == "group" else None, symmetric, act_order)
