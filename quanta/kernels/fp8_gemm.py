"""FP8 weights: W8A8 through cuBLASLt on sm89+ (a GEMV over the same bytes at one row), weight-only below.

sm89+ (Ada, Hopper): activations are quantized per token to e4m3 by `_quant_rows_kernel` (one launch,
scale = amax / 448) and `torch._scaled_mm` (cuBLASLt) multiplies with row-wise scales; the weight stays
in its checkpoint bytes, transposed by view. cuBLASLt's FP8 GEMM outruns bf16 cuBLAS at large M on Llama
shapes, which a Triton FP8 `tl.dot` would have to beat; it is the first choice.
sm75 / sm80 (and e5m2 weights, or block scales, anywhere): weight-only. The bytes are packed like affine
int8 codes and the affine kernels run with MODE=FP8_* by the affine plan's paths: each byte becomes fp16 by
integer operations (fp8_bits.py), never through the hardware FP8 type, which Triton rejects below sm89.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from quanta.kernels import activation, fp8_gemv
from quanta.kernels.activation import silu_mul
from quanta.kernels.affine import plan
from quanta.kernels.affine.layout import FP8_E4M3, FP8_E5M2, AffineState, R, pack
from quanta.kernels.dequantized import reference  # noqa: F401  (the oracle)
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.lora_epilogue import MAX_ROWS as LORA_MAX_ROWS
from quanta.kernels.lora_epilogue import LoRAEpilogue
from quanta.kernels.rotary import RopeStore
from quanta.kernels.triton_support import tl, triton, why_not_device
from quanta.quant.kinds.fp8 import Fp8

NAME = "triton_fp8"
E4M3_MAX = 448.0


@triton.jit
def _row_values(x_row, cols, mask, K, GLU: tl.constexpr):
    """Float32 values of a row's columns `cols`: x's own, or with GLU silu(gate) * up of the row [gate | up] (K
    each), rounded to x's dtype as activation.silu_and_mul rounds them."""
    if GLU:
        g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row + K + cols, mask=mask, other=0.0)
        y = silu_mul(g, u.to(tl.float32), u.dtype).to(tl.float32)
    else:
        y = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def _quant_rows_kernel(
    # pointers
    x_ptr, q_ptr, scale_ptr,
    # sizes
    K,
    # strides
    stride_xm, stride_qm,
    # meta
    BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr, GLU: tl.constexpr,
):
    """q[m, :] = y[m, :] / scale[m] in e4m3, scale[m] = max|y[m, :]| / FP8_MAX, for y = x, or with GLU
    y = silu(gate) * up of x = [gate | up] (the SwiGLU output never written); one program per row.

    When BLOCK_K covers the row it is read once and kept in registers; longer rows are read twice (the
    second time from L2).
    """
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    x_row, q_row = x_ptr + row * stride_xm, q_ptr + row * stride_qm
    if BLOCK_K >= K:
        x = _row_values(x_row, offs, offs < K, K, GLU)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / FP8_MAX
        tl.store(scale_ptr + row, scale)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:
        # --- pass 1: the row's absolute maximum
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = _row_values(x_row, k0 + offs, k0 + offs < K, K, GLU)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
        tl.store(scale_ptr + row, scale)
        # --- pass 2: scale and round to e4m3
        for k0 in range(0, K, BLOCK_K):
            x = _row_values(x_row, k0 + offs, k0 + offs < K, K, GLU)
            q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
            tl.store(q_row + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)


ONE_PASS_MAX_K = 16384      # rows up to this long stay in registers (64 fp32 per thread at 8 warps)


