"""GGUF block weights read as the file stores them, decoded in registers (the registry's `ggml_gemm` module).

    layout   the plane layout (GgmlState, prepare): each block field in a plane of its own, the same bytes
    decode   per-type bit-level decoding of a tile into codes, scales and mins (Triton helpers)
    gemv     M <= a few rows, no tensor cores          gemm     the tiled tl.dot GEMM
    gemv_cols, gemv_h2   one row over column-major / row-major planes, packed-half PTX
    gemv_dp4a, gemv_iq4  one row against x rounded to int8, dp4a (Q2_K / Q3_K; IQ4 by byte-permute lookups)
    mma, wgmma           the K-quants' code words decoded into the tensor cores' register operand (tl.dot; Gluon)
    cublas   the weight dequantized for the length of a call
    plan     which path runs M rows, from DeviceCaps
The path modules import `layout`, `decode`, the Triton helpers and the affine family's PTX (wgmma: mma's PTX and
the affine wgmma kernel's config); `plan` imports them.
"""
