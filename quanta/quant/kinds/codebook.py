"""Codebook kind: bitsandbytes NF4 / FP4, with optional double-quantized absmax.

    W_flat[j] = table[codes_flat[j]] * absmax[j // blocksize]      W = W_flat.reshape(N, K)

Blocks run over the row-major flattened weight, as bitsandbytes stores them. With double
quantization the absmax itself is stored as 8-bit codes:
    absmax[b] = nested_table[absmax_codes[b]] * nested_absmax[b // nested_blocksize] + nested_offset
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.quant.errors import ShapeError
from quanta.quant.qtensor import QTensor, same

# bitsandbytes functional.get_4bit_type: the NF4 and FP4 tables, index 0..15.
NF4_TABLE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)
FP4_TABLE = tuple(v / 12 for v in (0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3))


@dataclass(eq=False, repr=False)
class Codebook(QTensor, kind="codebook", shape_of="codes"):
    codes: torch.Tensor                         # uint8 [N, K], values 0..15
    table: torch.Tensor                         # float32 [16]
    blocksize: int
    absmax: torch.Tensor                        # float32 [num_blocks], or uint8 codes with double quant
    shape: tuple[int, int] = None
    quant_type: str = "nf4"                     # "nf4" | "fp4" | "custom" | "iq4_nl" (Gguf.to_codebook)
    nested_table: torch.Tensor | None = None    # float32 [256]
    nested_absmax: torch.Tensor | None = None   # float32 [ceil(num_blocks / nested_blocksize)]
    nested_blocksize: int = 256
    nested_offset: float = 0.0
    dtype: torch.dtype = torch.float16          # the dtype bitsandbytes dequantizes to

    @property
    def double_quant(self) -> bool:
        return self.nested_table is not None

    @property
    def num_blocks(self) -> int:
        return -(-self.numel // self.blocksize)

    def _validate(self) -> None:
        name = f"codebook {self.quant_type}"
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != self.shape:
            raise ShapeError(f"{name}: codes must be uint8 {list(self.shape)}, got {self.codes.dtype} {list(self.codes.shape)}")
        if self.table.numel() != 16:
            raise ShapeError(f"{name}: table must have 16 entries, got {self.table.numel()}")
        if self.absmax.numel() != self.num_blocks:
            raise ShapeError(f"{name}: absmax has {self.absmax.numel()} entries, "
                             f"expected {self.num_blocks} blocks of {self.blocksize}")
        if self.double_quant:
            if self.absmax.dtype != torch.uint8:
                raise ShapeError(f"{name}: double-quantized absmax must be uint8 codes, got {self.absmax.dtype}")
            if self.nested_absmax is None or self.nested_absmax.numel() != -(-self.num_blocks // self.nested_blocksize):
                raise ShapeError(f"{name}: nested_absmax does not cover {self.num_blocks} absmax values "
                                 f"in blocks of {self.nested_blocksize}")
        elif not self.absmax.is_floating_point():
            raise ShapeError(f"{name}: absmax must be float without double quantization, got {self.absmax.dtype}")

    def block_absmax(self) -> torch.Tensor:
        """The float32 absmax of every block (undoing double quantization when present)."""
        if not self.double_quant:
            return self.absmax.float()
        nested = self.nested_absmax.float().repeat_interleave(self.nested_blocksize)[: self.num_blocks]
        return self.nested_table.float()[self.absmax.long()] * nested + self.nested_offset

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        flat = self.table.float()[self.codes.reshape(-1).long()]
        scale = self.block_absmax().repeat_interleave(self.blocksize)[: flat.numel()]
        return (flat * scale).reshape(self.shape).to(dtype)

    def _cat_rows(self, others: list[QTensor]) -> Codebook | None:
        parts = [self, *others]
        if not same(parts, lambda p: (p.blocksize, p.quant_type, p.dtype, p.double_quant, p.nested_blocksize,
                                      p.nested_offset)) or not same(parts, lambda p: p.table):
            return None
        if any(p.numel % p.blocksize for p in parts[:-1]):
            return None                       # a block would straddle two weights
        if self.double_quant and (not same(parts, lambda p: p.nested_table)
                                  or any(p.num_blocks % p.nested_blocksize for p in parts[:-1])):
            return None
        return self._stacked(parts, ("codes", "absmax", "nested_absmax"))

    @property
    def nbytes(self) -> int:
        total = self.numel // 2 + self.absmax.numel() * self.absmax.element_size() + 64
        if self.double_quant:
            total += self.nested_absmax.numel() * 4 + 1024
        return total

    def describe(self) -> str:
        dq = " dq" if self.double_quant else ""
        return f"codebook {self.quant_type} b{self.blocksize}{dq}"
