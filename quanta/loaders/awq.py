"""AutoAWQ checkpoints (GEMM and GEMV layouts, 4-bit, any group size, zero point) -> canonical Affine.

GEMM (awq/modules/linear/gemm.py): qweight int32 [K, N/8] packed along the OUTPUT dim in the order
[0,2,4,6,1,3,5,7] (logical column n of word n//8 sits at nibble AWQ_REVERSE_ORDER[n%8]); qzeros the same
on [K/G, N/8]; scales fp16 [K/G, N]. GEMV (gemv.py): qweight [N, K/8] packed sequentially along K, qzeros
[N, W] and scales [N, 8W] padded to `calculate_zeros_width`. W = (q - z) * s, no zero offset.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quanta.loaders.checkpoint import Checkpoint
from quanta.loaders.config_fields import get_bool, get_int, get_str, get_str_list
from quanta.loaders.quantized import check_shapes, group_geometry, group_size, load_packed, need, unpack_bits
from quanta.loaders.safetensors_io import TensorStore
from quanta.loaders.weight_format import WeightFormat, affine_format
from quanta.quant.chunks import chunk_rows
from quanta.quant.errors import ConfigError, ShapeError, UnsupportedError
from quanta.quant.kinds import Affine

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
VERSIONS = ("gemm", "gemv")


def awq_settings(qc: dict[str, Any], source: Path) -> dict[str, Any]:
    """Normalize an AWQ quantization config (transformers or old quant_config.json spelling)."""
    method = str(qc.get("quant_method", "awq")).lower()
    if method != "awq":
        raise UnsupportedError(f"{source}: quant_method {method!r} is not AWQ")
    if qc.get("bits", qc.get("w_bit")) is None or qc.get("group_size", qc.get("q_group_size")) is None:
        raise ConfigError(f"{source}: AWQ config needs bits (w_bit) and group_size (q_group_size), got {sorted(qc)}")
    bits, group = get_int(qc, ("bits", "w_bit"), source), group_size(qc, ("group_size", "q_group_size"), source)
    version = get_str(qc, ("version", "format"), source, "gemm").lower()
    if bits != 4:
        raise UnsupportedError(f"{source}: AWQ bits={bits} is not supported (AutoAWQ packs only 4-bit)")
    if version not in VERSIONS:
        raise UnsupportedError(f"{source}: AWQ version {version!r} is not supported (supported: {', '.join(VERSIONS)})")
    return {"bits": 4, "group_size": group, "zero_point": get_bool(qc, "zero_point", source, True), "version": version,
            "modules_to_not_convert": get_str_list(qc, "modules_to_not_convert", source)}


def unpack_gemm(packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM int32 [R, N/8] -> uint8 [R, N] in logical column order (a few rows at a time: bounded
    int64 scratch)."""
    shifts = 4 * torch.tensor(AWQ_REVERSE_ORDER, dtype=torch.int64, device=packed.device)
    out = torch.empty(packed.shape[0], 8 * packed.shape[1], dtype=torch.uint8, device=packed.device)
    step = chunk_rows(out.shape[1], packed.device)
    for r in range(0, packed.shape[0], step):
        nib = (packed[r:r + step].to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
        out[r:r + step] = nib.reshape(nib.shape[0], -1)
    return out


def read_awq(store: TensorStore, prefix: str, shape: tuple[int, int], s: dict[str, Any]) -> Affine | None:
    """The Affine weight of linear `prefix` ([N, K] = `shape`), or None if it is stored unquantized."""
    if prefix + ".qweight" not in store:
        return None
    n, k = shape
    group, ngroups = group_geometry(s["group_size"], k)
    qweight = store[prefix + ".qweight"]
    scales = need(store, prefix + ".scales", "AWQ scales")
    if not s["zero_point"] and prefix + ".qzeros" not in store:
        raise UnsupportedError(f"{store.path}: {prefix}: AWQ zero_point=false has no published packing "
                               "(AutoAWQ's packers require zeros)")
    qzeros = need(store, prefix + ".qzeros", "AWQ qzeros (zero points)")
    if s["version"] == "gemm":
        check_shapes(store, prefix, {"qweight": qweight, "qzeros": qzeros, "scales": scales},
                     {"qweight": (k, n // 8), "qzeros": (ngroups, n // 8), "scales": (ngroups, n)},
                     f"an AWQ GEMM layer [{n}, {k}] with group_size {group}")
        codes = unpack_gemm(qweight).T.contiguous()
        zeros = unpack_gemm(qzeros).T.contiguous()
        scales = scales.T.contiguous()
    else:
        if tuple(qweight.shape) != (n, k // 8) or qzeros.shape[0] != n or scales.shape[0] != n \
                or qzeros.shape[1] * 8 < ngroups or scales.shape[1] < ngroups:
            raise ShapeError(f"{store.path}: {prefix}: AWQ GEMV qweight {list(qweight.shape)} / qzeros "
                             f"{list(qzeros.shape)} / scales {list(scales.shape)} do not fit [{n}, {k}] g{group}")
        codes = unpack_bits(qweight, 4, k, dim=1)
        zeros = unpack_bits(qzeros, 4, ngroups, dim=1)
        scales = scales[:, :ngroups].contiguous()
    return Affine(codes=codes, scales=scales, bits=4, group_size=group, zeros=zeros, shape=(n, k))


def load_awq(path: str | Path, *, tokenizer: bool | None = None) -> Checkpoint:
    """Load an AutoAWQ checkpoint directory: quantized linears become Affine int4 (skipped ones stay plain)."""
    return load_packed(path, "awq", awq_settings, read_awq, tokenizer=tokenizer)


def weight_format(config, qc: dict[str, Any], path: Path) -> WeightFormat:
    """What an AWQ checkpoint's linear weights are, for the memory plan (formats.Format.weights)."""
    s = awq_settings(qc, path)
    return affine_format("awq", s["bits"], s["group_size"], symmetric=False)
