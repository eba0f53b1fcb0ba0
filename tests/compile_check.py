"""Compile every Triton kernel for sm75 / sm80 / sm89 / sm90 with no GPU present (CI), down to cubin.

Triton compiles for a named target without a device: `triton.compile(ASTSource(...), target=GPUTarget)`
runs the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> ptxas from the wheel). Each case names the
argument types and the constexprs the launcher passes; pointers and the sizes a real launch would
specialize as multiples of 16 carry that hint, so the code compiled here is the code a GPU runs.

    python tests/compile_check.py            # every case, every target, a table
    python tests/compile_check.py --sass gemv --cc 90   # dump one kernel's SASS
"""
from __future__ import annotations

import argparse
import importlib
import os
import tempfile

from quanta.kernels.ggml.layout import LAYOUTS
from quanta.kernels.paged_kv import FP8_FORMATS, NO_FP8_READ
from quanta.kernels.triton_support import ZERO_BLOCK

TARGETS = (75, 80, 89, 90)
DIV16 = {"N", "K", "stride_qs", "stride_xm", "stride_ym", "stride_om", "D", "stride_x", "stride_r", "stride_y",
         "stride_q", "stride_k", "half", "stride_qt", "stride_kt", "stride_qot", "stride_kot", "stride_vt", "stride_gm",
         "stride_um", "HALF_D", "slot_elems", "stride_block", "stride_slot", "stride_qh", "stride_ot", "stride_oh"}

# name -> (module, kernel, {arg: type} for non-constexpr args not int32, constexprs, num_warps, num_stages,
#          lowest target): one case per distinct code path (dtype, bits, special features)
_P16 = dict(x_ptr="*fp16", w_ptr="*i32", sz_ptr="*i32", perm_ptr="*i32", lut_ptr="*fp32", bias_ptr="*fp16",
            y_ptr="*fp16", ws_ptr="*fp32", lock_ptr="*i32", pos_ptr="*i64", freq_ptr="*fp32", k_cache_ptr="*u8",
            v_cache_ptr="*u8", slot_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32", lora_part_ptr="*fp32",
            lora_b_ptr="*fp16", lora_scale_ptr="*fp32", lora_slot_ptr="*i32")
_PBF = {**_P16, "x_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*fp32"}
_AFF = dict(R=16, ZERO=8, HAS_ZB=False, HAS_PERM=False, HAS_BIAS=False, MODE=0)
_MMA_W4 = dict(_AFF, GS=128, BITS=4, BLOCK_M=16, ATOMIC=True, H2=True, BLOCK_N=256)  # the M = 16 default
_WG = dict(x_ptr="*fp16", w_ptr="*i32", sz_ptr="*i32", bias_ptr="*fp16", y_ptr="*fp16")
_WGMMA = dict(BITS=4, BLOCKS=1, GS=128, SROWS=1, ZERO=8, HAS_ZB=False, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=256,
              STAGES=3, LAG=2, ATOMIC=True, PDL=True)                                  # the fp16 M = 16 default
_E5M2 = FP8_FORMATS["fp8_e5m2"].write_constexprs()
_E4M3 = FP8_FORMATS["fp8_e4m3"].write_constexprs()
_E4M3_READ = FP8_FORMATS["fp8_e4m3"].read_constexprs()
_E5M2_READ_HW = FP8_FORMATS["fp8_e5m2"].read_constexprs(hardware=True)
_FP8_GEMV = dict(_P16, w_ptr="*u8", scale_ptr="*fp32")
_COLS = dict(x_ptr="*fp16", p0="*i32", p1="*i32", p2="*i32", p3="*i32", bias_ptr="*fp16", y_ptr="*fp16",
             ws_ptr="*fp32", lock_ptr="*i32", pos_ptr="*i64", freq_ptr="*fp32", k_cache_ptr="*fp16",
             v_cache_ptr="*fp16", slot_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32", b0="*i32", b1="*i32",
             b2="*i32", b3="*i32")
_DP4A = dict(x_ptr="*fp16", q_ptr="*i32", xd_ptr="*fp32", xs_ptr="*i32", p0="*i32", p1="*i32", p2="*i32", p3="*i32",
             bias_ptr="*fp16", y_ptr="*fp16", ws_ptr="*fp32", lock_ptr="*i32")
_IQ4_DP4A = dict(x_ptr="*fp16", q_ptr="*i64", xd_ptr="*fp32", xs_ptr="*i32", d_ptr="*fp16", sc_ptr="*u8",
                 qs_ptr="*i32", lut_ptr="*fp32", bias_ptr="*fp16", y_ptr="*fp16", ws_ptr="*fp32", lock_ptr="*i32")
_ROPE = dict(q_ptr="*fp16", k_ptr="*fp16", qo_ptr="*fp16", ko_ptr="*fp16", pos_ptr="*i64", freq_ptr="*fp32",
             v_ptr="*fp16", k_cache_ptr="*u8", v_cache_ptr="*u8", slot_ptr="*i64", k_scale_ptr="*fp32",
             v_scale_ptr="*fp32")
_GGML_POINTER = {"float16": "*fp16", "uint8": "*u8", "int8": "*i8", "int16": "*i16", "int32": "*i32"}


def _ggml(name: str) -> tuple[dict, dict]:
    """A ggml type's pointer types (its planes, ggml/layout.py LAYOUTS) and its constexprs (layout.type_constexprs)."""
    lay = LAYOUTS[name]
    planes = [_GGML_POINTER[str(p.dtype).removeprefix("torch.")] for p in lay.planes]
    planes += [planes[0]] * (4 - len(planes))
    types = dict(x_ptr="*fp16", lut_ptr="*fp32", bias_ptr="*fp16", y_ptr="*fp32", out_ptr="*fp16",
                 **{f"p{i}": t for i, t in enumerate(planes)})
    a, b, c, d = lay.axes
    return types, dict(TYPE=lay.id, A=a, B=b, C=c, D=d, CENTER=lay.center, HAS_MIN=lay.has_min)


