"""Decoders of the GGML i-quant blocks (IQ1_S .. IQ4_XS) in torch, named by ggml.types.GGML_TYPES.

The codebook grids (iq2xxs_grid, iq1s_grid, ...) are data: they are read at run time from the
installed `gguf.quants` module, which stores each as a packed hex string, and unpacked here. The
decoding math is ours, vectorized over blocks, in gguf-py's operation order (bit-identical results).
"""
from __future__ import annotations

import functools
import math

import torch

from quanta.quant.ggml.blocks import bits_of, const, f16, lut, u16, u32, unpack

IQ4_NL_VALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
IQ1_DELTA = 0.125


@functools.cache
def _grid_cpu(source: str) -> torch.Tensor:
    import gguf.quants
    cls = getattr(gguf.quants, source)
    values = list(cls.grid_map)
    bits = math.ceil(math.log2(len(values)))
    step = 8 // (8 // bits)                  # each index sits in a `step`-bit slot of a byte
    raw = torch.tensor(list(bytes.fromhex(cls.grid_hex.decode())), dtype=torch.int32)
    idx = (raw.view(-1, 1) >> torch.arange(0, 8, step, dtype=torch.int32)) & ((1 << bits) - 1)
    return torch.tensor(values, dtype=torch.float32)[idx.reshape(-1)].view(*cls.grid_shape)


@functools.cache
def grid(source: str, device: torch.device) -> torch.Tensor:
    """The codebook of gguf.quants class `source` as float32 [entries, 4 or 8] on `device`, copied there once (as
    blocks.const's tables)."""
    return _grid_cpu(source).to(device)


# ggml's ksigns_iq2xs: 7 sign bits plus an 8th that makes the count of minus signs even
KSIGNS = tuple(i | ((bin(i).count("1") & 1) << 7) for i in range(128))


def signs(idx: torch.Tensor) -> torch.Tensor:
    """+-1.0 for each of 8 elements from 7-bit ksigns indices idx [...], as float32 [..., 8]."""
    return sign_bits(const(KSIGNS, torch.int32, idx.device)[idx])


def sign_bits(x: torch.Tensor) -> torch.Tensor:
    """+1.0 where a bit of the bytes x [...] is clear, -1.0 where set, as float32 [..., 8]."""
    return torch.where(bits_of(x, 8) == 0, 1.0, -1.0)


def iq2_xxs(b):
    """d, 8 x (4 grid bytes, u32 of 4x7 sign bits + 4-bit scale): 256x8 grid of 8-vectors."""
    n = b.shape[0]
    d, raw = f16(b[:, :2]), b[:, 2:]
    aux = u32(raw).view(n, 8, 2)                     # per 32 elements: 4 grid bytes, then signs+scale
    db = (d * (0.5 + (aux[..., 1] >> 28).float()) * 0.25).view(n, 8, 1, 1)
    sg = signs((aux[..., 1].unsqueeze(-1) >> const((0, 7, 14, 21), torch.int64, b.device)) & 0x7F)
    g = grid("IQ2_XXS", b.device)[raw.reshape(n, 8, 8)[..., :4].long()]
    return (db * g * sg).reshape(n, 256)


def iq2_xs(b):
    """d, qs u16[32] (9-bit grid index + 7-bit signs), scales[8] nibbles."""
    n = b.shape[0]
    d, qs, scales = f16(b[:, :2]), u16(b[:, 2:66]), unpack(b[:, 66:], 4, 1)
    db = (d * (0.5 + scales.float()) * 0.25).view(n, 16, 1, 1)
    sg = signs(qs >> 9).view(n, 16, 2, 8)
    g = grid("IQ2_XS", b.device)[(qs & 511).long()].view(n, 16, 2, 8)
    return (db * g * sg).reshape(n, 256)


def iq2_s(b):
    """d, qs[32], signs[32], qh[8] (2 high index bits each), scales[8] nibbles; 1024x8 grid."""
    n = b.shape[0]
    d, qs, sbytes, qh, scales = f16(b[:, :2]), b[:, 2:34], b[:, 34:66], b[:, 66:74], b[:, 74:]
    db = (d * (0.5 + unpack(scales, 4, 1).float()) * 0.25).view(n, 16, 1, 1)
    sg = sign_bits(sbytes).view(n, 16, 2, 8)
    idx = qs.to(torch.int32) | (unpack(qh, 2, 1) << 8)
    g = grid("IQ2_S", b.device)[idx.long()].view(n, 16, 2, 8)
    return (db * g * sg).reshape(n, 256)


