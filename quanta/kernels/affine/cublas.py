"""The dequantize + cuBLAS path of the affine kernels: the weight decoded once per call to [K, N] in the compute
dtype by a Triton kernel, then torch's matmul. Where the GEMM is compute-bound (large M) cuBLAS's tiles beat the
fused kernels, and the decode costs the same at any M.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.affine.layout import AffineState, R, decode, load_lut_words, load_scales, lut_lookup4_ptx
from quanta.kernels.device_caps import DeviceCaps
from quanta.kernels.triton_support import cdiv, tl, triton


# A word's 8 table codes as four pairs of 16-bit entries ($0 codes 0, 1 .. $3 codes 6, 7), from the word $4 and the
# table words $5..$12: the dequantize kernel's lookup (no global gather per code)
_LUT_WORD = tl.constexpr("{\n.reg .b32 w, sel, t, m, lo, lo2, hi, hi2;\n" + lut_lookup4_ptx("$4", 5, "$0", "$1")
                         + "shr.u32 w, $4, 16;\n" + lut_lookup4_ptx("w", 5, "$2", "$3") + "}")


@triton.jit
def _affine_dequant_kernel(
    # pointers
    w_ptr, sz_ptr, lut_ptr, out_ptr,
    # sizes
    N, GS,
    # meta
    BITS: tl.constexpr, R: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZB: tl.constexpr,
    MODE: tl.constexpr, LOOKUP: tl.constexpr = False,
):
    """out[K_pad, N] = dequant(packed) in out's dtype (the transposed weight for cuBLAS). LOOKUP: 4-bit table codes
    looked up by byte permutes (lut_ptr: lut_byte_words in out's dtype), not gathered from memory per code."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    DT: tl.constexpr = out_ptr.dtype.element_ty
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    offs_i = tl.arange(0, PACK)
    mask_n = offs_n < N
    # --- load one tile of words and its scales
    p = tl.load(w_ptr + (t * R + offs_r)[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
    if LOOKUP:
        _store_table_codes(p, lut_ptr, sz_ptr, out_ptr, t, offs_r, offs_n, mask_n, N, GS, R, DT, ZERO)
    else:
        g = ((t * PACK * R + offs_i * R) // GS)[:, None, None]
        s, zb = load_scales(sz_ptr, g, offs_n[None, None, :], mask_n[None, None, :], N, ZERO, HAS_ZB, DT)
        # --- dequantize (exact integer in fp32, then scale; or a table entry, gathered)
        code = (p[None, :, :] >> (offs_i * BITS)[:, None, None]) & MASK
        w = decode(code, s, zb, lut_ptr, ZERO, HAS_ZB, MODE, False, DT)
        # --- store rows k = t*TILE_K + i*R + r
        rows = t * PACK * R + offs_i[:, None, None] * R + offs_r[None, :, None]
        tl.store(out_ptr + rows * N + offs_n[None, None, :], w, mask=mask_n[None, None, :])


@triton.jit
def _store_table_codes(p, lut_ptr, sz_ptr, out_ptr, t, offs_r, offs_n, mask_n, N, GS, R: tl.constexpr,
                       DT: tl.constexpr, ZERO: tl.constexpr = 0):
    """The dequantize kernel's tile of 4-bit table codes: each word's 8 entries by _LUT_WORD (four pairs of 16-bit
    entries in DT), times their group's scale in fp32, rounded once to DT, stored at rows t * TILE_K + i * R + r."""
    lut = load_lut_words(lut_ptr)
    args = [p, lut[0], lut[1], lut[2], lut[3], lut[4], lut[5], lut[6], lut[7]]
    pairs = tl.inline_asm_elementwise(_LUT_WORD, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", args,
                                      dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    for j in tl.static_range(4):
        for h in tl.static_range(2):
            entry = ((pairs[j] >> (16 * h)) & 0xFFFF).to(tl.int16).to(DT, bitcast=True)
            k0 = t * 8 * R + (2 * j + h) * R                       # the code's K slice of the tile
            s = load_scales(sz_ptr, k0 // GS, offs_n[None, :], mask_n[None, :], N, ZERO, False, DT)[0]
            rows = k0 + offs_r
            tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], (entry.to(tl.float32) * s.to(tl.float32)).to(DT),
                     mask=mask_n[None, :])


class DequantConfig(NamedTuple):
    """A dequantize launch: `block_n` columns of one K tile a program, in `warps` warps."""
    block_n: int = 128
    warps: int = 4


def default_config(st: AffineState, caps: DeviceCaps, m: int) -> DequantConfig:
    """The dequantize kernel's launch: the same at any M and on any chip."""
    return DequantConfig()


def dequantize_t(st: AffineState, config: tuple = DequantConfig(), lookup: bool | None = None) -> torch.Tensor:
    """The weight transposed, [K, N] in the compute dtype (rows in sorted order when act-ordered). `lookup`: 4-bit
    table codes by byte permutes (default on CUDA, where PTX runs; the interpreter's tests force it with an
    emulator)."""
    block_n, warps = config
    if lookup is None:
        lookup = st.packed.device.type == "cuda"
    lookup = lookup and st.table_lookup
    out = torch.empty(st.k_pad, st.n, device=st.packed.device, dtype=st.dtype)
    _affine_dequant_kernel[(st.num_tiles, cdiv(st.n, block_n))](
        st.packed, st.sz, st.lut_arg(lookup), out, st.n, st.group_size, BITS=st.bits, R=R, ZERO=st.zero,
        BLOCK_N=block_n, HAS_ZB=st.has_zb, MODE=st.mode, LOOKUP=lookup, num_warps=warps)
    return out[: st.k]


def matmul(x2: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias): dequantize to the compute dtype, then cuBLAS."""
    x2 = st.in_weight_order(x2)
    w_t = dequantize_t(st, config or DequantConfig())
    return torch.addmm(bias, x2, w_t) if bias is not None else x2 @ w_t