_Q4_K, _Q6_K, _IQ4_XS = _ggml("q4_K"), _ggml("q6_K"), _ggml("iq4_xs")
_Q4K_MMA = dict(x_ptr="*fp16", p0="*i32", p1="*i32", p2="*i32", p3="*i32", bias_ptr="*fp16", y_ptr="*fp32")
def _ws_descs(block_m: int, block_n: int, dt: str) -> dict:
    """The TMA descriptor arguments of the warp-specialized W4 kernel (wgmma_ws.descriptors' layouts)."""
    def nvmma(swizzle: int, bits: int) -> str:
        return (f"NVMMASharedLayout(swizzle_byte_width={swizzle}, element_bitwidth={bits}, rank=2, transposed=False, "
                "fp4_padded=False, cga_layout=[])")
    return dict(w_desc=f"tensordesc<i32[16,{block_n}],{nvmma(128, 32)}>",
                s_desc=f"tensordesc<i32[1,{block_n}],{nvmma(0, 32)}>",
                x_desc=f"tensordesc<{dt}[{block_m},64],{nvmma(128, 16)}>", bias_ptr="*fp16", y_ptr="*fp16")


_WS = dict(GS=128, ZERO=8, HAS_ZB=False, HAS_BIAS=False, STAGES=3, LAG=3, ATOMIC=False, PDL=True)

_GGML_WG = dict(x_ptr="*fp16", p0="*i32", p1="*i32", p2="*i32", p3="*i32", bias_ptr="*fp16", y_ptr="*fp16")
_GGML_WGMMA = dict(KIND=4, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=128, STAGES=3, LAG=2, ATOMIC=True, PDL=True)
_DECODE = dict(q_ptr="*fp16", k_cache_ptr="*u8", v_cache_ptr="*u8", part_o_ptr="*fp32", part_lse_ptr="*fp32",
               block_tables_ptr="*i32", seq_lens_ptr="*i32", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
               out_ptr="*fp16", lock_ptr="*i32", sm_scale="fp32")
_DECODE_META = dict(GROUP=4, GROUP_PAD=16, GROUP_P2=4, BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64,
                    NUM_SPLITS=8, WINDOW=0, PRECISION="tf32", MIN_SPLIT_KEYS=64, PREFETCH=False)
