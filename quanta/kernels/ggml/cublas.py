"""The dequantize + cuBLAS path of the ggml kernels: the weight decoded once per call to [N, K] in the compute dtype
by a Triton kernel (decode.py, as the GEMM decodes its tiles), then torch's matmul. Where the GEMM is compute-bound
(large M) cuBLAS's tiles beat a kernel that decodes every weight tile again for each tile of rows, and the decode
costs the same at any M. The copy is transient: one layer's weight for the length of its GEMM.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.device_caps import DeviceCaps
from quanta.kernels.ggml.decode import decode
from quanta.kernels.ggml.layout import GgmlState, plane_args, type_constexprs
from quanta.kernels.triton_support import cdiv, tl, triton


@triton.jit
def _ggml_dequant_kernel(
    # pointers
    p0, p1, p2, p3, lut_ptr, out_ptr,
    # sizes
    N, K, NB,
    # meta
    TYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
    CENTER: tl.constexpr, HAS_MIN: tl.constexpr, PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[N, K] = the decoded weight in out's dtype; program (K step of 256 / PARTS values, BLOCK_N rows)."""
    AP: tl.constexpr = A // PARTS
    BLOCK_K: tl.constexpr = AP * B * C * D
    step = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    f, scale, minus = decode(p0, p1, p2, p3, lut_ptr, offs_n, mask_n, step // PARTS, (step % PARTS) * AP, NB,
                             N, TYPE, AP)
    w = (f - CENTER) * scale[:, :, :, None, None]
    if HAS_MIN:
        w -= minus[:, :, :, None, None]
    w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(out_ptr.dtype.element_ty)
    k = step * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None] * K + k[None, :], w, mask=mask_n[:, None] & (k < K)[None, :])


class DequantConfig(NamedTuple):
    """A dequantize launch: `block_n` rows of a 256 / `parts`-value K step a program, in `warps` warps."""
    block_n: int = 64
    parts: int = 4
    warps: int = 4


def default_config(st: GgmlState, caps: DeviceCaps, m: int) -> DequantConfig:
    """The dequantize kernel's launch: the same at any M and on any chip; parts never split axis A below one value."""
    return DequantConfig(parts=min(DequantConfig().parts, st.layout.axes[0]))


def dequantize(st: GgmlState, config: tuple = DequantConfig()) -> torch.Tensor:
    """The weight [N, K] in the compute dtype."""
    block_n, parts, warps = config
    assert st.layout.axes[0] % parts == 0, (st.name, parts)
    out = torch.empty(st.n, st.k, device=st.planes[0].device, dtype=st.dtype)
    _ggml_dequant_kernel[(st.tiles * parts, cdiv(st.n, block_n))](
        *plane_args(st), st.lut if st.lut is not None else out, out, st.n, st.k, st.blocks,
        **type_constexprs(st), PARTS=parts, BLOCK_N=block_n, num_warps=warps)
    return out


def matmul(x2: torch.Tensor, st: GgmlState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias): dequantize to the compute dtype, then cuBLAS."""
    w = dequantize(st, config or default_config(st, caps, x2.shape[0]))
    return torch.addmm(bias, x2, w.T) if bias is not None else x2 @ w.T
