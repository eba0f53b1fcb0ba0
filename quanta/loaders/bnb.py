"""bitsandbytes checkpoints as transformers serializes them -> Codebook (NF4/FP4) or Affine (LLM.int8).

4-bit (bitsandbytes nn/modules.py Linear4bit._save_to_state_dict): `weight` uint8 [ceil(N*K/2), 1] holding the
row-major flattened codes, element 2i in the HIGH nibble; `weight.absmax` (float32, or uint8 codes with double
quant), `weight.quant_map` [16], `weight.nested_absmax` / `weight.nested_quant_map` (double quant) and
`weight.quant_state.bitsandbytes__{nf4,fp4}` (UTF-8 JSON: quant_type, blocksize, dtype, shape, nested_*).
8-bit (Linear8bitLt): `weight` int8 [N, K] (CB) and `SCB` float32 [N]; bnb dequantizes CB * SCB / 127.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from quanta.loaders.checkpoint import Checkpoint
from quanta.loaders.config_fields import get_bool
from quanta.loaders.quantized import build_checkpoint, need, quant_config
from quanta.loaders.safetensors_io import TensorStore, read_config
from quanta.loaders.weight_format import WeightFormat
from quanta.quant.errors import CorruptFileError, ShapeError, UnsupportedError
from quanta.quant.kinds import Affine, Codebook

QUANT_TYPES = ("nf4", "fp4")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def quant_state(store: TensorStore, prefix: str) -> tuple[str, dict[str, Any]] | None:
    """(stored name, parsed JSON) of a layer's packed 4-bit quant_state, or None for a non-4-bit layer."""
    for qt in QUANT_TYPES:
        name = f"{prefix}.weight.quant_state.bitsandbytes__{qt}"
        if name in store:
            raw = bytes(store[name].to(torch.uint8).tolist())
            try:
                return name, json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CorruptFileError(f"{store.path}: tensor {name!r} is not a JSON quant_state: {e}") from e
    return None


def read_4bit(store: TensorStore, prefix: str, shape: tuple[int, int], name: str, qs: dict[str, Any]) -> Codebook:
    """A Codebook from one Linear4bit's serialized tensors."""
    n, k = shape
    if [int(x) for x in qs.get("shape", shape)] != [n, k]:
        raise ShapeError(f"{store.path}: {name} says shape {qs.get('shape')}, config.json implies {[n, k]}")
    packed = store[prefix + ".weight"]
    packed = packed.contiguous().view(torch.uint8).reshape(-1)
    if packed.numel() * 2 < n * k:
        raise ShapeError(f"{store.path}: {prefix}.weight holds {packed.numel()} bytes, too few for {n}x{k} 4-bit codes")
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[: n * k].reshape(n, k)
    dtype = DTYPES.get(str(qs.get("dtype", "float16")).removeprefix("torch."))
    if dtype is None:
        raise UnsupportedError(f"{store.path}: {name}: dtype {qs.get('dtype')!r} is not supported")
    kw: dict[str, Any] = {}
    if "nested_blocksize" in qs or prefix + ".weight.nested_absmax" in store:
        kw = dict(nested_table=need(store, prefix + ".weight.nested_quant_map", "bnb nested_quant_map"),
                  nested_absmax=need(store, prefix + ".weight.nested_absmax", "bnb nested_absmax"),
                  nested_blocksize=int(qs.get("nested_blocksize", 256)),
                  nested_offset=float(qs.get("nested_offset", 0.0)))
    return Codebook(codes=codes, table=need(store, prefix + ".weight.quant_map", "bnb quant_map").float(),
                    blocksize=int(qs["blocksize"]), absmax=need(store, prefix + ".weight.absmax", "bnb absmax"),
                    shape=(n, k), quant_type=qs.get("quant_type", name.rsplit("__", 1)[1]), dtype=dtype, **kw)


def read_int8(store: TensorStore, prefix: str, shape: tuple[int, int]) -> Affine:
    """An Affine int8 from LLM.int8 `weight` (CB) + `SCB`: codes CB+128, zero 128, scale SCB per row and
    post_scale 1/127, so that dequantize() rounds exactly as bitsandbytes' (CB * SCB) * (1/127) does."""
    n, k = shape
    cb = store[prefix + ".weight"]
    scb = need(store, prefix + ".SCB", "bnb int8 SCB (row scales)")
    if cb.dtype != torch.int8 or tuple(cb.shape) != (n, k) or tuple(scb.shape) != (n,):
        raise ShapeError(f"{store.path}: {prefix}: int8 weight {cb.dtype} {list(cb.shape)} / SCB {list(scb.shape)} "
                         f"do not fit [{n}, {k}]")
    codes = (cb.to(torch.int16) + 128).to(torch.uint8)
    return Affine(codes=codes, scales=scb.float().reshape(n, 1), bits=8, group_size=k, zeros=128,
                  post_scale=7.874015718698502e-3, shape=(n, k))       # bnb's float32 1/127 constant


def read_bnb(store: TensorStore, prefix: str, shape: tuple[int, int]) -> Codebook | Affine | None:
    """The quantized weight of linear `prefix`, or None when it is stored as a plain float tensor."""
    if (found := quant_state(store, prefix)) is not None:
        return read_4bit(store, prefix, shape, *found)
    if prefix + ".SCB" in store:
        return read_int8(store, prefix, shape)
    if prefix + ".weight.absmax" in store:
        raise CorruptFileError(f"{store.path}: {prefix}.weight.quant_state.bitsandbytes__nf4/fp4 is missing "
                               "(4-bit quant_state)")
    if prefix + ".weight" in store and store.info(prefix + ".weight").dtype == "I8":
        raise CorruptFileError(f"{store.path}: tensor {prefix + '.SCB'!r} (bnb int8 row scales) is missing")
    return None


def load_bnb(path: str | Path, *, tokenizer: bool | None = None) -> Checkpoint:
    """Load a transformers + bitsandbytes checkpoint (4-bit NF4/FP4 ± double quant, or 8-bit LLM.int8)."""
    path = Path(path)
    cfg = read_config(path)
    qc = quant_config(path, cfg)
    return build_checkpoint(path, "bnb", read_bnb, qc, cfg=cfg, tokenizer=tokenizer)


def weight_format(config, qc: dict[str, Any], path: Path) -> WeightFormat:
    """What a bitsandbytes checkpoint's linear weights are, for the memory plan: 4-bit codes in blocks of 64
    (bitsandbytes' default; a file's own blocksize sits in each weight's quant state). LLM.int8 is not
    modelled (UnsupportedError)."""
    if not get_bool(qc, "load_in_4bit", path, True) or get_bool(qc, "load_in_8bit", path, False):
        raise UnsupportedError(f"{path}: bitsandbytes 8-bit checkpoints are not modelled by the memory plan")
    return WeightFormat("nf4", "codebook", 4, 64)