CASES = {
    "affine_gemv_w4": ("affine.gemv", "_affine_gemv_kernel", _P16,
                       dict(_AFF, BITS=4, RS=4, BLOCK_N=256, SPLIT_K=2, TILE_SCALE=True, EVEN_K=True), 2, 1, 75),
    "affine_gemv_w4_h2": ("affine.gemv", "_affine_gemv_kernel", _P16,
                          dict(_AFF, BITS=4, RS=4, BLOCK_N=256, SPLIT_K=2, TILE_SCALE=True, EVEN_K=True, H2=True,
                               H2_SCALE=16.0), 2, 1, 75),
    "affine_gemv_nf4_h2": ("affine.gemv", "_affine_gemv_kernel", dict(_P16, lut_ptr="*i32"),
                           dict(_AFF, BITS=4, RS=4, BLOCK_N=512, SPLIT_K=2, TILE_SCALE=False, EVEN_K=True, H2=True,
                                MODE=1), 4, 1, 75),
    "affine_gemv_w4_h2_glu": ("affine.gemv", "_affine_gemv_kernel", _P16,
                              dict(_AFF, BITS=4, RS=8, BLOCK_N=128, SPLIT_K=2, TILE_SCALE=True, EVEN_K=True,
                                   H2=True, H2_SCALE=16.0, GLU=True), 2, 1, 75),
    "affine_gemv_w4_h2_glu_lora": ("affine.gemv", "_affine_gemv_kernel", _P16,
                                   dict(_AFF, BITS=4, RS=8, BLOCK_N=128, SPLIT_K=2, TILE_SCALE=True, EVEN_K=True,
                                        H2=True, H2_SCALE=16.0, GLU=True, LORA=True, LORA_P=2, LORA_R=16,
                                        LORA_PIECES_PAD=16, PDL=True), 2, 1, 90),
    "lora_norm_shrink": ("quanta.lora.kernels", "_norm_shrink_kernel",
                         dict(x_ptr="*fp16", r_ptr="*fp16", w_ptr="*fp16", y_ptr="*fp16", h_ptr="*fp16", a_ptr="*fp16",
                              slot_ptr="*i32", part_ptr="*fp32", eps="fp32"),
                         dict(BLOCK_D=4096, PK=256, BLOCK_J=32, JB=2, HAS_RESIDUAL=True), 16, 1, 75),
    "lora_shrink_rows": ("quanta.lora.kernels", "_shrink_rows_kernel",
                         dict(x_ptr="*fp16", a_ptr="*fp16", slot_ptr="*i32", part_ptr="*fp32"),
                         dict(BLOCK_J=32, BLOCK_K=256), 4, 1, 75),
    "affine_gemv_w8_h2_zb_perm": ("affine.gemv", "_affine_gemv_kernel", _P16,
                                  dict(_AFF, BITS=8, RS=4, ZERO=128, BLOCK_N=256, HAS_ZB=True, HAS_PERM=True,
                                       HAS_BIAS=True, SPLIT_K=2, TILE_SCALE=True, EVEN_K=False, H2=True,
                                       H2_SCALE=256.0), 2, 1, 75),
    "affine_gemv_w8_h2_tile_sums_glu": ("affine.gemv", "_affine_gemv_kernel", _P16,
                                        dict(_AFF, BITS=8, RS=8, ZERO=128, BLOCK_N=512, SPLIT_K=2, TILE_SCALE=True,
                                             EVEN_K=True, H2=True, H2_SCALE=256.0, TILE_SUMS=True, GLU=True,
                                             PDL=True), 8, 1, 90),
    "affine_gemv_w4_h2_tile_sums_zb": ("affine.gemv", "_affine_gemv_kernel", _P16,
                                       dict(_AFF, BITS=4, RS=4, BLOCK_N=256, HAS_ZB=True, SPLIT_K=2, TILE_SCALE=True,
                                            EVEN_K=True, H2=True, H2_SCALE=16.0, TILE_SUMS=True), 2, 1, 75),
    "affine_gemv_w4_g32_h2_zb": ("affine.gemv", "_affine_gemv_kernel", _P16,
                                 dict(_AFF, BITS=4, RS=4, BLOCK_N=256, HAS_ZB=True, SPLIT_K=2, TILE_SCALE=False,
                                      EVEN_K=True, H2=True, H2_SCALE=16.0, TILE_SUMS=True, GROUPS=4), 2, 1, 75),
    "affine_gemv_w8_g32_h2": ("affine.gemv", "_affine_gemv_kernel", _P16,
                              dict(_AFF, BITS=8, RS=8, ZERO=128, BLOCK_N=256, SPLIT_K=2, TILE_SCALE=False, EVEN_K=True,
                                   H2=True, H2_SCALE=256.0, TILE_SUMS=True, GROUPS=2), 4, 1, 75),
    "affine_gemv_iq4_h2": ("affine.gemv", "_affine_gemv_kernel", dict(_P16, lut_ptr="*i32"),
                           dict(_AFF, BITS=4, RS=4, BLOCK_N=512, SPLIT_K=2, TILE_SCALE=False, EVEN_K=True, H2=True,
                                MODE=1, GROUPS=4, PDL=True), 4, 1, 90),
    "affine_gemv_iq4xs_h2": ("affine.gemv", "_affine_gemv_kernel", dict(_P16, lut_ptr="*i32"),
                             dict(_AFF, BITS=4, RS=4, ZERO=-1, BLOCK_N=512, SPLIT_K=2, TILE_SCALE=False, EVEN_K=True,
                                  H2=True, MODE=1, GROUPS=4, PDL=True), 4, 1, 90),
    "affine_gemv_w8_g32_perm": ("affine.gemv", "_affine_gemv_kernel", _PBF,
                                dict(_AFF, BITS=8, RS=4, ZERO=128, BLOCK_N=512, HAS_ZB=True, HAS_PERM=True,
                                     HAS_BIAS=True, SPLIT_K=2, TILE_SCALE=False, EVEN_K=False), 2, 1, 80),
    "affine_gemm_w4_f16": ("affine.splitk", "_affine_gemm_kernel", _P16,
                           dict(_AFF, BITS=4, BLOCK_M=16, BLOCK_N=64, SPLIT_K=2, FP16_MAGIC=True), 4, 3, 75),
    "affine_gemm_w8_bf16": ("affine.splitk", "_affine_gemm_kernel", _PBF,
                            dict(_AFF, BITS=8, ZERO=128, BLOCK_M=64, BLOCK_N=128, HAS_ZB=True, HAS_PERM=True,
                                 HAS_BIAS=True, SPLIT_K=1, FP16_MAGIC=False), 4, 3, 80),
    "affine_gemm_w4_large": ("affine.splitk", "_affine_gemm_kernel", _P16,
                             dict(_AFF, BITS=4, BLOCK_M=128, BLOCK_N=256, SPLIT_K=1, FP16_MAGIC=True), 8, 3, 90),
    "affine_gemm_w4_large_small_smem": ("affine.splitk", "_affine_gemm_kernel", _P16,
                                        dict(_AFF, BITS=4, BLOCK_M=64, BLOCK_N=128, SPLIT_K=1, FP16_MAGIC=True),
                                        4, 2, 75),
    "affine_mma_w4": ("affine.mma", "_affine_mma_kernel", _P16, _MMA_W4, 4, 3, 75),
    "affine_mma_w4_pdl": ("affine.mma", "_affine_mma_kernel", _P16, dict(_MMA_W4, PDL=True), 4, 3, 90),
    "affine_mma_w4_large": ("affine.mma", "_affine_mma_kernel", _P16,
                            dict(_MMA_W4, BLOCK_M=256, ATOMIC=False, BLOCK_N=128), 8, 3, 90),
    "affine_mma_w4_stream_k": ("affine.mma", "_affine_mma_kernel", _P16,
                               dict(_MMA_W4, BLOCK_M=256, BLOCK_N=128, STREAM_K=True), 8, 3, 90),
    "affine_mma_w4_g32_zb_perm_bias": ("affine.mma", "_affine_mma_kernel", _P16,
                                       dict(_MMA_W4, GS=32, BLOCK_M=64, HAS_ZB=True, HAS_PERM=True, HAS_BIAS=True,
                                            ATOMIC=False), 4, 3, 75),
    "affine_mma_w4_g32_pdl": ("affine.mma", "_affine_mma_kernel", _P16, dict(_MMA_W4, GS=32, PDL=True), 4, 3, 90),
    "affine_mma_w8_g32_pdl": ("affine.mma", "_affine_mma_kernel", _P16, dict(_MMA_W4, BITS=8, ZERO=128, GS=32,
                                                                             PDL=True), 4, 3, 90),
    "affine_mma_w8_bf16": ("affine.mma", "_affine_mma_kernel", _PBF,
                           dict(_MMA_W4, BITS=8, ZERO=128, BLOCK_M=32, HAS_ZB=True, H2=False), 4, 3, 80),
    "affine_mma_w4_h2_bf16": ("affine.mma", "_affine_mma_kernel", _PBF, _MMA_W4, 4, 3, 80),
    "affine_mma_w4_h2_bf16_zb_g32": ("affine.mma", "_affine_mma_kernel", _PBF,
                                     dict(_MMA_W4, GS=32, HAS_ZB=True), 4, 3, 80),
    "affine_mma_nf4": ("affine.mma", "_affine_mma_kernel", _P16,
                       dict(_MMA_W4, GS=64, ZERO=0, BLOCK_M=128, ATOMIC=False, H2=False, MODE=1, BLOCK_N=64),
                       4, 3, 75),
    "affine_mma_nf4_h2": ("affine.mma", "_affine_mma_kernel", dict(_P16, lut_ptr="*i32"),
                          dict(_MMA_W4, GS=64, ZERO=0, MODE=1), 4, 3, 75),
    "affine_mma_iq4xs_h2": ("affine.mma", "_affine_mma_kernel", dict(_P16, lut_ptr="*i32"),
                            dict(_MMA_W4, GS=32, ZERO=-1, MODE=1), 4, 3, 75),
    "affine_mma_nf4_h2_bf16_g16": ("affine.mma", "_affine_mma_kernel", dict(_PBF, lut_ptr="*i32"),
                                   dict(_MMA_W4, GS=16, ZERO=0, MODE=1, BLOCK_M=64, BLOCK_N=64), 4, 3, 80),
    "zero": ("triton_support", "_zero_kernel", dict(y_ptr="*fp16"), dict(BLOCK=ZERO_BLOCK), 4, 1, 75),
    "zero_pdl": ("triton_support", "_zero_kernel", dict(y_ptr="*fp16"), dict(BLOCK=ZERO_BLOCK, PDL=True), 4, 1, 90),
    "ggml_gemv_q4_k": ("ggml.gemv", "_ggml_gemv_kernel", _Q4_K[0],
                       dict(_Q4_K[1], BLOCK_N=32, HAS_BIAS=False, SPLIT_K=2), 4, 1, 75),
    "ggml_mma_q4_k": ("ggml.mma", "_ggml_mma_kernel", _Q4K_MMA, dict(Q6=False, BLOCK_M=16, BLOCK_N=128,
                                                                    HAS_BIAS=False, ATOMIC=True, H2=True),
                      4, 3, 90),
    "ggml_mma_q4_k_large_bias": ("ggml.mma", "_ggml_mma_kernel", dict(_Q4K_MMA, y_ptr="*fp16"),
                                 dict(Q6=False, BLOCK_M=128, BLOCK_N=128, HAS_BIAS=True, ATOMIC=False, H2=True), 8, 3,
                                 90),
    "ggml_mma_q5_k": ("ggml.mma", "_ggml_mma_kernel", _Q4K_MMA, dict(Q6=False, Q5=True, BLOCK_M=16, BLOCK_N=128,
                                                                    HAS_BIAS=False, ATOMIC=True, H2=True), 4, 3, 90),
    "ggml_mma_q6_k": ("ggml.mma", "_ggml_mma_kernel", _Q4K_MMA, dict(Q6=True, BLOCK_M=16,
                      BLOCK_N=128, HAS_BIAS=False, ATOMIC=True, H2=True), 4, 3, 90),
    "ggml_gemv_cols_q4_k": ("ggml.gemv_cols", "_ggml_cols_kernel", _COLS, dict(Q5=False, Q6=False, BLOCK_N=256,
                                                                                HAS_BIAS=False, SPLIT_K=2, PTX=True,
                                                                                CHUNKS=2),
                            2, 1, 75),
    "ggml_gemv_cols_q4_k_pdl_glu": ("ggml.gemv_cols", "_ggml_cols_kernel", _COLS,
                                    dict(Q5=False, Q6=False, BLOCK_N=256, HAS_BIAS=True, SPLIT_K=1, PTX=True, PDL=True,
                                         GLU=True),
                                    2, 1, 90),
    "ggml_gemv_cols_q6_k_rope": ("ggml.gemv_cols", "_ggml_cols_kernel", _COLS,
                                 dict(Q5=False, Q6=True, BLOCK_N=256, HAS_BIAS=False, SPLIT_K=2, PTX=True, ROPE=True,
                                      HEAD_D=128),
                                 2, 1, 75),
    "ggml_gemv_cols_q5_k": ("ggml.gemv_cols", "_ggml_cols_kernel", _COLS,
                            dict(Q5=True, Q6=False, BLOCK_N=128, HAS_BIAS=True, SPLIT_K=2, PTX=True), 1, 1, 75),
    "ggml_gemv_cols_q2_k_pdl": ("ggml.gemv_cols", "_ggml_cols_kernel", _COLS,
                                dict(Q5=False, Q6=False, Q2=True, BLOCK_N=256, HAS_BIAS=False, SPLIT_K=2, PTX=True,
                                     PDL=True), 2, 1, 90),
    "ggml_gemv_cols_q3_k_glu": ("ggml.gemv_cols", "_ggml_cols_kernel", dict(_COLS, p3="*fp16"),
                                dict(Q5=False, Q6=False, Q3=True, BLOCK_N=256, HAS_BIAS=True, SPLIT_K=1, PTX=True,
                                     GLU=True), 2, 1, 75),
    "ggml_gemv_cols_q4_k_q6_k_rope_pdl": ("ggml.gemv_cols", "_ggml_cols_kernel", dict(_COLS, b3="*fp16"),
                                          dict(Q5=False, Q6=False, BLOCK_N=256, HAS_BIAS=False, SPLIT_K=2, PTX=True,
                                               ROPE=True, HEAD_D=128, PDL=True, TWO=True, Q6B=True,
                                               CHUNKS=4), 2, 1, 90),
    "ggml_dp4a_q2_k_pdl_glu": ("ggml.gemv_dp4a", "_dp4a_kernel", _DP4A,
                               dict(BLOCK_N=256, HAS_BIAS=False, SPLIT_K=2, PTX=True, PDL=True, GLU=True), 4, 1, 90),
    "ggml_dp4a_q3_k_bias": ("ggml.gemv_dp4a", "_dp4a_kernel", dict(_DP4A, p3="*fp16"),
                            dict(BLOCK_N=128, HAS_BIAS=True, SPLIT_K=1, PTX=True, Q3=True), 4, 1, 75),
    "ggml_dp4a_q3_k_pdl": ("ggml.gemv_dp4a", "_dp4a_kernel", dict(_DP4A, p3="*fp16"),
                           dict(BLOCK_N=256, HAS_BIAS=False, SPLIT_K=2, PTX=True, PDL=True, Q3=True), 4, 1, 90),
    "ggml_q8_rows": ("ggml.gemv_dp4a", "_q8_rows_kernel", dict(x_ptr="*fp16", q_ptr="*i8", d_ptr="*fp32",
                                                               s_ptr="*i32"), dict(BLOCKS=8, INTERLEAVE=True), 4, 1,
                     75),
    "ggml_iq4_xs_pdl_glu": ("ggml.gemv_iq4", "_iq4_kernel", _IQ4_DP4A,
                            dict(BLOCK_N=64, HAS_BIAS=False, SPLIT_K=2, PTX=True, XS=True, PDL=True, GLU=True,
                                 EVEN=True), 4, 1, 90),
    "ggml_iq4_xs_bf16": ("ggml.gemv_iq4", "_iq4_kernel", dict(_IQ4_DP4A, x_ptr="*bf16", bias_ptr="*bf16",
                                                              y_ptr="*bf16"),
                         dict(BLOCK_N=32, HAS_BIAS=False, SPLIT_K=2, PTX=True, XS=True, QUANTIZE=False), 4, 1, 80),
    "ggml_iq4_nl_bias": ("ggml.gemv_iq4", "_iq4_kernel", dict(_IQ4_DP4A, sc_ptr="*fp16"),
                         dict(BLOCK_N=32, HAS_BIAS=True, SPLIT_K=1, PTX=True, XS=False), 4, 1, 75),
    "ggml_gemm_q6_k": ("ggml.gemm", "_ggml_gemm_kernel", _Q6_K[0],
                       dict(_Q6_K[1], PARTS=4, BLOCK_M=16, BLOCK_N=64, HAS_BIAS=False, SPLIT_K=2), 4, 4, 80),
    "ggml_gemm_q4_k_small_smem": ("ggml.gemm", "_ggml_gemm_kernel", _Q4_K[0],
                                  dict(_Q4_K[1], PARTS=4, BLOCK_M=64, BLOCK_N=64, HAS_BIAS=False, SPLIT_K=1), 4, 2, 75),
    "ggml_dequant_iq4_xs": ("ggml.cublas", "_ggml_dequant_kernel", _IQ4_XS[0], dict(_IQ4_XS[1], PARTS=4, BLOCK_N=64),
                            4, 1, 75),
    "affine_dequant": ("affine.cublas", "_affine_dequant_kernel",
                       dict(w_ptr="*i32", sz_ptr="*i32", lut_ptr="*fp32", out_ptr="*fp16"),
                       dict(BITS=4, R=16, ZERO=8, BLOCK_N=128, HAS_ZB=True, MODE=0), 4, 1, 75),
    "codebook_dequant_nf4_lookup": ("affine.cublas", "_affine_dequant_kernel",
                                    dict(w_ptr="*i32", sz_ptr="*i32", lut_ptr="*i32", out_ptr="*fp16"),
                                    dict(BITS=4, R=16, ZERO=0, BLOCK_N=128, HAS_ZB=False, MODE=1, LOOKUP=True),
                                    4, 1, 75),
    "codebook_dequant_iq4xs_lookup": ("affine.cublas", "_affine_dequant_kernel",
                                      dict(w_ptr="*i32", sz_ptr="*i32", lut_ptr="*i32", out_ptr="*fp16"),
                                      dict(BITS=4, R=16, ZERO=-1, BLOCK_N=128, HAS_ZB=False, MODE=1, LOOKUP=True),
                                      4, 1, 75),
    "codebook_dequant_nf4_lookup_bf16": ("affine.cublas", "_affine_dequant_kernel",
                                         dict(w_ptr="*i32", sz_ptr="*i32", lut_ptr="*i32", out_ptr="*bf16"),
                                         dict(BITS=4, R=16, ZERO=0, BLOCK_N=128, HAS_ZB=False, MODE=1, LOOKUP=True),
                                         4, 1, 80),
    "codebook_gemv_nf4": ("affine.gemv", "_affine_gemv_kernel", _P16,
                          dict(_AFF, BITS=4, RS=4, ZERO=0, BLOCK_N=1024, SPLIT_K=2, TILE_SCALE=False,
                               EVEN_K=True, MODE=1), 4, 1, 75),
    "codebook_gemm_nf4": ("affine.splitk", "_affine_gemm_kernel", _P16,
                          dict(_AFF, BITS=4, ZERO=0, BLOCK_M=16, BLOCK_N=64, SPLIT_K=2, FP16_MAGIC=True, MODE=1),
                          4, 3, 75),
    "fp8_wo_gemv_e4m3": ("affine.gemv", "_affine_gemv_kernel", _P16,
                         dict(_AFF, BITS=8, RS=4, ZERO=0, BLOCK_N=1024, SPLIT_K=2, TILE_SCALE=True,
                              EVEN_K=True, MODE=2), 4, 1, 75),
    "fp8_wo_gemm_e5m2_bf16": ("affine.splitk", "_affine_gemm_kernel", _PBF,
                              dict(_AFF, BITS=8, ZERO=0, BLOCK_M=32, BLOCK_N=64, SPLIT_K=2, FP16_MAGIC=False,
                                   MODE=3), 4, 3, 80),
    "fp8_quant_rows": ("fp8_gemm", "_quant_rows_kernel", dict(x_ptr="*fp16", q_ptr="*fp8e4nv", scale_ptr="*fp32"),
                       dict(BLOCK_K=1024, FP8_MAX=448.0), 4, 1, 89),
    "fp8_gemv_hw_pdl_glu": ("fp8_gemv", "_fp8_gemv_kernel", _FP8_GEMV,
                            dict(BLOCK_N=16, BLOCK_K=512, EVEN_K=True, HAS_BIAS=False, SPLIT_K=4, HW_FP8=True,
                                 PDL=True, GLU=True), 4, 1, 90),
    "fp8_gemv_hw_pdl_rope_fp8": ("fp8_gemv", "_fp8_gemv_kernel", _FP8_GEMV,
                                 dict(BLOCK_N=128, BLOCK_K=128, EVEN_K=True, HAS_BIAS=False, SPLIT_K=2, HW_FP8=True,
                                      PDL=True, ROPE=True, HEAD_D=128, **_E4M3), 8, 1, 90),
    "fp8_gemv_hw_pdl_rope_lora": ("fp8_gemv", "_fp8_gemv_kernel", _FP8_GEMV,
                                  dict(BLOCK_N=128, BLOCK_K=128, EVEN_K=True, HAS_BIAS=False, SPLIT_K=2, HW_FP8=True,
                                       PDL=True, ROPE=True, HEAD_D=128, LORA=True, LORA_P=3, LORA_R=16,
                                       LORA_PIECES_PAD=16), 8, 1, 90),
    "fp8_gemv_bits_bf16": ("fp8_gemv", "_fp8_gemv_kernel", dict(_FP8_GEMV, x_ptr="*bf16", bias_ptr="*bf16",
                                                                 y_ptr="*bf16"),
                           dict(BLOCK_N=16, BLOCK_K=512, EVEN_K=False, HAS_BIAS=True, SPLIT_K=1, HW_FP8=False),
                           4, 1, 75),
    "rms_norm_residual": ("fused_norm", "_rms_norm_kernel", dict(x_ptr="*fp16", r_ptr="*fp16", w_ptr="*fp16",
                          y_ptr="*fp16", h_ptr="*fp16", order_ptr="*i32", eps="fp32"),
                          dict(BLOCK_D=4096, HAS_RESIDUAL=True), 8, 1, 75),
    "rms_norm_order_bf16": ("fused_norm", "_rms_norm_kernel", dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16",
                           y_ptr="*bf16", h_ptr="*bf16", order_ptr="*i32", eps="fp32"),
                           dict(BLOCK_D=8192, HAS_RESIDUAL=False, HAS_ORDER=True), 16, 1, 80),
    "rotary": ("rotary", "_rotary_kernel", dict(_ROPE, q_ptr="*bf16", k_ptr="*bf16", qo_ptr="*bf16",
                                                ko_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*bf16",
                                                v_cache_ptr="*bf16"),
               dict(BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64), 4, 1, 80),
    "rotary_store_kv_fp8_e4m3": ("rotary", "_rotary_kernel", _ROPE,
                                 dict(BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64, STORE_KV=True,
                                      **_E4M3), 4, 1, 75),
    "paged_decode_fp8_e4m3": ("paged_attention", "_decode_kernel", _DECODE,
                              dict(_DECODE_META, **_E4M3_READ), 4, 1, 75),
    "paged_decode_fp8_e5m2_hw_bf16": ("paged_attention", "_decode_kernel",
                                      dict(_DECODE, q_ptr="*bf16", out_ptr="*bf16"),
                                      dict(_DECODE_META, **_E5M2_READ_HW), 4, 1, 89),
    "paged_prefill_fp8_e4m3": ("paged_attention", "_prefill_kernel",
                               dict(q_ptr="*fp16", k_cache_ptr="*u8", v_cache_ptr="*u8", out_ptr="*fp16",
                                    block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_ptr="*i32",
                                    k_scale_ptr="*fp32", v_scale_ptr="*fp32", sm_scale="fp32"),
                               dict(GROUP=4, BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64,
                                    WINDOW=0, PRECISION="tf32", **_E4M3_READ), 4, 1, 75),
    "kv_store_fp8_e5m2_pdl": ("paged_kv", "_store_kernel",
                              dict(k_ptr="*fp16", v_ptr="*fp16", k_cache_ptr="*u8", v_cache_ptr="*u8",
                                   slot_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32"),
                              dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_D=128, **_E5M2, PDL=True), 4, 1, 90),
    "affine_gemv_w4_h2_pdl": ("affine.gemv", "_affine_gemv_kernel", _P16,
                              dict(_AFF, BITS=4, RS=8, BLOCK_N=128, SPLIT_K=2, TILE_SCALE=True, EVEN_K=True,
                                   H2=True, H2_SCALE=16.0, PDL=True), 2, 1, 90),
    "affine_gemv_w4_h2_pdl_rope_fp8": ("affine.gemv", "_affine_gemv_kernel", _P16,
                                       dict(_AFF, BITS=4, RS=4, BLOCK_N=256, SPLIT_K=8, TILE_SCALE=True, EVEN_K=True,
                                            H2=True, H2_SCALE=16.0, PDL=True, ROPE=True, HEAD_D=128, **_E4M3),
                                       2, 1, 90),
    "affine_gemv_w4_h2_pdl_pipelined": ("affine.gemv", "_affine_gemv_kernel", _P16,
                                        dict(_AFF, BITS=4, RS=16, BLOCK_N=128, SPLIT_K=8, TILE_SCALE=True,
                                             EVEN_K=True, H2=True, H2_SCALE=16.0, PDL=True, STAGES=3), 4, 1, 90),
    "rms_norm_residual_pdl": ("fused_norm", "_rms_norm_kernel", dict(x_ptr="*fp16", r_ptr="*fp16", w_ptr="*fp16",
                              y_ptr="*fp16", h_ptr="*fp16", order_ptr="*i32", eps="fp32"),
                              dict(BLOCK_D=4096, HAS_RESIDUAL=True, PDL=True), 8, 1, 90),
    "all_reduce_norm_pdl": ("all_reduce_norm", "_all_reduce_norm_kernel",
                            dict(x_ptr="*fp16", r_ptr="*fp16", w_ptr="*fp16", y_ptr="*fp16", h_ptr="*fp16",
                                 order_ptr="*i32", round_ptr="*i32", data_ptr="*fp16", deltas="*i64", eps="fp32"),
                            dict(WORLD=4, BLOCK_D=8192, HAS_RESIDUAL=True, HAS_ORDER=True, PDL=True), 16, 1, 90),
    "all_reduce_norm_world3_bf16": ("all_reduce_norm", "_all_reduce_norm_kernel",
                                    dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", h_ptr="*bf16",
                                         order_ptr="*i32", round_ptr="*i32", data_ptr="*bf16", deltas="*i64",
                                         eps="fp32"),
                                    dict(WORLD=3, BLOCK_D=4096, HAS_RESIDUAL=False), 16, 1, 80),
    "rotary_store_kv_pdl": ("rotary", "_rotary_kernel", dict(_ROPE, k_cache_ptr="*fp16", v_cache_ptr="*fp16"),
                            dict(BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64, STORE_KV=True, PDL=True), 4, 1, 90),
    "paged_decode_pdl": ("paged_attention", "_decode_kernel", dict(_DECODE, k_cache_ptr="*fp16",
                                                                   v_cache_ptr="*fp16"),
                         dict(_DECODE_META, **NO_FP8_READ, PDL=True, PREFETCH=True), 8, 1, 90),
    # Gluon (sm90 only: wgmma); num_stages unused (the kernel's ring of STAGES is its own)
    "affine_wgmma_w4": ("affine.wgmma", "_affine_wgmma_kernel", _WG, _WGMMA, 4, 1, 90),
    "affine_wgmma_w4_bf16_zb_bias_128": ("affine.wgmma", "_affine_wgmma_kernel", dict(_WG, x_ptr="*bf16", y_ptr="*fp32",
                                                                                   bias_ptr="*bf16"),
                                         dict(_WGMMA, HAS_ZB=True, HAS_BIAS=True, BLOCK_N=128), 4, 1, 90),
    "affine_wgmma_w4_m32_stored_lag3": ("affine.wgmma", "_affine_wgmma_kernel", dict(_WG, bias_ptr="*fp16"),
                                        dict(_WGMMA, BLOCK_M=32, ATOMIC=False, HAS_BIAS=True, LAG=3, STAGES=4,
                                             PDL=False), 4, 1, 90),
    "affine_wgmma_w4_m128_two_warpgroups": ("affine.wgmma", "_affine_wgmma_kernel", _WG,
                                            dict(_WGMMA, BLOCK_M=128, ATOMIC=False, STAGES=4, PDL=False), 8, 1, 90),
    "affine_wgmma_w4_g32": ("affine.wgmma", "_affine_wgmma_kernel", _WG, dict(_WGMMA, GS=32, SROWS=2), 4, 1, 90),
    "affine_wgmma_w4_g64_zb_m128": ("affine.wgmma", "_affine_wgmma_kernel", _WG,
                                    dict(_WGMMA, GS=64, SROWS=2, HAS_ZB=True, BLOCK_M=128, ATOMIC=False, STAGES=4),
                                    8, 1, 90),
    "affine_wgmma_w8_g32": ("affine.wgmma", "_affine_wgmma_kernel", _WG, dict(_WGMMA, BITS=8, GS=32, ZERO=128), 4, 1,
                            90),
    "affine_wgmma_w8_g32_two_blocks": ("affine.wgmma", "_affine_wgmma_kernel", _WG,
                                       dict(_WGMMA, BITS=8, BLOCKS=2, GS=32, SROWS=2, ZERO=128), 4, 1, 90),
    "affine_wgmma_w8_g64_two_blocks_m128": ("affine.wgmma", "_affine_wgmma_kernel", _WG,
                                            dict(_WGMMA, BITS=8, BLOCKS=2, GS=64, SROWS=2, HAS_ZB=True, BLOCK_M=128,
                                                 ATOMIC=False, STAGES=4), 8, 1, 90),
    "affine_wgmma_w8_chan_zb_m128": ("affine.wgmma", "_affine_wgmma_kernel", _WG,
                                     dict(_WGMMA, BITS=8, GS=4096, HAS_ZB=True, BLOCK_M=128, ATOMIC=False, STAGES=4),
                                     8, 1, 90),
    "affine_wgmma_w4_g32_zb_bf16": ("affine.wgmma", "_affine_wgmma_kernel", dict(_WG, x_ptr="*bf16", y_ptr="*fp32",
                                                                              bias_ptr="*bf16"),
                                    dict(_WGMMA, GS=32, SROWS=4, HAS_ZB=True), 4, 1, 90),
    "affine_wgmma_ws_w4_m128": ("affine.wgmma_ws", "_w4_ws_kernel", _ws_descs(128, 256, "fp16"), _WS, 8, 1, 90),
    "affine_wgmma_ws_w4_bf16_zb_bias_m64": ("affine.wgmma_ws", "_w4_ws_kernel",
                                            dict(_ws_descs(64, 256, "bf16"), bias_ptr="*bf16", y_ptr="*fp32"),
                                            dict(_WS, HAS_ZB=True, HAS_BIAS=True, ATOMIC=True, LAG=2, STAGES=4),
                                            8, 1, 90),
    "ggml_wgmma_q4_k": ("ggml.wgmma", "_ggml_wgmma_kernel", _GGML_WG, _GGML_WGMMA, 4, 1, 90),
    "ggml_wgmma_q5_k_m32_bias_stored": ("ggml.wgmma", "_ggml_wgmma_kernel", _GGML_WG,
                                        dict(_GGML_WGMMA, KIND=5, BLOCK_M=32, HAS_BIAS=True, ATOMIC=False, LAG=3,
                                             PDL=False), 4, 1, 90),
    "ggml_wgmma_q6_k": ("ggml.wgmma", "_ggml_wgmma_kernel", _GGML_WG, dict(_GGML_WGMMA, KIND=6), 4, 1, 90),
    "ggml_wgmma_q4_k_m128_two_warpgroups": ("ggml.wgmma", "_ggml_wgmma_kernel", _GGML_WG,
                                            dict(_GGML_WGMMA, BLOCK_M=128, BLOCK_N=256, STAGES=4, LAG=3,
                                                 ORDERED=True), 8, 1, 90),
    "ggml_wgmma_q6_k_m64_two_warpgroups": ("ggml.wgmma", "_ggml_wgmma_kernel", _GGML_WG,
                                           dict(_GGML_WGMMA, KIND=6, BLOCK_M=64, BLOCK_N=256, STAGES=4,
                                                ORDERED=True), 8, 1, 90),
    "ggml_wgmma_q5_k_m128_two_warpgroups": ("ggml.wgmma", "_ggml_wgmma_kernel", _GGML_WG,
                                            dict(_GGML_WGMMA, KIND=5, BLOCK_M=128, BLOCK_N=256, STAGES=3, LAG=3,
                                                 ORDERED=True),
                                            8, 1, 90),
    "ggml_wgmma_q4_k_m16_256_rows": ("ggml.wgmma", "_ggml_wgmma_kernel", _GGML_WG, dict(_GGML_WGMMA, BLOCK_N=256),
                                     4, 1, 90),
    "silu_and_mul": ("activation", "_silu_and_mul_kernel", dict(x_ptr="*fp16", y_ptr="*fp16"),
                     dict(BLOCK=1024), 4, 1, 75),
}