def iq3_xxs(b):
    """d, qs[64] grid bytes, 8 x u32 (4x7 sign bits + 4-bit scale); 256x4 grid."""
    n = b.shape[0]
    d, qs, aux = f16(b[:, :2]), b[:, 2:66], u32(b[:, 66:])
    db = (d * (0.5 + (aux >> 28).float()) * 0.5).view(n, 8, 1, 1)
    sg = signs((aux.unsqueeze(-1) >> const((0, 7, 14, 21), torch.int64, b.device)) & 0x7F)
    g = grid("IQ3_XXS", b.device)[qs.long()].view(n, 8, 4, 8)
    return (db * g * sg).reshape(n, 256)


def iq3_s(b):
    """d, qs[64], qh[8] (9th index bit), signs[32], scales[4] nibbles; 512x4 grid."""
    n = b.shape[0]
    d, qs, qh, sbytes, scales = f16(b[:, :2]), b[:, 2:66], b[:, 66:74], b[:, 74:106], b[:, 106:]
    db = (d * (1 + 2 * unpack(scales, 4, 1)).float()).view(n, 8, 1, 1)
    sg = sign_bits(sbytes).view(n, 8, 4, 8)
    idx = qs.to(torch.int32) | (bits_of(qh.to(torch.int32), 8).reshape(n, 64) << 8)
    g = grid("IQ3_S", b.device)[idx.long()].view(n, 8, 4, 8)
    return (db * g * sg).reshape(n, 256)


def iq1_s(b):
    """d, qs[32], qh u16[8] (3 high index bits x4, 3-bit scale, delta sign); 2048x8 grid."""
    n = b.shape[0]
    d, qs, qh = f16(b[:, :2]), b[:, 2:34], u16(b[:, 34:])
    dl = (d * (2 * ((qh >> 12) & 7) + 1).float()).view(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA).view(n, 8, 1, 1)
    high = (qh.unsqueeze(-1) >> const((0, 3, 6, 9), torch.int64, b.device)) & 7
    idx = qs.to(torch.int32) | (high.reshape(n, 32) << 8)
    g = grid("IQ1_S", b.device)[idx.long()].view(n, 8, 4, 8)
    return (dl * (g + delta)).reshape(n, 256)


def iq1_m(b):
    """qs[32], qh[16] (3 index bits + delta sign per nibble), scales u16[4] (3-bit scales + f16 d)."""
    n = b.shape[0]
    qs, qh, sc = b[:, :32], unpack(b[:, 32:48], 4, 1), u16(b[:, 48:])
    # the f16 super-block scale is spread over the top nibbles of the four scale words
    dbits = (sc[:, 0] >> 12) | ((sc[:, 1] & 0xF000) >> 8) | ((sc[:, 2] & 0xF000) >> 4) | (sc[:, 3] & 0xF000)
    d = f16(torch.stack([dbits & 0xFF, dbits >> 8], dim=1).to(torch.uint8))
    sub = (sc.unsqueeze(-1) >> const((0, 3, 6, 9), torch.int64, b.device)) & 7
    dl = (d * (2 * sub.reshape(n, 16) + 1).float()).view(n, 8, 2, 1, 1)
    delta = torch.where((qh & 0x08) == 0, IQ1_DELTA, -IQ1_DELTA).view(n, 8, 2, 2, 1)
    idx = qs.to(torch.int32) | ((qh & 7) << 8)
    g = grid("IQ1_M", b.device)[idx.long()].view(n, 8, 2, 2, 8)
    return (dl * (g + delta)).reshape(n, 256)


def iq4_nl(b):
    """d f16, qs[16] nibbles into the 16-value non-linear table."""
    return f16(b[:, :2]) * lut(IQ4_NL_VALUES, b.device)[unpack(b[:, 2:], 4, 16)]


def iq4_xs_scales(b):
    """IQ4_XS blocks' d (float32 [nb, 1]) and their 8 groups' 6-bit scales ls (int32 [nb, 8]; a group's scale is
    d * (ls - 32)): scales_l[4]'s nibbles the low 4 bits, scales_h's bit pairs the high 2."""
    sh = (u16(b[:, 2:4]) >> torch.arange(0, 16, 2, device=b.device)) & 3
    return f16(b[:, :2]), unpack(b[:, 4:8], 4, 1) | (sh << 4)


def iq4_xs(b):
    """d, scales_h u16, scales_l[4] (6-bit scales, -32), qs[128] nibbles into the iq4_nl table."""
    n = b.shape[0]
    d, ls = iq4_xs_scales(b)
    dl = (d * (ls - 32).float()).view(n, 8, 1)
    q = lut(IQ4_NL_VALUES, b.device)[unpack(b[:, 8:], 4, 16)].view(n, 8, 32)
    return (dl * q).reshape(n, 256)
