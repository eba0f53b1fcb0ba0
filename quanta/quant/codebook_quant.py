"""NF4 / FP4 quantization into the `Codebook` kind, as bitsandbytes' `quantize_4bit` does it.

    quantize_4bit(w [N, K] float, quant_type="nf4", blocksize=64, double_quant=False) -> Codebook

Results are float32 computations of the float32 weight, as bitsandbytes computes on a float32 input.
"""
from __future__ import annotations

import math

import torch

from quanta.quant.chunks import chunk_rows
from quanta.quant.errors import ConfigError
from quanta.quant.kinds.codebook import FP4_TABLE, NF4_TABLE, Codebook

TABLES = {"nf4": NF4_TABLE, "fp4": FP4_TABLE}
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256


def dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes `create_dynamic_map(signed=True)`: the 256-entry map of double-quantized absmax."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:                  # never taken with the defaults (7 exponent bits of 7)
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0, 1.0]
    data += [0] * (2 ** total_bits - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def blockwise_absmax(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax [blocks], flat / absmax clamped to [-1, 1]) over float32 `flat`, the last block short."""
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = blocks.abs().max(dim=-1)[0]
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if n % blocksize:
        am = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / am, -1, 1)])
    return absmax, scaled


def nearest_code(scaled: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index (uint8) of the nearest entry of `table` for every value, ties to the larger entry."""
    order = torch.argsort(table)
    sorted_table = table[order]
    bounds = (sorted_table[:-1] + sorted_table[1:]) / 2
    return order[torch.bucketize(scaled, bounds, out_int32=True).long()].to(torch.uint8)


def lut_code(scaled: torch.Tensor, table: torch.Tensor, lut_size: int = 65536) -> torch.Tensor:
    """bitsandbytes' CPU 8-bit quantizer: the nearest entry of a sorted 256-entry `table`, looked up in a
    table of `lut_size` bins over [-1, 1] (each bin takes the entry nearest its left edge)."""
    midpoints = 0.5 * (table[:-1] + table[1:])
    grid = -1.0 + (2.0 * torch.arange(lut_size, dtype=torch.float32, device=table.device)) / (lut_size - 1)
    lut = torch.searchsorted(midpoints, grid, side="left")
    index = ((scaled.clamp(-1.0, 1.0) + 1.0) * 0.5 * (lut_size - 1) + 0.5).to(torch.int64)
    return lut[index].to(torch.uint8)


def quantize_blockwise_8bit(values: torch.Tensor, blocksize: int = NESTED_BLOCKSIZE):
    """bitsandbytes `quantize_blockwise` (CPU backend) with the dynamic map: (codes uint8, absmax, map)."""
    flat = values.reshape(-1).float()
    table = dynamic_map().to(flat.device)
    n = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, -n % blocksize)).reshape(-1, blocksize)
    absmax = padded.abs().amax(dim=1)
    inv = torch.where(absmax == 0, torch.zeros_like(absmax), 1.0 / absmax)
    codes = lut_code((padded * inv.unsqueeze(1)).reshape(-1)[:n], table)
    codes[(absmax == 0).repeat_interleave(blocksize)[:n]] = 0
    return codes, absmax, table


def quantize_4bit(w: torch.Tensor, quant_type: str = "nf4", blocksize: int = 64, double_quant: bool = False,
                  name: str = "weight") -> Codebook:
    """w [N, K] as a bitsandbytes 4-bit `Codebook`; ConfigError for bad options.

    Blocks of `blocksize` run over the row-major flattened weight (the last block may be short):
        absmax[b] = max |w| over block b,  x = clamp(w / absmax, -1, 1)
        code = index of the nearest table entry, ties going up (bucketize on the midpoints of the
               sorted table, which is bitsandbytes' default backend; FP4's table is unsorted, so the
               sorted index is mapped back)
    With double quantization the absmax is stored as 8-bit codes of the signed dynamic map:
        offset = mean(absmax), blockwise 8-bit quantization of (absmax - offset) in blocks of 256, done as
        bitsandbytes' CPU backend does it (a 65536-bin lookup table: x * (1 / absmax) picks a bin, each bin
        the entry nearest its left edge), which can differ from exact nearest by one code near a midpoint."""
    if quant_type not in TABLES:
        raise ConfigError(f"{name}: quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    if blocksize not in BLOCKSIZES:
        raise ConfigError(f"{name}: blocksize must be one of {BLOCKSIZES}, got {blocksize!r}")
    if w.dim() != 2 or not w.is_floating_point():
        raise ConfigError(f"{name}: 4-bit quantization needs a 2-D float weight, got {w.dtype} {list(w.shape)}")
    table = torch.tensor(TABLES[quant_type], dtype=torch.float32, device=w.device)
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    absmax = torch.empty(-(-n * k // blocksize), dtype=torch.float32, device=w.device)
    unit = blocksize // math.gcd(k, blocksize)                  # rows that end on a block boundary
    step = -(-chunk_rows(k, w.device) // unit) * unit
    for r in range(0, n, step):                                 # a block of rows at a time: bounded scratch
        am, scaled = blockwise_absmax(w[r:r + step].reshape(-1).float(), blocksize)
        absmax[r * k // blocksize:][:am.numel()] = am
        codes[r:r + step] = nearest_code(scaled, table).reshape(-1, k)
    kw = {}
    if double_quant:
        offset = absmax.mean()
        q_absmax, nested_absmax, nested_table = quantize_blockwise_8bit(absmax - offset)
        kw = dict(nested_table=nested_table, nested_absmax=nested_absmax, nested_blocksize=NESTED_BLOCKSIZE,
                  nested_offset=float(offset))
        absmax = q_absmax
    dtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.float32
    return Codebook(codes=codes, table=table, blocksize=blocksize, absmax=absmax, quant_type=quant_type,
                    dtype=dtype, **kw)
