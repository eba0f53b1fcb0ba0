"""K-quant quantizers (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): float32 super-blocks -> ggml blocks, in torch.

Each function maps x [nb, 256] (and optional importance weights qw [nb, 256]) to uint8 blocks
[nb, type_size], following ggml-quants.c: without weights the `quantize_row_*_K_ref` path, with
them the `quantize_row_*_K_impl` path that llama-quantize takes for an imatrix. The scale searches
are in qsearch.py; the byte layouts are the inverse of blocks.py's decoders.
"""
from __future__ import annotations

import torch

from quanta.quant.ggml.qsearch import (first_absmax, make_q3_quants, make_qkx_quants, make_qp_quants, make_qx_quants,
                                      nearest_int, rdiv, seq_sum, sqrtf)


# --- packing --------------------------------------------------------------------------------------
def pack(q: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Inverse of blocks.unpack: int codes [nb, m*8/bits] -> uint8 bytes [nb, m]."""
    nb, per = q.shape[0], 8 // bits
    q = q.to(torch.int32).view(nb, -1, per, group)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=q.device).view(1, 1, -1, 1)
    return (q << shifts).sum(2).to(torch.uint8).reshape(nb, -1)


def f16_bytes(d: torch.Tensor) -> torch.Tensor:
    """float32 [nb] -> its float16 (round to nearest even, GGML_FP32_TO_FP16) as bytes [nb, 2]."""
    return d.to(torch.float16).view(torch.uint8).view(-1, 2)


def f16_round(d: torch.Tensor) -> torch.Tensor:
    """d rounded through float16 and back (the value a reader of the block sees)."""
    return d.to(torch.float16).float()


def _pack_k_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins [nb, 8] -> the 12 scale bytes of Q4_K / Q5_K (get_scale_min_k4)."""
    ls, lm = ls.to(torch.int32), lm.to(torch.int32)
    lo = torch.cat([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6)], dim=1)
    hi = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return torch.cat([lo, hi], dim=1).to(torch.uint8)


def _requant(x: torch.Tensor, L: torch.Tensor, d: torch.Tensor, dm: torch.Tensor | None, lo: int, hi: int,
             offset: int) -> torch.Tensor:
    """Levels from the final (f16-rounded) sub-block scales d [nb, S] (and mins dm): round(x/d) or
    round((x + dm)/d), clamped to [lo, hi] and shifted by `offset`; sub-blocks with d == 0 keep L."""
    nb, s = d.shape
    xs = x.view(nb, s, -1)
    num = xs if dm is None else xs + dm.unsqueeze(2)
    dd = d.unsqueeze(2)
    new = nearest_int(num / torch.where(dd == 0, 1.0, dd)).clamp(lo, hi) + offset
    return torch.where(dd == 0, L.view(nb, s, -1), new).view(nb, -1)


