"""Affine integer kind: AWQ, GPTQ (v1/v2, act-order), RTN, HQQ, GGUF Q4_0..Q8_0, bnb LLM.int8.

    W[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g]     integer zeros (or one int for all)
    W[n, k] = codes[n, k] * scales[n, g] + mins[n, g]        float mins (GGUF Q4_1 / Q5_1 style)
    W[n, k] = ((codes[n, k] - zeros) * scales[n, g]) * post_scale   with a post_scale (bnb LLM.int8:
              scales = SCB, post_scale = 1/127, reproducing bitsandbytes' two float32 roundings)
    g = k // group_size, or g_idx[k] when g_idx is given (GPTQ act-order)

Codes are unsigned, one per uint8, in [0, 2**bits). Symmetric formats store their implicit zero
(8 for 4-bit, 128 for 8-bit) as the int `zeros`. Kernels repack this plain layout in `prepare()`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.quant.errors import ShapeError
from quanta.quant.qtensor import AffineScheme, QTensor, same


@dataclass(eq=False, repr=False)
class Affine(QTensor, kind="affine", shape_of="codes"):
    codes: torch.Tensor                       # uint8 [N, K]
    scales: torch.Tensor                      # float [N, G]
    bits: int
    group_size: int                           # = K for one group per row (per-channel)
    zeros: torch.Tensor | int | None = None   # integer [N, G], or one int for every group
    mins: torch.Tensor | None = None          # float [N, G]; exclusive with zeros
    g_idx: torch.Tensor | None = None         # int [K], group of each input column
    post_scale: float | None = None           # one constant multiplier applied last
    shape: tuple[int, int] = None             # (N, K); defaults to codes.shape

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    def _validate(self) -> None:
        n, k = self.shape
        name = f"affine int{self.bits}"
        if not 2 <= self.bits <= 8:
            raise ShapeError(f"{name}: bits must be 2..8")
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (n, k):
            raise ShapeError(f"{name}: codes must be uint8 {[n, k]}, got {self.codes.dtype} {list(self.codes.shape)}")
        if not self.scales.is_floating_point() or self.scales.dim() != 2 or self.scales.shape[0] != n:
            raise ShapeError(f"{name}: scales must be float [{n}, G], got {self.scales.dtype} {list(self.scales.shape)}")
        if self.g_idx is None:
            if self.group_size <= 0 or self.scales.shape[1] != -(-k // self.group_size):
                raise ShapeError(f"{name}: {self.scales.shape[1]} scale groups do not cover K={k} "
                                 f"with group_size={self.group_size}")
        elif tuple(self.g_idx.shape) != (k,) or self.g_idx.is_floating_point():
            raise ShapeError(f"{name}: g_idx must be int [{k}], got {self.g_idx.dtype} {list(self.g_idx.shape)}")
        if (self.zeros is None) == (self.mins is None):
            raise ShapeError(f"{name}: exactly one of zeros (integer) and mins (float) must be given")
        if isinstance(self.zeros, torch.Tensor):
            if self.zeros.is_floating_point() or self.zeros.shape != self.scales.shape:
                raise ShapeError(f"{name}: zeros must be integer {list(self.scales.shape)}, "
                                 f"got {self.zeros.dtype} {list(self.zeros.shape)}")
        if self.mins is not None and (not self.mins.is_floating_point() or self.mins.shape != self.scales.shape):
            raise ShapeError(f"{name}: mins must be float {list(self.scales.shape)}, got {list(self.mins.shape)}")

    def group_index(self) -> torch.Tensor:
        """The group of every input column k, as a long tensor [K]."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.shape[1], device=self.codes.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        if self.g_idx is None and self.num_groups * self.group_size == k:
            return self._dequantize_groups(dtype)
        g = self.group_index()
        scales = self.scales.float()[:, g]
        q = self.codes.float()
        if self.mins is not None:
            w = q * scales + self.mins.float()[:, g]
        elif isinstance(self.zeros, torch.Tensor):
            w = (q - self.zeros.float()[:, g]) * scales
        else:
            w = (q - float(self.zeros)) * scales
        if self.post_scale is not None:
            w = w * torch.tensor(self.post_scale, dtype=torch.float32)
        return w.to(dtype)

    def _dequantize_groups(self, dtype: torch.dtype) -> torch.Tensor:
        """The same values for whole consecutive groups, by broadcasting [N, G, 1] over [N, G, group]
        instead of gathering every column's group parameters."""
        n, k = self.shape
        shape = (n, self.num_groups, self.group_size)
        q = self.codes.view(shape).float()
        scales = self.scales.float().unsqueeze(-1)
        if self.mins is not None:
            w = q * scales + self.mins.float().unsqueeze(-1)
        elif isinstance(self.zeros, torch.Tensor):
            w = (q - self.zeros.float().unsqueeze(-1)) * scales
        else:
            w = (q - float(self.zeros)) * scales
        if self.post_scale is not None:
            w = w * torch.tensor(self.post_scale, dtype=torch.float32)
        return w.reshape(n, k).to(dtype)

    def _cat_rows(self, others: list[QTensor]) -> Affine | None:
        parts = [self, *others]
        if not same(parts, lambda p: (p.bits, p.group_size, p.num_groups, p.post_scale, p.mins is None,
                                      isinstance(p.zeros, torch.Tensor), p.g_idx is None)):
            return None
        if not isinstance(self.zeros, torch.Tensor) and not same(parts, lambda p: p.zeros):
            return None
        if self.g_idx is not None and not same(parts, lambda p: p.g_idx):
            return None                       # act-order permutations differ: no shared column order
        per_group_zeros = ("zeros",) if isinstance(self.zeros, torch.Tensor) else ()
        return self._stacked(parts, ("codes", "scales", "mins", *per_group_zeros))

    def effective_scales(self) -> torch.Tensor:
        """float32 scales [N, G] with post_scale folded in (what a kernel multiplies by)."""
        scales = self.scales.float()
        return scales if self.post_scale is None else scales * self.post_scale

    def to_affine(self) -> Affine:
        return self

    def affine_scheme(self) -> AffineScheme:
        zero = "float" if self.mins is not None else ("int" if isinstance(self.zeros, torch.Tensor) else "sym")
        return AffineScheme(self.bits, self.group_size, self.num_groups, self.g_idx is not None, zero)

    @property
    def nbytes(self) -> int:
        """Packed size: codes at `bits` each, plus scales, zeros at `bits` or mins, plus g_idx."""
        total = self.numel * self.bits // 8 + self.scales.numel() * self.scales.element_size()
        if isinstance(self.zeros, torch.Tensor):
            total += self.zeros.numel() * self.bits // 8
        if self.mins is not None:
            total += self.mins.numel() * self.mins.element_size()
        if self.g_idx is not None:
            total += self.g_idx.numel() * 4
        return total

    @property
    def symmetric(self) -> bool:
        return self.mins is None and not isinstance(self.zeros, torch.Tensor)

    def describe(self) -> str:
        group = "channel" if self.num_groups == 1 else f"g{self.group_size}"
        zero = "sym" if self.symmetric else ("fmin" if self.mins is not None else "asym")
        order = " act-order" if self.g_idx is not None else ""
        return f"affine int{self.bits} {group} {zero}{order}"
