"""Decoders of GGML blocks in torch: float, legacy (Q4_0..Q8_1), K-quants, ternary, FP4 and Q1_0 types.

Each decoder maps uint8 blocks [nb, type_size] to float32 values [nb, block_size], vectorized over
blocks; the type table (ggml.types.GGML_TYPES) names each type's decoder (the i-quants' are in
iquants.py).
The float operations follow gguf-py's `quants.py` in the same order, so results are bit-identical
to `gguf.quants.dequantize` (and so to ggml's `dequantize_row_*`). Layouts: ggml-common.h.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# uint8 blocks [nb, type_size] -> float32 values [nb, block_size]
Decoder = Callable[[torch.Tensor], torch.Tensor]


# --- byte helpers ---------------------------------------------------------------------------------
def split(b: torch.Tensor, *sizes: int) -> tuple[torch.Tensor, ...]:
    """Split blocks [nb, type_size] into byte fields of `sizes`; the last field takes the rest."""
    return torch.split(b, [*sizes, b.shape[1] - sum(sizes)], dim=1)


def f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 fields [nb, 2m] as float32 [nb, m]."""
    return b.contiguous().view(torch.float16).float()


def u16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 fields [nb, 2m] as int32 [nb, m]."""
    b = b.to(torch.int32)
    return b[:, 0::2] | (b[:, 1::2] << 8)


def u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 fields [nb, 4m] as int64 [nb, m]."""
    b = b.to(torch.int64)
    return b[:, 0::4] | (b[:, 1::4] << 8) | (b[:, 2::4] << 16) | (b[:, 3::4] << 24)