def compile_case(name: str, cc: int):
    """Compile one case for compute capability `cc` (e.g. 90); returns Triton's CompiledKernel."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    module, kernel, types, constexprs, warps, stages, _ = CASES[name]
    fn = getattr(importlib.import_module(module if module.startswith("quanta.") else f"quanta.kernels.{module}"),
                 kernel)
    # constexprs a launcher leaves at their defaults (H2, PDL, ...) compile at those defaults, not as arguments
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | constexprs
    if "WARPS" in fn.arg_names:                  # a kernel's WARPS is its launch's num_warps
        constexprs["WARPS"] = warps
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        signature[arg] = types.get(arg, "i32")
        if signature[arg].startswith("*") or arg in DIV16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource
        src = GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    else:
        src = triton.compiler.ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                          options={"num_warps": warps, "num_stages": stages})


def cases_for(cc: int) -> list[str]:
    return [name for name, case in CASES.items() if cc >= case[6]]


def sass(name: str, cc: int) -> str:
    """The SASS of one case (cuobjdump from the Triton wheel)."""
    import subprocess

    import triton
    compiled = compile_case(name, cc)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", help="dump the SASS of the case whose name contains this")
    ap.add_argument("--cc", type=int, default=90)
    ap.add_argument("--target", type=int, help="compile every case for this target only; exit 1 on a failure")
    args = ap.parse_args()
    if args.sass:
        print(sass(next(n for n in CASES if args.sass in n), args.cc))
        return
    if args.target:
        for name in cases_for(args.target):
            assert compile_case(name, args.target).asm["cubin"], name
        print(f"sm{args.target}: {len(cases_for(args.target))} kernels compiled")
        return
    for name in CASES:
        row = []
        for cc in TARGETS:
            if cc not in [c for c in TARGETS if name in cases_for(c)]:
                row.append(f"sm{cc}: n/a")
                continue
            k = compile_case(name, cc)
            row.append(f"sm{cc}: {k.metadata.shared}B smem")
        print(f"{name:32s} " + "  ".join(row))


if __name__ == "__main__":
    main()
