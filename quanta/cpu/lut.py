"""NF4 / FP4 and FP8 weights on the CPU read through a table of their values (ggml_matmul.c's quanta_lut_matmul): a
tile of four rows becomes table[code] * scale in a float scratch, multiplied with every activation row in float32,
each product summed in one fixed order (batch-invariant, as cpu_ggml). The codes stay as stored (FP8 a byte, a view
of the weight; NF4 two a byte); a codebook's absmax is held resolved to float32, as cpu_rows holds it. Without a C
compiler, or with QUANTA_NATIVE=0, the weight goes on to cpu_rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.cpu import affine as cpu_affine, ggml as cpu_ggml
from quanta.cpu.rows import NibbleCodebook, reference  # noqa: F401  (reference: the oracle)
from quanta.quant.fp8_codes import fp8_values
from quanta.quant import native_build
from quanta.quant.kinds.codebook import Codebook
from quanta.quant.kinds.fp8 import Fp8
from quanta.quant.qtensor import QTensor

NAME = "cpu_lut"
WIDTH = 16                  # K must be whole vectors of the widest instruction set the C is built for


@dataclass
class State:
    codes: torch.Tensor         # uint8 [N, K] (FP8) or [N, K / 2] (4-bit, code 2j in the low nibble)
    bits: int
    table: torch.Tensor         # float32 [256] or [16]
    scales: torch.Tensor        # float32: row r, column c reads scales[(r // row_div) * row_mul + c // col_div]
    row_div: int
    row_mul: int
    col_div: int
    shape: tuple[int, int]


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    if torch.device(device).type != "cpu":
        return "CPU only"
    if not isinstance(weight, (Codebook, Fp8)):
        return "codebook or FP8 weights only"
    if dtype not in cpu_affine.DTYPES:
        return f"computes in float32 from bfloat16 or float32, not {dtype}"
    n, k = weight.shape
    if k % WIDTH:
        return f"K={k} is not a multiple of {WIDTH}"
    if isinstance(weight, Codebook) and (k % weight.blocksize and weight.blocksize % k or weight.blocksize % 2):
        return f"blocks of {weight.blocksize} neither divide K={k} nor hold whole rows, in pairs of codes"
    return native_build.missing(cpu_ggml.library)


def prepare(weight: QTensor, device: torch.device, dtype: torch.dtype) -> State:
    n, k = weight.shape
    if isinstance(weight, Codebook):
        nib = NibbleCodebook.of(weight)
        bs = weight.blocksize
        layout = (1, k // bs, bs) if k % bs == 0 else (bs // k, 1, k)
        return State(nib.packed, 4, nib.table.contiguous(), nib.absmax.contiguous(), *layout, (n, k))
    table = fp8_values(weight.data.dtype)
    scales = weight.scale.float().contiguous()
    if weight.block_size is not None:
        layout = (weight.block_size[0], scales.shape[-1], weight.block_size[1])
    else:
        layout = (1, 0 if scales.numel() == 1 else 1, k)
    return State(weight.data.view(torch.uint8), 8, table, scales.reshape(-1), *layout, (n, k))


def apply(x: torch.Tensor, state: State, bias: torch.Tensor | None = None) -> torch.Tensor:
    n, k = state.shape
    rows = x.reshape(-1, k).to(torch.float32).contiguous()
    y = torch.empty(rows.shape[0], n)
    if rows.shape[0]:
        done = cpu_ggml.library().quanta_lut_matmul(
            rows.data_ptr(), rows.shape[0], k, state.codes.data_ptr(), state.bits, state.table.data_ptr(),
            state.scales.data_ptr(), state.row_div, state.row_mul, state.col_div, n, y.data_ptr(),
            torch.get_num_threads())
        assert done == 0, state.shape                  # supports() admitted only what the C takes
    return cpu_affine.finish(y, x.shape[:-1], n, x.dtype, bias)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The products run in float32 whatever the activations' dtype."""
    return torch.float32


def path(state: State, m: int) -> tuple[str, str]:
    """(NAME, why) at any M."""
    return NAME, f"{state.bits}-bit codes as stored, table value times scale four rows at a time, float32 products"
