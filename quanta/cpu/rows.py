"""Quantized weights on the CPU at their own bytes: every call dequantizes a block of output rows at a time into a
small float scratch and multiplies it (cpu_matmul.linear, batch-invariant), so memory holds the weight as stored
plus one block.

It runs the formats torch has no packed GEMM for where the native kernels cannot (affine widths other than 4 and
per-channel 8; NF4 / FP4, FP8 and GGUF types without cpu_lut / cpu_ggml's native code or outside their shapes).
It trades time for memory: a call costs one dequantization of the whole weight, small beside a prefill chunk's
products and most of a decode step's work;
`kernel="dequantized"` decodes once at load instead, at 4 bytes a weight.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quanta.cpu import affine as cpu_affine, matmul as cpu_matmul
from quanta.quant.kinds.codebook import Codebook
from quanta.quant.kinds.fp8 import Fp8
from quanta.quant.kinds.gguf import Gguf
from quanta.quant.qtensor import QTensor
from quanta.quant.shard import take_rows

NAME = "cpu_rows"
BLOCK_WEIGHTS = 1 << 20     # weights dequantized at once: a float32 scratch of 4 MiB, in the L2 / L3 caches


@dataclass
class NibbleCodebook:
    """A Codebook's rows with two 4-bit codes a byte (the Codebook kind holds one a byte), dequantized as
    Codebook.dequantize does: table[code] * absmax of its block, in float32."""
    packed: torch.Tensor        # uint8 [rows, K / 2]: code 2j in the low nibble of byte j, 2j + 1 in the high
    table: torch.Tensor         # float32 [16]
    absmax: torch.Tensor        # float32 [rows * K / blocksize]
    blocksize: int
    shape: tuple[int, int]

    @classmethod
    def of(cls, w: Codebook) -> NibbleCodebook:
        packed = w.codes[:, 0::2] | (w.codes[:, 1::2] << 4)
        return cls(packed.contiguous(), w.table.float(), w.block_absmax().contiguous(), w.blocksize, w.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = torch.stack([self.packed & 0x0F, self.packed >> 4], dim=-1).reshape(-1)
        flat = self.table[codes.long()]
        scale = self.absmax.repeat_interleave(self.blocksize)[: flat.numel()]
        return (flat * scale).reshape(self.shape).to(dtype)


@dataclass
class State:
    blocks: list                # row blocks of the weight, each with dequantize(dtype) -> [rows, K]
    starts: list[int]           # the first output row of each block
    out_features: int
    dtype: torch.dtype          # what the products compute in


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    if torch.device(device).type != "cpu":
        return "CPU only"
    if not isinstance(weight, QTensor):
        return "not a QTensor"
    if dtype not in cpu_affine.DTYPES:
        return f"computes in bfloat16 or float32, not {dtype}"
    if isinstance(weight, Codebook) and weight.shape[1] % 2:
        return f"K={weight.shape[1]} is odd: 4-bit codes are held two a byte"
    return None


def block_rows(weight: QTensor) -> int:
    """Rows of one block: about BLOCK_WEIGHTS weights, a multiple of 16 and of whatever unit the kind's rows
    must be cut at (a codebook's flattened blocks, an FP8 weight's scale blocks)."""
    n, k = weight.shape
    unit = 16
    if isinstance(weight, Codebook):
        unit = math.lcm(unit, weight.blocksize // math.gcd(k, weight.blocksize))
    if isinstance(weight, Fp8) and weight.block_size is not None:
        unit = math.lcm(unit, weight.block_size[0])
    return min(n, max(unit, BLOCK_WEIGHTS // k // unit * unit))


def prepare(weight: QTensor, device: torch.device, dtype: torch.dtype) -> State:
    n = weight.shape[0]
    rows = block_rows(weight)
    starts = list(range(0, n, rows))
    blocks = [_held(take_rows(weight.to(device), start, min(start + rows, n))) for start in starts]
    return State(blocks, starts, n, dtype)


def _held(block: QTensor):
    """How a block is held: a codebook's codes two a byte; a GGUF block whose exact affine form (codes a byte,
    float16 scales) costs at most a tenth more than its blocks (Q8_0) in that form, which dequantizes in two
    operations instead of the block's bit unpacking; anything else as stored."""
    if isinstance(block, Codebook):
        return NibbleCodebook.of(block)
    if isinstance(block, Gguf) and block.affine_scheme() is not None:
        affine = block.to_affine()
        if sum(t.numel() * t.element_size() for t in affine.tensors().values()) <= 1.1 * block.nbytes:
            return affine
    return block


def apply(x: torch.Tensor, state: State, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).to(state.dtype)
    out = torch.empty(rows.shape[0], state.out_features, dtype=state.dtype)
    for start, block in zip(state.starts, state.blocks):
        w = block.dequantize(state.dtype)
        out[:, start:start + w.shape[0]] = cpu_matmul.linear(rows, w)
    return cpu_affine.finish(out, x.shape[:-1], state.out_features, x.dtype, bias)


def reference(x: torch.Tensor, weight: QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What apply() computes, from the whole weight dequantized at once (float32)."""
    return torch.nn.functional.linear(x.float(), weight.dequantize(), None if bias is None else bias.float())


def path(state: State, m: int) -> tuple[str, str]:
    """(NAME, why) at any M."""
    return NAME, f"kept as stored; {len(state.blocks)} row blocks dequantized per call, then torch's matmul"

