"""IQ4_NL's and IQ4_XS's GEMV against 8-bit activations: a 4-bit code indexes ggml's table of 16 int8 values, which
four registers hold; three byte permutes (prmt) turn four codes into their four values as int8 bytes (llama.cpp's
get_int_from_table_16) and a dp4a takes their dot with four activation codes. The table GEMV (gemv.py) instead
gathers a float per code.

The planes are row-major (layout.py): a program takes BLOCK_N weight rows and walks K a tile of 256 values a step,
each 16-byte load of codes one 32-value block of one row. x is rounded to 8 bits (gemv_dp4a's rule and codes_for:
by a launch of its own, or by each program for its tile) in the order the permutes leave the weight's values: qs
byte j holds values j and j + 16 of its block, so a word's first permute gives values (j, j + 16, j + 1, j + 17). A
block's dot is summed in int32 and scaled once in float32 by the weight's and x's block scales; the affine GEMV's
ends (gemv_out).
"""
from __future__ import annotations

import torch

from quanta.kernels.affine.gemv_out import gemv_launch, output_columns, store_plain
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.ggml.gemv import GemvConfig
from quanta.kernels.ggml.gemv_dp4a import _codes_ready, _dp4a, codes_for
from quanta.kernels.ggml.layout import TILE, GgmlState
from quanta.kernels.triton_support import pdl_launch, pdl_launch_dependents, pdl_wait, tl, triton

TYPES = ("iq4_nl", "iq4_xs")
# Codes to values: a permute of the table's low two words and one of its high two, each by the codes' low three bits
# (bit 3 of a prmt selector would replicate the byte's sign), then a permute between the two by bit 3 (byte n of the
# low result, or n + 4 of the high one); for the word's upper four codes the selectors shifted down 16.
_LOOKUP = tl.constexpr("""{
.reg .b32 s, h, l, u;
and.b32 s, $2, 0x77777777;
shr.u32 h, $2, 1;
and.b32 h, h, 0x44444444;
or.b32 h, h, 0x32103210;
prmt.b32 l, $3, $4, s;
prmt.b32 u, $5, $6, s;
prmt.b32 $0, l, u, h;
shr.u32 s, s, 16;
shr.u32 h, h, 16;
prmt.b32 l, $3, $4, s;
prmt.b32 u, $5, $6, s;
prmt.b32 $1, l, u, h;
}""")
# One row a thread over eight lanes a row's tile in four warps, split-K for eight programs an SM of at least two
# tiles: of the configs timed (benchmarks/gemv_dp4a.py, x's codes given) the fastest on the large weights; more rows
# a program hold more loads in flight a thread but leave too few programs.
DEFAULT_CONFIG = GemvConfig(block_n=32, warps=4, waves=8.0, min_tiles=2)


@triton.jit
def _table_value(lut_ptr, code):
    """The table's value of `code` (0..15) as the low byte of an int32."""
    return tl.load(lut_ptr + code).to(tl.int32) & 0xFF


@triton.jit
def _table_word(lut_ptr, i: tl.constexpr):
    """The table's values 4i .. 4i + 3 as the bytes of a word (loaded, so that the permutes read it from a register:
    as a literal the compiler moves it into one before every permute)."""
    word = _table_value(lut_ptr, 4 * i)
    for b in tl.static_range(1, 4):
        word |= _table_value(lut_ptr, 4 * i + b) << 8 * b
    return word