def quantize_rows(x2: torch.Tensor, glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic e4m3 quantization of x2 [M, K]: (q [M, K] float8_e4m3fn, scales [M, 1] float32). With
    `glu`, of silu(gate) * up for x2 = [gate | up] [M, 2K] (activation.silu_and_mul's values), in one launch."""
    m, k = x2.shape[0], x2.shape[1] // (2 if glu else 1)
    assert x2.stride(1) == 1
    q = torch.empty(m, k, device=x2.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(m, 1, device=x2.device, dtype=torch.float32)
    block = triton.next_power_of_2(k) if k <= ONE_PASS_MAX_K else 4096
    _quant_rows_kernel[(m,)](x2, q, scale, k, x2.stride(0), q.stride(0), BLOCK_K=block, FP8_MAX=E4M3_MAX, GLU=glu,
                             num_warps=max(4, min(8, block // 1024)))
    return q, scale


class Fp8Rows(NamedTuple):
    """Activations already quantized for a W8A8 GEMM (quantize_rows' q and scale), as a SwiGLU hands them to
    the down projection so that its [M, I] 16-bit output is never written; `lead`: x's leading dimensions."""
    q: torch.Tensor
    scale: torch.Tensor
    lead: tuple[int, ...]


@dataclass(slots=True)
class W8A8State:
    """cuBLASLt operands: the weight [K, N] (column-major view of the checkpoint's [N, K]) and its scales."""
    w_t: torch.Tensor                # float8_e4m3fn [K, N], stride (1, K)
    w_scale: torch.Tensor            # float32 [1, N]
    n: int
    k: int
    dtype: torch.dtype


def w8a8(x2: torch.Tensor, st: W8A8State, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] @ weight.T with x2 quantized per token to e4m3.

    Fast accumulation (no periodic promotion of the tensor cores' partial sums to fp32, as vLLM's CUTLASS
    FP8 kernels do) is faster at large M; against an fp64 product of the same fp8 operands its relative error
    stays within a few times the bf16 output's rounding (it grows with K), far below the e4m3 activation
    rounding's ~3e-2."""
    return _scaled_mm(*quantize_rows(x2), st, bias)


def _scaled_mm(q: torch.Tensor, scale: torch.Tensor, st: W8A8State, bias: torch.Tensor | None) -> torch.Tensor:
    """cuBLASLt's e4m3 GEMM of rows quantized by quantize_rows with the state's weight (w8a8's rule)."""
    return torch._scaled_mm(q, st.w_t, scale_a=scale, scale_b=st.w_scale, bias=bias, out_dtype=st.dtype,
                            use_fast_accum=True)


def _w8a8_reason(weight: Fp8, caps: DeviceCaps) -> str | None:
    """None if the W8A8 cuBLASLt path can run this weight on a device of these caps, else why it falls back to
    weight-only."""
    if not caps.fp8:
        return "no FP8 units below sm89: weight-only FP8 with bit-level conversion"
    if weight.fmt != "e4m3" or weight.strategy == "block":
        return f"{weight.describe()}: cuBLASLt row-wise scaling needs e4m3 with tensor/channel scales"
    if weight.shape[1] % 16 or weight.shape[0] % 16:
        return "cuBLASLt FP8 needs N and K multiples of 16"
    return None


W8A8_REASON = "sm89+: per-token e4m3 activations + torch._scaled_mm (cuBLASLt)"


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    if not isinstance(weight, Fp8):
        return "not an fp8 weight"
    if weight.block_size is not None and weight.block_size[1] % R:
        return f"block scales of {weight.block_size[1]} columns are not a multiple of {R}"
    return why_not_device(device, dtype)


def prepare(weight: Fp8, device: torch.device, dtype: torch.dtype) -> W8A8State | AffineState:
    w = weight.to(device)
    n, k = w.shape
    if _w8a8_reason(w, device_caps(device)) is None:
        scale = w.scale.float().reshape(-1, 1).expand(n, 1).reshape(1, n).contiguous()
        return W8A8State(w.data.t(), scale, n, k, dtype)
    mode = FP8_E4M3 if w.fmt == "e4m3" else FP8_E5M2
    if w.block_size is None:
        return pack(w.data.view(torch.uint8), 8, None, w.scale.float().reshape(-1, 1).expand(n, 1), dtype, mode=mode)
    bn, bk = w.block_size
    scales = w.scale.float().repeat_interleave(bn, 0)[:n]               # [N, ceil(K / bk)]
    return pack(w.data.view(torch.uint8), 8, bk if scales.shape[1] > 1 else None, scales, dtype, mode=mode)


GEMV_REASON = (f"M <= {fp8_gemv.MAX_ROWS}: bandwidth-bound; a GEMV streams the e4m3 bytes the W8A8 path holds, "
               "converted in registers (fp8_gemv.py)")


def _gemv(x2: torch.Tensor, st: W8A8State, bias: torch.Tensor | None, **epilogue) -> torch.Tensor:
    """fp8_gemv over the W8A8 state's bytes: its [K, N] view transposed back to the checkpoint's [N, K] rows."""
    return fp8_gemv.matmul(x2, st.w_t.t(), st.w_scale.reshape(-1), bias, **epilogue)


def apply(x: torch.Tensor | Fp8Rows, state, bias: torch.Tensor | None = None,
          lora: LoRAEpilogue | None = None) -> torch.Tensor:
    """y = x @ W.T + bias: the affine plan's path for a weight-only state; else the GEMV at one row, W8A8 above,
    whose input may come quantized already (Fp8Rows, where takes_fp8_rows). `lora`: adapter products the GEMV's
    epilogue adds (where lora_fuses says it runs)."""
    if isinstance(x, Fp8Rows):
        return _scaled_mm(x.q, x.scale, state, bias).reshape(*x.lead, state.n)
    if isinstance(state, AffineState):
        return plan.matmul(x, state, bias, lora=lora)
    x2 = x.reshape(-1, state.k).contiguous()
    if x2.shape[0] <= fp8_gemv.MAX_ROWS:
        y = _gemv(x2, state, bias, lora=lora)
    else:
        assert lora is None, "only the GEMV takes a LoRA epilogue (lora_fuses)"
        y = w8a8(x2, state, bias)
    return y.reshape(*x.shape[:-1], state.n)


def lora_fuses(state, m: int) -> bool:
    """Whether m rows run on a GEMV whose epilogue adds LoRA products (the fp8 or the affine GEMV)."""
    if isinstance(state, AffineState):
        return plan.lora_fuses(state, m)
    return m <= min(fp8_gemv.MAX_ROWS, LORA_MAX_ROWS)


def takes_fp8_rows(state, m: int) -> bool:
    """Whether m rows of input reach this state's W8A8 GEMM, which then takes them as Fp8Rows."""
    return isinstance(state, W8A8State) and m > fp8_gemv.MAX_ROWS


def apply_glu(x: torch.Tensor, state, bias: torch.Tensor | None = None, lora: LoRAEpilogue | None = None,
              fp8_rows: bool = False) -> torch.Tensor | Fp8Rows:
    """silu(gate) * up for a weight stacking [gate; up]: made in the GEMV's epilogue at one row. `fp8_rows`
    (the next GEMM takes_fp8_rows): where W8A8 runs, the product comes as Fp8Rows, quantized in the launch that
    forms it."""
    if isinstance(state, AffineState):
        return plan.matmul_glu(x, state, bias, lora)
    x2 = x.reshape(-1, state.k).contiguous()
    if x2.shape[0] <= fp8_gemv.MAX_ROWS:
        y = _gemv(x2, state, bias, glu=True, lora=lora)
    else:
        assert lora is None, "only the GEMV takes a LoRA epilogue (lora_fuses)"
        h = w8a8(x2, state, bias)
        if fp8_rows:
            return Fp8Rows(*quantize_rows(h, glu=True), tuple(x.shape[:-1]))
        y = activation.silu_and_mul(h)
    return y.reshape(*x.shape[:-1], state.n // 2)


def apply_rope_store(x: torch.Tensor, state, bias: torch.Tensor | None, rope: RopeStore,
                     lora: LoRAEpilogue | None = None) -> torch.Tensor | None:
    """x @ W.T + bias for W = [q; k; v] with q and k rotated and k, v stored in the paged caches by the GEMV's
    epilogue at one row; None where no GEMV with that epilogue runs (the caller then runs the rotary kernel)."""
    if isinstance(state, AffineState):
        return plan.matmul_rope(x, state, bias, rope, lora)
    x2 = x.reshape(-1, state.k)
    if x2.shape[0] > fp8_gemv.MAX_ROWS or not fp8_gemv.rope_applies(state.n, rope):
        return None
    y = _gemv(x2.contiguous(), state, bias, rope=rope, lora=lora)
    return y.reshape(*x.shape[:-1], state.n)


def path(state, m: int) -> tuple[str, str]:
    """(NAME/gemv or NAME/w8a8, or NAME/the affine path of a weight-only state, for an M-row input; why)."""
    if isinstance(state, W8A8State):
        return (f"{NAME}/gemv", GEMV_REASON) if m <= fp8_gemv.MAX_ROWS else (f"{NAME}/w8a8", W8A8_REASON)
    name, reason = plan.explain(state, device_caps(state.packed.device), m)
    return f"{NAME}/{name}", f"weight-only, fp8 bytes converted by integer operations; {reason}"
