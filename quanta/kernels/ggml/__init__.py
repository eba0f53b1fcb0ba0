"""GGUF block weights read as the file stores them, decoded in registers (the registry's `ggml_gemm` module).

    layout   the plane layout (GgmlState, prepare): each block field in a plane of its own, the same bytes
    decode   per-type bit-level decoding of a tile into codes, scales and mins (Triton helpers)
    gemv     M <= a few rows, no tensor cores          gemm     the tiled tl.dot GEMM
    plan     which path runs M rows, from DeviceCaps
The path modules import only `layout`, `decode` and the Triton helpers; `plan` imports them.
"""
