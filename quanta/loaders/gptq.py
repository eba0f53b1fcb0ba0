"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum/transformers) -> canonical Affine.

qweight int32 [K*b/32, N] is a dense little-endian bit stream along the INPUT dim (b = 2, 3, 4, 8);
qzeros int32 [G, N*b/32] the same along the output dim; scales [G, N]; g_idx [K] (act-order).
W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]. Format v1 ("gptq") stores z - 1: GPTQModel's
`convert_gptq_v1_to_v2_format_module` adds 0x55555555 / 0x11111111 / 0x01010101 to the packed words
(2/4/8-bit, carries included) and +1 to each 3-bit field; we do the same. v2 ("gptq_v2") stores z.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quanta.loaders.checkpoint import Checkpoint
from quanta.loaders.config_fields import get_bool, get_int
from quanta.loaders.quantized import check_shapes, group_geometry, group_size, load_packed, need, unpack_bits
from quanta.loaders.safetensors_io import TensorStore
from quanta.loaders.weight_format import WeightFormat, affine_format
from quanta.quant.errors import ConfigError, ShapeError, UnsupportedError
from quanta.quant.kinds import Affine

BITS = (2, 3, 4, 8)
FORMATS = ("gptq", "gptq_v2")
V1_WORD_OFFSET = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}     # GPTQModel utils/model.py


def gptq_settings(qc: dict[str, Any], source: Path) -> dict[str, Any]:
    """Normalize a GPTQ config (AutoGPTQ / GPTQModel / optimum spellings)."""
    method = str(qc.get("quant_method", "gptq")).lower()
    if method != "gptq":
        raise UnsupportedError(f"{source}: quant_method {method!r} is not GPTQ")
    if qc.get("bits", qc.get("w_bit")) is None:
        raise ConfigError(f"{source}: GPTQ config has no bits field")
    bits, group = get_int(qc, ("bits", "w_bit"), source), group_size(qc, ("group_size", "q_group_size"), source, -1)
    if bits not in BITS:
        raise UnsupportedError(f"{source}: GPTQ bits={bits} is not supported (supported: {BITS})")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in FORMATS:
        raise UnsupportedError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported (supported: {FORMATS})")
    pack = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack != "int32":
        raise UnsupportedError(f"{source}: GPTQ pack_dtype {pack!r} is not supported (only int32)")
    return {"bits": bits, "group_size": group, "sym": get_bool(qc, "sym", source, True),
            "desc_act": get_bool(qc, "desc_act", source, False), "checkpoint_format": fmt}


def v1_to_v2_zeros(qzeros: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Unpacked true zero points [G, N] from v1 qzeros, as GPTQModel's v1->v2 conversion computes them."""
    if bits == 3:
        return (unpack_bits(qzeros, 3, n, dim=1) + 1) & 0x7
    words = (qzeros.to(torch.int64) + V1_WORD_OFFSET[bits]) & 0xFFFFFFFF
    return unpack_bits(words, bits, n, dim=1)


def read_gptq(store: TensorStore, prefix: str, shape: tuple[int, int], s: dict[str, Any]) -> Affine | None:
    """The Affine weight of linear `prefix` ([N, K] = `shape`), or None if it is stored unquantized."""
    if prefix + ".qweight" not in store:
        return None
    n, k = shape
    bits = s["bits"]
    group, ngroups = group_geometry(s["group_size"], k)
    qweight = store[prefix + ".qweight"]
    qzeros = need(store, prefix + ".qzeros", "GPTQ qzeros (zero points)")
    scales = need(store, prefix + ".scales", "GPTQ scales")
    check_shapes(store, prefix, {"qweight": qweight, "qzeros": qzeros, "scales": scales},
                 {"qweight": (-(-k * bits // 32), n), "qzeros": (ngroups, -(-n * bits // 32)), "scales": (ngroups, n)},
                 f"a {bits}-bit GPTQ layer [{n}, {k}] with group_size {s['group_size']}")
    codes = unpack_bits(qweight, bits, k, dim=0).T.contiguous()
    if s["checkpoint_format"] == "gptq":
        zeros = v1_to_v2_zeros(qzeros, bits, n)
    else:
        zeros = unpack_bits(qzeros, bits, n, dim=1)
    zeros = zeros.T.contiguous()
    g_idx = store[prefix + ".g_idx"] if prefix + ".g_idx" in store else None
    if g_idx is not None:
        if tuple(g_idx.shape) != (k,):
            raise ShapeError(f"{store.path}: {prefix}.g_idx has shape {list(g_idx.shape)}, expected [{k}]")
        if torch.equal(g_idx.long(), torch.arange(k, device=g_idx.device) // group):
            g_idx = None                                # the default order: plain groups
        elif int(g_idx.min()) < 0 or int(g_idx.max()) >= ngroups:
            raise ShapeError(f"{store.path}: {prefix}.g_idx holds groups outside 0..{ngroups - 1}")
        else:
            g_idx = g_idx.to(torch.int32)
    mid = 1 << (bits - 1)
    zero: torch.Tensor | int = mid if s["sym"] and bool((zeros == mid).all()) else zeros
    return Affine(codes=codes, scales=scales.T.contiguous(), bits=bits, group_size=group, zeros=zero, g_idx=g_idx,
                  shape=(n, k))


def load_gptq(path: str | Path, *, tokenizer: bool | None = None) -> Checkpoint:
    """Load a GPTQ checkpoint directory (v1 or v2; config in config.json, quantize_config.json or quant_config.json)."""
    return load_packed(path, "gptq", gptq_settings, read_gptq, tokenizer=tokenizer)


def weight_format(config, qc: dict[str, Any], path: Path) -> WeightFormat:
    """What a GPTQ checkpoint's linear weights are, for the memory plan (formats.Format.weights)."""
    s = gptq_settings(qc, path)
    return affine_format("gptq", s["bits"], s["group_size"], symmetric=s["sym"], act_order=s["desc_act"])
