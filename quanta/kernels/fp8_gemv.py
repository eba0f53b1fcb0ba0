"""FP8 weights at one activation row: a GEMV that streams the checkpoint's e4m3 bytes, row-major [N, K].

At M = 1 a product is bound by the weight's bytes, and FP8's are half of fp16's; the W8A8 path (fp8_gemm.py) first
quantizes the activations and then runs cuBLASLt's tensor-core GEMM, which at one row reads the weight no faster
than fp16 cuBLAS. This kernel reads the same bytes the W8A8 path holds (no copy, no repack): each program takes
BLOCK_N rows and a split of K, loads 16 contiguous bytes a thread, converts them in registers (sm89+: the hardware
e4m3 conversion, two values an instruction; elsewhere and in the interpreter: integer operations, fp8_bits.py) and
multiplies in float32. The per-channel scale is applied once per output. Splits add float32 partials into the
affine GEMV's workspace and the last to arrive finishes y with that GEMV's epilogues (SwiGLU; rotary and the KV
store), so no memset runs and a decode layer launches as few kernels as on the affine weights.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.affine.gemv_out import (  # noqa: F401  (workspace: this path's, for its callers)
    LOCK_COLUMNS,
    gemv_launch,
    output_columns,
    rope_fits,
    store_output,
    workspace,
)
from quanta.kernels.lora_epilogue import RANK_CHUNK, LoRAEpilogue, lora_delta, no_lora_args
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.paged_kv import fp8_write_constexprs
from quanta.kernels.rotary import RopeStore
from quanta.kernels.triton_support import (
    cdiv,
    pdl_launch,
    pdl_launch_dependents,
    pdl_wait,
    tl,
    triton,
)

MAX_ROWS = 1                  # the activation rows the plan gives this path (a program row per activation row)


@triton.jit
def _e4m3(b, HW_FP8: tl.constexpr):
    """e4m3 bytes b (uint8) as float32: the value (HW_FP8), or without the hardware conversion the value / 2**8
    (the byte's sign and magnitude moved into an fp16, whose exponent bias is 8 more; the caller scales once)."""
    if HW_FP8:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    i = b.to(tl.int32)
    return (((i & 0x80) << 8) | ((i & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp8_gemv_kernel(
    # pointers
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr,
    pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,      # ROPE only
    lora_part_ptr, lora_b_ptr, lora_scale_ptr, lora_slot_ptr, LORA_J, LORA_PIECES, LORA_B1, LORA_B2,   # LORA only
    lora_stride_bs,
    # sizes
    N, K, steps_per_split, num_steps, Q_SIZE, KV_SIZE,
    # strides
    stride_xm, stride_ym,
    # meta
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, HW_FP8: tl.constexpr, PDL: tl.constexpr = False, GLU: tl.constexpr = False,
    ROPE: tl.constexpr = False, HEAD_D: tl.constexpr = 128,
    FP8: tl.constexpr = 0, FP8_MAX: tl.constexpr = 0.0, FP8_SHIFT: tl.constexpr = 0, FP8_REBIAS: tl.constexpr = 0,
    FP8_MIN_NORMAL: tl.constexpr = 0.0, FP8_MAGIC: tl.constexpr = 0.0, FP8_MAGIC_BITS: tl.constexpr = 0,
    LORA: tl.constexpr = False, LORA_P: tl.constexpr = 1, LORA_R: tl.constexpr = 16, LORA_PIECES_PAD: tl.constexpr = 1,
    LORA_CHUNK: tl.constexpr = RANK_CHUNK,
):
    """y[m, n] = scale[n] * sum_k x[m, k] * W[n, k] (+ bias[n]); program (row m, BLOCK_N rows of W, split of K).
    Output columns and epilogues are the affine GEMV's (gemv_out.py): GLU, W = [gate;
    up] and y = silu(gate) * up, a program's columns being BLOCK_N / 2 gate columns and the same up columns; ROPE,
    W = [q; k; v] and q, k rotated, k and v stored in the paged caches (FP8* constexprs: the cache's format);
    LORA, one more K split, with an empty K range, adds the row's adapter products (lora_epilogue.lora_delta)."""
    pdl_launch_dependents(PDL)                    # as the affine GEMV: the next kernel waits for this one anyway
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n, mask_n = output_columns(pid_n, N, BLOCK_N, GLU)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    x_row = x_ptr + pid_m * stride_xm
    s_begin = pid_k * steps_per_split
    s_end = tl.minimum(s_begin + steps_per_split, num_steps)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for step in range(s_begin, s_end):
        k = step * BLOCK_K + offs_k
        if EVEN_K:
            b = tl.load(w_rows + k[None, :], mask=mask_n[:, None], other=0)
        else:
            b = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & (k < K)[None, :], other=0)
        # x is the previous kernel's output: wait for it once the first weight bytes are on their way, so a
        # program's first load overlaps that kernel's tail (returns at once after the first time)
        pdl_wait(PDL)
        if EVEN_K:
            x = tl.load(x_row + k).to(tl.float32)
        else:
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        acc += _e4m3(b, HW_FP8) * x[None, :]
    pdl_wait(PDL)                                 # a program with no steps (the LoRA split) waits here
    y = tl.sum(acc, axis=1) * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    if not HW_FP8:
        y = y * 256.0
    if LORA:
        if pid_k == SPLIT_K - 1:                  # the adapter's own program: its K range is empty
            y += lora_delta(lora_part_ptr, lora_b_ptr, lora_scale_ptr, lora_slot_ptr, pid_m, tl.num_programs(0),
                            LORA_J, LORA_PIECES, LORA_B1, LORA_B2, lora_stride_bs, offs_n, mask_n, LORA_P, LORA_R,
                            LORA_PIECES_PAD, LORA_CHUNK)
    store_output(y, bias_ptr, HAS_BIAS, y_ptr + pid_m * stride_ym, ws_ptr, lock_ptr, pid_m, pid_n, pid_k, offs_n,
                 mask_n, N, SPLIT_K, BLOCK_N, GLU, pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr,
                 v_scale_ptr, Q_SIZE, KV_SIZE, ROPE, HEAD_D, FP8, FP8_MAX, FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL,
                 FP8_MAGIC, FP8_MAGIC_BITS)


class Fp8GemvConfig(NamedTuple):
    """A launch: BLOCK_N weight rows by BLOCK_K bytes a step (16 a thread across the warps' lanes), the K loop
    split for about `waves` programs an SM with at least `min_steps` steps each."""
    block_n: int = 16
    block_k: int = 512
    warps: int = 4
    waves: float = 4.0
    min_steps: int = 2


# The rotary epilogue needs whole heads in a program's columns: 128 rows by 128 bytes in 8 warps keeps the float32
# products at 64 registers a thread, as the default's 16 by 512 in 4 warps does.
ROPE_CONFIG = Fp8GemvConfig(128, 128, 8, 4.0, 2)


def default_config(rope: RopeStore | None = None) -> Fp8GemvConfig:
    """The launch: one config for every shape and chip (bandwidth-bound, 16-byte loads); whole heads with the
    rotary epilogue."""
    return Fp8GemvConfig() if rope is None else ROPE_CONFIG


def rope_applies(n: int, rope: RopeStore, config: tuple | None = None) -> bool:
    """Whether the rotary epilogue can finish W = [q; k; v] of n rows under `config` (default: ROPE_CONFIG)."""
    return rope_fits(n, rope, (config or ROPE_CONFIG)[0])


def matmul(x2: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
           config: tuple | None = None, *, caps: DeviceCaps | None = None, hw_fp8: bool | None = None,
           glu: bool = False, rope: RopeStore | None = None, lora: LoRAEpilogue | None = None) -> torch.Tensor:
    """y[M, N] = (x2[M, K] @ fp8(w).T) * scale (+ bias), w the e4m3 bytes [N, K] row-major (uint8 or
    float8_e4m3fn), scale float32 with N values (per channel). `glu`: W stacks [gate; up] and y [M, N/2] =
    silu(gate) * up. `rope`: W stacks [q; k; v] (rope_applies must hold) and y's q columns hold the rotated q, k
    and v being stored in the caches. `lora`: each row's adapter products (quanta.lora.kernels.shrink_rows of
    these rows) are added before all that. `hw_fp8` forces the conversion (tests)."""
    m, k = x2.shape
    n = w.shape[0]
    assert w.shape == (n, k) and w.stride() == (k, 1) and x2.stride(1) == 1 and scale.numel() == n
    caps = caps or device_caps(x2.device)
    config = Fp8GemvConfig(*(config or default_config(rope)))
    bn, bk, warps, waves, min_steps = config
    assert bn % LOCK_COLUMNS == 0 and not (glu and rope is not None) and (not glu or n % 2 == 0)
    assert rope is None or rope_applies(n, rope, config)
    steps = cdiv(k, bk)
    column_blocks, splits, per, y, ws, locks = gemv_launch(x2, n, steps, bn, waves, min_steps, glu, x2.dtype, caps)
    hw = caps.is_cuda and caps.fp8 if hw_fp8 is None else hw_fp8
    lora_split = int(lora is not None)
    _fp8_gemv_kernel[(m, column_blocks, splits + lora_split)](
        x2, w.view(torch.uint8), scale, bias if bias is not None else x2, y, ws, locks,
        *(rope.kernel_args() if rope is not None else (x2,) * 7),
        *(lora.kernel_args() if lora is not None else no_lora_args(x2)),
        n, k, per, steps, *((rope.q_size, rope.kv_size) if rope else (0, 0)), x2.stride(0), y.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, HAS_BIAS=bias is not None, SPLIT_K=splits + lora_split, HW_FP8=hw,
        GLU=glu, ROPE=rope is not None, HEAD_D=rope.head_dim if rope is not None else 128,
        **fp8_write_constexprs(rope.fmt if rope else None), **(lora.constexprs() if lora is not None else {}),
        num_warps=warps, **pdl_launch(caps))
    return y