# --- Q2_K / Q4_K / Q5_K: asymmetric, scales and mins ----------------------------------------------
def _scale_levels(v: torch.Tensor, top: int, bits_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The _ref quantizers' super-block scale: levels round(v * top / max) (stored in uint8, at most
    bits_max) and the float scale max / top; all-zero when max <= 0."""
    vmax = v.max(1).values
    vmax = torch.where(vmax > 0, vmax, 0.0)                  # C starts from +0: never -0 or negative
    inv = torch.where(vmax > 0, rdiv(float(top), torch.where(vmax > 0, vmax, 1.0)), 0.0)
    lv = (nearest_int(inv.unsqueeze(1) * v) & 0xFF).clamp(max=bits_max)
    return lv, vmax / top


def _affine_k(x, qw, sub: int, nmax: int, ref_search: tuple, scale_top: int):
    """Shared body of Q2_K, Q4_K and Q5_K: per-sub-block (scale, min) search, the two super-block
    scales d and dmin, and the final levels. Returns (L [nb, 256], ls, lm [nb, 256/sub], d, dmin)."""
    nb = x.shape[0]
    xg = x.reshape(-1, sub)
    if qw is None:
        if sub == 16:                                            # Q2_K
            w = xg.abs()
        else:                                                    # Q4_K / Q5_K
            av_x = sqrtf(seq_sum(xg * xg) / 32).unsqueeze(1)
            w = av_x + xg.abs()
        scales, L, mins = make_qkx_quants(xg, w, nmax, *ref_search)
        scales, mins = scales.view(nb, -1), mins.view(nb, -1)
        ls, d = _scale_levels(scales, scale_top, scale_top if sub == 16 else 63)
        lm, dmin = _scale_levels(mins, scale_top, scale_top if sub == 16 else 63)
    else:
        sigma2 = seq_sum(x * x) / 256 if sub == 16 else 2 * seq_sum(x * x) / 256
        w = (qw * sqrtf(sigma2.unsqueeze(1) + x * x)).reshape(-1, sub)
        sw = seq_sum(w).view(nb, -1)
        scales, L, mins = make_qkx_quants(xg, w, nmax, -0.9, 0.05, 36, False)
        d, ls = make_qp_quants(scales.view(nb, -1), scale_top, sw)
        dmin, lm = make_qp_quants(mins.view(nb, -1), scale_top, sw)
        ls, lm = ls & 0xFF, lm & 0xFF
    d, dmin = f16_round(d), f16_round(dmin)
    L = _requant(x, L.view(nb, -1), d.unsqueeze(1) * ls.float(), dmin.unsqueeze(1) * lm.float(), 0, nmax, 0)
    return L, ls, lm, d, dmin


def q2_k(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """Q2_K: 16 sub-blocks of 16, 2-bit levels, 4-bit scales and mins."""
    L, ls, lm, d, dmin = _affine_k(x, qw, 16, 3, (-0.5, 0.1, 15, True), 15)
    return torch.cat([(ls | (lm << 4)).to(torch.uint8), pack(L, 2, 32), f16_bytes(d), f16_bytes(dmin)], dim=1)


def q4_k(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """Q4_K: 8 sub-blocks of 32, 4-bit levels, 6-bit scales and mins."""
    L, ls, lm, d, dmin = _affine_k(x, qw, 32, 15, (-1.0, 0.1, 20, False), 63)
    return torch.cat([f16_bytes(d), f16_bytes(dmin), _pack_k_scales(ls, lm), pack(L, 4, 32)], dim=1)


def q5_k(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """Q5_K: as Q4_K with 5-bit levels (the 5th bits in qh)."""
    L, ls, lm, d, dmin = _affine_k(x, qw, 32, 31, (-0.5, 0.1, 15, False), 63)
    return torch.cat([f16_bytes(d), f16_bytes(dmin), _pack_k_scales(ls, lm), pack(L >> 4, 1, 32),
                      pack(L & 0xF, 4, 32)], dim=1)


# --- Q3_K / Q6_K: symmetric, signed sub-block scales ----------------------------------------------
def q3_k(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """Q3_K: 16 sub-blocks of 16, 3-bit levels (2 low bits + hmask), 6-bit signed scales."""
    nb = x.shape[0]
    xg = x.reshape(-1, 16)
    if qw is None:
        scales, L = make_q3_quants(xg, 4)
        scales = scales.view(nb, 16)
        smax = first_absmax(scales, 1)
        nz = smax != 0
        iscale = torch.where(nz, rdiv(-32.0, torch.where(nz, smax, 1.0)), 0.0)
        ls = (nearest_int(iscale.unsqueeze(1) * scales).to(torch.int8).clamp(-32, 31) + 32).to(torch.int32)
        ls = torch.where(nz.unsqueeze(1), ls, 0)
        d = torch.where(nz, 1 / torch.where(nz, iscale, 1.0), 0.0)
    else:
        sigma2 = 2 * seq_sum(x * x) / 256
        w = (qw * sqrtf(sigma2.unsqueeze(1) + x * x)).reshape(-1, 16)
        scales, L = make_qx_quants(xg, 4, w)
        d, ls = make_qx_quants(scales.view(nb, 16), 32, seq_sum(w).view(nb, 16))
    d = f16_round(d)
    L = _requant(x, L.view(nb, -1), d.unsqueeze(1) * (ls - 32).float(), None, -4, 3, 4)
    scales12 = torch.cat([pack(ls[:, :16] & 0xF, 4, 8), pack(ls >> 4, 2, 4)], dim=1)
    return torch.cat([pack(L >> 2, 1, 32), pack(L & 3, 2, 32), scales12, f16_bytes(d)], dim=1)


def q6_k(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """Q6_K: 16 sub-blocks of 16, 6-bit levels, int8 scales."""
    nb = x.shape[0]
    scales, L = make_qx_quants(x.reshape(-1, 16), 32, None if qw is None else qw.reshape(-1, 16))
    scales = scales.view(nb, 16)
    smax = first_absmax(scales, 1)
    live = smax.abs() >= 1e-15
    iscale = rdiv(-128.0, torch.where(live, smax, 1.0))
    d = torch.where(live, 1 / iscale, 0.0)
    sc = nearest_int(iscale.unsqueeze(1) * scales).clamp(max=127)
    sc = torch.where(live.unsqueeze(1), sc.to(torch.int8).to(torch.int32), 0)
    d = f16_round(d)
    L = _requant(x, L.view(nb, -1), d.unsqueeze(1) * sc.float(), None, -32, 31, 32)
    L = torch.where(live.unsqueeze(1), L, 0)
    return torch.cat([pack(L & 0xF, 4, 64), pack(L >> 4, 2, 32), sc.to(torch.int8).view(torch.uint8),
                      f16_bytes(d)], dim=1)