@triton.jit
def _values(w, table, lut_ptr, PTX: tl.constexpr):
    """The int8 values of word w's eight codes as two words: bytes (j, j + 16, j + 1, j + 17) and (j + 2, j + 18,
    j + 3, j + 19) of its block, for w's bytes j..j + 3 (codes j in the low nibbles, j + 16 in the high); `table`
    the four _table_words."""
    if PTX:
        t0, t1, t2, t3 = table
        return tl.inline_asm_elementwise(_LOOKUP, "=r,=r,r,r,r,r,r", [w, t0, t1, t2, t3],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        v0 = tl.zeros_like(w)
        v1 = tl.zeros_like(w)
        for i in tl.static_range(4):
            v0 |= _table_value(lut_ptr, (w >> 4 * i) & 0xF) << 8 * i
            v1 |= _table_value(lut_ptr, (w >> 16 + 4 * i) & 0xF) << 8 * i
        return v0, v1


@triton.jit
def _load(at, m3, EVEN: tl.constexpr):
    """A load of the program's weight rows: unmasked where BLOCK_N divides N (EVEN)."""
    if EVEN:
        return tl.load(at)
    else:
        return tl.load(at, mask=m3, other=0)


@triton.jit
def _block_scales(d_at, sc_at, m3, sub, t, EVEN: tl.constexpr, XS: tl.constexpr):
    """The weight's scale of each 32-value block of tile t [BLOCK_N, 8, 1] (float32), d_at / sc_at the rows' planes
    (and IQ4_NL's block): IQ4_NL's fp16 d [N, K / 32]; IQ4_XS's d [N, K / 256] times (ls - 32), ls a 6-bit scale
    whose low four bits are nibble s % 2 of scales_l byte s / 2 and high two bits 2s of the u16 scales_h
    (sc [N, K / 256 * 6]: scales_h, then scales_l)."""
    if XS:
        d = _load(d_at + t, m3, EVEN).to(tl.float32)
        lo = _load(sc_at + t * 6 + 2 + sub // 2, m3, EVEN).to(tl.int32)
        hi = _load(sc_at + t * 6 + sub // 4, m3, EVEN).to(tl.int32)
        ls = ((lo >> 4 * (sub % 2)) & 15) | (((hi >> 2 * (sub % 4)) & 3) << 4)
        return d * (ls - 32).to(tl.float32)
    else:
        return _load(d_at + t * 8, m3, EVEN).to(tl.float32)


@triton.jit
def _iq4_kernel(x_ptr, q_ptr, xd_ptr, xs_ptr, d_ptr, sc_ptr, qs_ptr, lut_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr, N, K,
                NB, stride_qs, tiles_per_split, num_tiles, stride_xm, stride_ym, BLOCK_N: tl.constexpr,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, PTX: tl.constexpr, XS: tl.constexpr,
                EVEN: tl.constexpr = False, PDL: tl.constexpr = False, GLU: tl.constexpr = False,
                QUANTIZE: tl.constexpr = True):
    """y[m, n] = sum_k xq[m, k] W[n, k] for an IQ4 weight of NB ggml blocks a row (planes d, IQ4_XS's sc, qs as int32
    [N, stride_qs = K / 8])
    and x's codes q in IQ4's order (as int64 words), scales xd; with QUANTIZE each program makes them from x for its
    K range first. Program (row m, BLOCK_N weight rows, split of whole tiles)."""
    pdl_launch_dependents(PDL)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n, mask_n = output_columns(pid_n, N, BLOCK_N, GLU)
    rows, m3 = offs_n[:, None, None], mask_n[:, None, None]
    sub = tl.arange(0, 8)[None, :, None]                 # the tile's 32-value blocks
    word = tl.arange(0, 4)[None, None, :]                # a block's four words of codes
    q_row = q_ptr + pid_m * (K // 8)
    xs_row = (xs_ptr + pid_m * (K // 16)).to(tl.pointer_type(tl.int64))
    xd_row = xd_ptr + pid_m * (K // 32)
    x_row = x_ptr + pid_m * stride_xm
    w_at = qs_ptr + rows * stride_qs + sub * 4 + word
    d_at = d_ptr + rows * NB + (0 if XS else sub)
    sc_at = sc_ptr + rows * (NB * 6)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    acc = tl.zeros((BLOCK_N, 8, 1), dtype=tl.float32)
    table = (_table_word(lut_ptr, 0), _table_word(lut_ptr, 1), _table_word(lut_ptr, 2), _table_word(lut_ptr, 3))
    for t in tl.range(t_begin, t_end):
        w = _load(w_at + t * 32, m3, EVEN)
        scale = _block_scales(d_at, sc_at, m3, sub, t, EVEN, XS)
        _codes_ready(x_row, q_row, xd_row, xs_row, t, PDL, QUANTIZE, True)
        xw = tl.load(q_row + t * 32 + sub * 4 + word)    # x's codes: two words a word of w
        v0, v1 = _values(w, table, lut_ptr, PTX)
        dot = _dp4a(v1, (xw >> 32).to(tl.int32), _dp4a(v0, xw.to(tl.int32), tl.zeros_like(w), PTX, True), PTX, True)
        xd = tl.load(xd_row + t * 8 + sub)
        acc += (scale * xd) * tl.sum(dot, axis=2, keep_dims=True).to(tl.float32)
    pdl_wait(PDL)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    store_plain(y, bias_ptr, HAS_BIAS, y_ptr + pid_m * stride_ym, ws_ptr, lock_ptr, pid_m, pid_n, pid_k, offs_n,
                mask_n, N, SPLIT_K, BLOCK_N, GLU)


def default_config(st: GgmlState, caps: DeviceCaps, m: int) -> GemvConfig:
    """The launch config of a weight (the plan gives this path one row)."""
    return DEFAULT_CONFIG


def applies(st: GgmlState, caps: DeviceCaps | None = None) -> str | None:
    """None where this GEMV runs the weight, else why not."""
    if st.name not in TYPES:
        return f"{st.name} has no table dp4a GEMV (only {', '.join(TYPES)})"
    if st.k % TILE:
        return f"K={st.k} is not a multiple of {TILE} (x is rounded a tile at a time)"
    if st.dtype not in (torch.float16, torch.bfloat16):
        return f"{str(st.dtype).removeprefix('torch.')} activations (the GEMV writes 16-bit floats)"
    return None


def matmul(x2: torch.Tensor, st: GgmlState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None, glu: bool = False, ptx: bool | None = None,
           quantized: tuple | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias) for 16-bit x2 rounded to 8 bits in blocks of 32 (codes_for), or
    `quantized`, quantize_rows(x2, interleave=True), given. `glu`: W stacks [gate; up] and
    y[M, N/2] = silu(gate) * up. `config` (GemvConfig's fields) and `ptx` (prmt + dp4a, or integer twins) forced
    by tests and benchmarks."""
    assert x2.dim() == 2 and x2.shape[1] == st.k and x2.stride(1) == 1 and applies(st) is None, st.name
    caps = caps or device_caps(x2.device)
    m, k = x2.shape
    q, xd, xs, in_programs = codes_for(x2, quantized, interleave=True)
    bn, warps, waves, min_tiles = tuple(config or DEFAULT_CONFIG)
    n, xs_type = st.n, st.name == "iq4_xs"
    assert not glu or n % 2 == 0
    column_blocks, splits, per, y, ws, locks = gemv_launch(x2, n, st.tiles, bn, waves, min_tiles, glu, x2.dtype, caps)
    d, qs = st.planes[0], st.planes[-1]                 # IQ4_XS's scales plane between them (sc: d stands in)
    sc = st.planes[1] if xs_type else d
    _iq4_kernel[(m, column_blocks, splits)](
        x2, q.view(torch.int64), xd, xs, d, sc, qs, st.lut, bias if bias is not None else x2, y, ws, locks, n, k,
        st.blocks, qs.stride(0), per, st.tiles, x2.stride(0), y.stride(0),
        BLOCK_N=bn, EVEN=(n // 2 if glu else n) % (bn // 2 if glu else bn) == 0, HAS_BIAS=bias is not None,
        SPLIT_K=splits, PTX=caps.is_cuda if ptx is None else ptx, XS=xs_type, GLU=glu, QUANTIZE=in_programs,
        num_warps=warps, **pdl_launch(caps))
    return y

