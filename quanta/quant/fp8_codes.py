"""FP8 codes (e4m3 / e5m2 stored as uint8) as the FP8 KV cache and the CPU's kernels hold them: each format's
constants, and the torch conversions between codes and values (the CPU path, and the oracle of the GPU kernels that
write and read them by bits)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    name: str
    code: int                 # the kernels' FP8 constexpr: 0 = no fp8
    mantissa: int
    bias: int
    max: float
    torch_dtype: torch.dtype

    def write_constexprs(self) -> dict:
        """The constants of the fp32 -> fp8 conversion (fp32_to_fp8_bits), as kernel constexprs."""
        sub_unit_exp = 1 - self.bias - self.mantissa           # subnormal step = 2^sub_unit_exp
        magic = 2.0 ** (sub_unit_exp + 23)                     # fp32 whose ulp is that step
        return dict(FP8=self.code, FP8_MAX=self.max, FP8_SHIFT=23 - self.mantissa,
                    FP8_REBIAS=(127 - self.bias) << self.mantissa, FP8_MIN_NORMAL=2.0 ** (1 - self.bias),
                    FP8_MAGIC=magic, FP8_MAGIC_BITS=int(torch.tensor(magic).view(torch.int32)))

    def read_constexprs(self, hardware: bool = False) -> dict:
        """The constants of the fp8 -> fp16 reading: by bits (fp8_bits_to_f16_pattern, then times FP8_UP_MUL),
        or by the sm89+ conversion instruction (FP8_HW; the values come out whole, FP8_UP_MUL = 1)."""
        return dict(FP8=self.code, FP8_HW=hardware, FP8_UP_SHIFT=10 - self.mantissa,
                    FP8_UP_MUL=1.0 if hardware else 2.0 ** (15 - self.bias))


FP8_FORMATS = {
    "fp8_e4m3": Fp8Format("fp8_e4m3", 1, 3, 7, 448.0, torch.float8_e4m3fn),
    "fp8_e5m2": Fp8Format("fp8_e5m2", 2, 2, 15, 57344.0, torch.float8_e5m2),
}


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """x [..., Hk, D] float -> uint8 fp8 codes of x / scale[Hk] (saturating)."""
    y = (x.float() / scale.float()[:, None]).clamp(-fmt.max, fmt.max)
    return y.to(fmt.torch_dtype).view(torch.uint8)


@functools.lru_cache(maxsize=4)
def fp8_values(torch_dtype: torch.dtype) -> torch.Tensor:
    """float32 [256]: the value of each code of an fp8 dtype (a table the CPU's native code reads codes through)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch_dtype).float()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, dtype=torch.float32) -> torch.Tensor:
    """uint8 codes [..., Hk, D] -> codes * scale[Hk] in `dtype`."""
    return (codes.view(fmt.torch_dtype).float() * scale.float()[:, None]).to(dtype)
