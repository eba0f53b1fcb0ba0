"""FP8 kind: compressed-tensors FP8, fbgemm_fp8, modelopt, DeepSeek-style block FP8.

    W[n, k] = float(data[n, k]) * scale            scale: [] per tensor, [N] per channel,
                                                   or [ceil(N/bn), ceil(K/bk)] per (bn x bk) block
Data is held as torch.float8_e4m3fn or torch.float8_e5m2; kernels that cannot use the hardware
type (below sm89) reinterpret the same bytes as uint8 and convert with bit operations.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.quant.errors import ShapeError
from quanta.quant.qtensor import QTensor, same

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass(eq=False, repr=False)
class Fp8(QTensor, kind="fp8", shape_of="data"):
    data: torch.Tensor                          # float8_e4m3fn | float8_e5m2 [N, K]
    scale: torch.Tensor                         # float32 [], [N] or [N/bn, K/bk]
    block_size: tuple[int, int] | None = None   # (bn, bk) for block scales
    input_scale: torch.Tensor | None = None     # static activation scale (W8A8), None = dynamic
    shape: tuple[int, int] = None

    @property
    def fmt(self) -> str:
        return {v: k for k, v in FP8_DTYPES.items()}[self.data.dtype]

    @property
    def strategy(self) -> str:
        if self.block_size is not None:
            return "block"
        return "tensor" if self.scale.numel() == 1 else "channel"

    def _validate(self) -> None:
        n, k = self.shape
        if self.data.dtype not in FP8_DTYPES.values() or tuple(self.data.shape) != (n, k):
            raise ShapeError(f"fp8: data must be float8 {[n, k]}, got {self.data.dtype} {list(self.data.shape)}")
        if self.block_size is not None:
            bn, bk = self.block_size
            want = (-(-n // bn), -(-k // bk))
            if tuple(self.scale.shape) != want:
                raise ShapeError(f"fp8: block scale must be {list(want)} for blocks {bn}x{bk}, got {list(self.scale.shape)}")
        elif self.scale.numel() not in (1, n):
            raise ShapeError(f"fp8: scale must have 1 (tensor) or {n} (channel) entries, got {list(self.scale.shape)}")

    def expanded_scale(self) -> torch.Tensor:
        """The scale broadcast to [N, K] (or a broadcastable [N, 1] / [] view)."""
        n, k = self.shape
        s = self.scale.float()
        if self.block_size is not None:
            bn, bk = self.block_size
            return s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return s.reshape(()) if s.numel() == 1 else s.reshape(n, 1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.expanded_scale()).to(dtype)

    def _cat_rows(self, others: list[QTensor]) -> Fp8 | None:
        parts = [self, *others]
        if not same(parts, lambda p: (p.data.dtype, p.block_size)) or not same(parts, lambda p: p.input_scale):
            return None
        if self.block_size is not None:
            if any(p.shape[0] % self.block_size[0] for p in parts[:-1]):
                return None                   # a block would straddle two weights
            return self._stacked(parts, ("data", "scale"))
        if all(p.strategy == "tensor" for p in parts) and same(parts, lambda p: p.scale.reshape(())):
            return self._stacked(parts, ("data",))
        # per-tensor scales of different weights become per-channel
        scale = torch.cat([p.scale.float().reshape(-1).expand(p.shape[0]) for p in parts])
        return self._stacked(parts, ("data",), scale=scale)

    def describe(self) -> str:
        blk = f" {self.block_size[0]}x{self.block_size[1]}" if self.block_size else ""
        act = " static-act" if self.input_scale is not None else ""
        return f"fp8 {self.fmt} {self.strategy}{blk}{act}"