def unpack(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Split each byte of x [nb, m] into 8/bits fields, low bits first, as int32 [nb, m*8/bits].

    Bytes are taken in runs of `group`: the output holds field 0 of a run, then field 1 of the same
    run, ... (gguf-py's `x.reshape(nb, -1, 1, group) >> shifts.reshape(1, 1, -1, 1)`).
    """
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=x.device).view(1, 1, -1, 1)
    x = x.to(torch.int32).view(x.shape[0], -1, 1, group)
    return ((x >> shifts) & ((1 << bits) - 1)).reshape(x.shape[0], -1)


def bits_of(x: torch.Tensor, n: int) -> torch.Tensor:
    """Bits 0..n-1 of each integer of x [nb, m] as int [nb, m, n]."""
    return (x.unsqueeze(-1) >> torch.arange(n, device=x.device)) & 1


@functools.cache
def const(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor on `device`, made once a device: the decoders also run while a CUDA graph is
    captured (a GGUF embedding's row lookup in a decode step), where a copy from host memory would fail."""
    return torch.tensor(values, dtype=dtype, device=device)


def lut(values: list[float], device: torch.device) -> torch.Tensor:
    """A float32 lookup table on `device` (const's)."""
    return const(tuple(values), torch.float32, torch.device(device))


# --- float types ----------------------------------------------------------------------------------
def f32_blocks(b):
    """f32 values as stored."""
    return b.contiguous().view(torch.float32)


def f16_blocks(b):
    """f16 values, widened."""
    return f16(b)


def bf16_blocks(b):
    """bf16 values, widened (exact)."""
    return b.contiguous().view(torch.bfloat16).float()


# --- legacy 32-element blocks ---------------------------------------------------------------------
_BIT = tuple(range(8))


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """The 32 codes [nb, 32], uint8 throughout (one byte a code), of 16 bytes qs [nb, 16] holding them as ggml's
    32-value blocks do: the low nibbles first, then the high ones."""
    return torch.cat([qs & 0xF, qs >> 4], dim=1)


def legacy_codes(name: str, b: torch.Tensor) -> torch.Tensor:
    """The unsigned codes q [nb, 32], uint8, of a Q4_0 / Q4_1 / Q5_0 / Q5_1 block (value (q-8)d, qd+m, ...)."""
    q = nibbles(b[:, -16:])
    if name in ("q5_0", "q5_1"):
        qh = b[:, -20:-16].unsqueeze(-1) >> const(_BIT, torch.uint8, b.device)   # bit j of the u32: element j's 5th
        q |= (qh & 1).view(-1, 32) << 4
    return q


def q4_0(b):
    """d f16, qs[16] nibbles: (q - 8) * d."""
    return f16(b[:, :2]) * (legacy_codes("q4_0", b) - 8).view(torch.int8).float()   # uint8 wraps to q - 8


def q4_1(b):
    """d f16, m f16, qs[16] nibbles: q * d + m."""
    return f16(b[:, :2]) * legacy_codes("q4_1", b).float() + f16(b[:, 2:4])


def q5_0(b):
    """d f16, qh u32 (5th bits), qs[16]: (q - 16) * d."""
    return f16(b[:, :2]) * (legacy_codes("q5_0", b) - 16).view(torch.int8).float()


def q5_1(b):
    """d f16, m f16, qh u32, qs[16]: q * d + m."""
    return f16(b[:, :2]) * legacy_codes("q5_1", b).float() + f16(b[:, 2:4])


def q8_0(b):
    """d f16, qs int8[32]: q * d."""
    return b[:, 2:].view(torch.int8).float() * f16(b[:, :2])


def q8_1(b):
    """d f16, s f16 (d * sum(qs), unused here), qs int8[32]: q * d."""
    return b[:, 4:].view(torch.int8).float() * f16(b[:, :2])


# --- K-quants (256-element super-blocks) ----------------------------------------------------------
def q2_k(b):
    """scales[16] (lo4 scale, hi4 min), qs[64] 2-bit, d, dmin: d*sc*q - dmin*m per 16 elements."""
    n = b.shape[0]
    scales, qs, d, dmin = split(b, 16, 64, 2)
    d, dmin, scales = f16(d), f16(dmin), scales.to(torch.int32)
    dl = (d * (scales & 0xF).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = unpack(qs, 2, 32).view(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def q3_k(b):
    """hmask[32], qs[64] 2-bit, scales[12] 6-bit (-32), d: d*sc*(q2 - 4*!hbit) per 16 elements."""
    n = b.shape[0]
    hmask, qs, scales, d = split(b, 32, 64, 12)
    low, high = unpack(scales[:, :8], 4, 8), unpack(scales[:, 8:], 2, 4)
    scales = (((low & 0xF) | ((high & 3) << 4)) - 32).float()
    dl = (f16(d) * scales).view(n, 16, 1)
    ql = unpack(qs, 2, 32).view(n, 16, 16)
    qh = unpack(hmask, 1, 32).view(n, 16, 16)
    q = ql - ((qh ^ 1) << 2)   # the 3rd bit SET means no -4 offset
    return (dl * q.float()).reshape(n, 256)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins packed in 12 bytes (Q4_K / Q5_K), int32 [nb, 8] each."""
    s = scales.to(torch.int32)
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = k_scale_min(b[:, 4:16])
    d = (f16(b[:, 0:2]) * sc.float()).view(n, 8, 1)
    dm = (f16(b[:, 2:4]) * mn.float()).view(n, 8, 1)
    return (d * q.view(n, 8, 32).float() - dm).reshape(n, 256)


def q4_k(b):
    """d, dmin, scales[12] (8 six-bit scales + mins), qs[128]: d*sc*q - dmin*m per 32 elements."""
    return _k_affine(b, unpack(b[:, 16:], 4, 32))


def q4_k_affine(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks as affine groups of 32 with float mins, exactly: codes uint8 [nb, 256], scales d*sc and mins
    -dmin*m float32 [nb, 8] (an fp16 times a 6-bit integer is exact in float32), so codes * scales + mins is
    q4_k(b) bit for bit."""
    n = b.shape[0]
    sc, mn = k_scale_min(b[:, 4:16])
    return (unpack(b[:, 16:], 4, 32).to(torch.uint8), (f16(b[:, 0:2]) * sc.float()).view(n, 8),
            -(f16(b[:, 2:4]) * mn.float()).view(n, 8))


def q5_k(b):
    """d, dmin, scales[12], qh[32], qs[128]: as q4_K with a 5th bit."""
    ql, qh = unpack(b[:, 48:], 4, 32), unpack(b[:, 16:48], 1, 32)
    return _k_affine(b, ql | (qh << 4))


def q6_k(b):
    """ql[128], qh[64], scales int8[16], d: d*sc*(q - 32) per 16 elements."""
    n = b.shape[0]
    ql, qh, scales, d = split(b, 128, 64, 16)
    d = (f16(d) * scales.view(torch.int8).float()).view(n, 16, 1)
    q = ((unpack(ql, 4, 64) | (unpack(qh, 2, 32) << 4)) - 32).view(n, 16, 16)
    return (d * q.float()).reshape(n, 256)


def q8_k(b):
    """d f32, qs int8[256], bsums int16[16] (for dot products, unused here): q * d."""
    return b[:, 4:260].view(torch.int8).float() * b[:, :4].contiguous().view(torch.float32)


# --- ternary --------------------------------------------------------------------------------------
def tq1_0(b):
    """qs[48] (5 trits/byte), qh[4] (4 trits/byte), d: (t - 1) * d."""
    n = b.shape[0]
    qs, qh, d = split(b, 48, 4)
    pow3 = const((1, 3, 9, 27, 81), torch.int32, b.device)

    def trits(x, k):   # each byte holds k base-3 digits as a fixed-point fraction of 256
        return ((x.to(torch.int32).view(n, 1, -1) * pow3[:k].view(1, k, 1)) & 0xFF).reshape(n, -1)
    q = torch.cat([trits(qs[:, :32], 5), trits(qs[:, 32:], 5), trits(qh, 4)], dim=1)
    return f16(d) * (((q * 3) >> 8) - 1).float()


def tq2_0(b):
    """qs[64] 2-bit, d: (q - 1) * d."""
    qs, d = split(b, 64)
    return f16(d) * (unpack(qs, 2, 32) - 1).float()


# --- 4-bit floats (e2m1 values doubled, as ggml's kvalues_mxfp4) ----------------------------------
E2M1_X2 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2**(e-127) / 2 for the uint8 exponents e, as float32."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def ue4m3_half(x: torch.Tensor) -> torch.Tensor:
    """Unsigned e4m3 (bias 7; 0 and 0x7F read as 0) halved, for the uint8 codes x, as float32."""
    x = x.to(torch.int32)
    exp, man = (x >> 3) & 0xF, (x & 7).float()
    pow2 = ((exp + 120) << 23).view(torch.float32)    # 2**(exp-7), exactly
    raw = torch.where(exp == 0, man * 2.0 ** -9, (1.0 + man / 8.0) * pow2)
    return torch.where((x == 0) | (x == 0x7F), 0.0, raw * 0.5)


def mxfp4(b):
    """e8m0 exponent, qs[16] e2m1 nibbles: kvalue * 2**(e-128)."""
    q = lut(E2M1_X2, b.device)[unpack(b[:, 1:], 4, 16)]
    return e8m0_half(b[:, :1]) * q


def nvfp4(b):
    """4 ue4m3 scales (one per 16 elements), qs[32] e2m1 nibbles."""
    n = b.shape[0]
    d = ue4m3_half(b[:, :4]).view(n, 4, 1)
    q = unpack(b[:, 4:], 4, 8).view(n, 4, 16)   # per 16-element sub-block: 8 low nibbles, 8 high
    return (d * lut(E2M1_X2, b.device)[q]).reshape(n, 64)


# --- 1-bit ----------------------------------------------------------------------------------------
def q1_0(b):
    """d f16, qs[16]: element j is +d if bit j%8 of byte j/8 is set, else -d."""
    q = unpack(b[:, 2:], 1, 1)
    return (2 * q - 1).float() * f16(b[:, :2])
