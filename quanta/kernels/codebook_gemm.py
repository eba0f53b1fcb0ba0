"""Codebook (bitsandbytes NF4 / FP4, GGUF IQ4_NL / IQ4_XS) weights times fp16/bf16 activations: the affine kernels with a
table.

`prepare()` packs the codes as the affine kernels do and they run in MODE=LUT (prepare says how); `apply` takes
its path by M from the affine plan (affine/plan.py).
"""
from __future__ import annotations

import torch

from quanta.kernels.affine import plan
from quanta.kernels.affine.layout import LUT, SUPER_SCALED, AffineState, R, pack, super_scale_words
from quanta.kernels.dequantized import reference  # noqa: F401  (the oracle)
from quanta.kernels.device_caps import device_caps
from quanta.kernels.lora_epilogue import LoRAEpilogue
from quanta.kernels.triton_support import why_not_device
from quanta.quant.errors import UnsupportedError
from quanta.quant.kinds.codebook import Codebook
from quanta.quant.kinds.gguf import CODEBOOK_TYPES, Gguf

NAME = "triton_codebook"


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    if isinstance(weight, Gguf):
        if weight.type.name not in CODEBOOK_TYPES:
            return f"gguf {weight.type.name}: no codebook form (IQ4_NL and IQ4_XS have one)"
        if dtype != torch.float16:
            return f"{weight.type.name}'s scales are fp16 values, held exactly for fp16 activations only"
        return why_not_device(device, dtype)
    if not isinstance(weight, Codebook):
        return "not a codebook weight"
    k = weight.shape[1]
    if k % weight.blocksize:
        return f"blocks of {weight.blocksize} straddle rows of {k} (K not a multiple of the blocksize)"
    if weight.blocksize % R:
        return f"blocksize {weight.blocksize} is not a multiple of {R}"
    return why_not_device(device, dtype)


def prepare(weight: Codebook | Gguf, device: torch.device, dtype: torch.dtype) -> AffineState:
    """The weight in the affine kernels' layout, run as a table (MODE=LUT); GGUF IQ4_NL / IQ4_XS by their exact
    codebook form (_prepare_iq4, the file's bytes).

    When blocks run along rows (K a multiple of the blocksize, as in every bnb Linear), the flattened blocks
    are groups of K: W[n, k] = table[code] * absmax[n, k // blocksize]. The codes are packed exactly as the
    affine kernels pack theirs (affine.layout.pack), absmax (double quantization undone once, in the compute
    dtype) is stored as the group scales, and the kernels run in MODE=LUT: on CUDA the GEMV (fp16), the MMA kernel
    and the dequantize kernel look 4-bit codes up by byte permutes in registers; the split-K tl.dot kernel and the
    fp32 GEMV loop gather the 16-entry table per code (served from L1) in place of the magic-number conversion."""
    w = weight.to(device)
    if isinstance(w, Gguf):
        return _prepare_iq4(w, dtype)
    n, k = w.shape
    absmax = w.block_absmax().reshape(n, k // w.blocksize)
    group = w.blocksize if absmax.shape[1] > 1 else None
    return pack(w.codes, 4, group, absmax, dtype, mode=LUT, lut=w.table)


def _prepare_iq4(w: Gguf, dtype: torch.dtype) -> AffineState:
    """IQ4_NL / IQ4_XS in the table kernels' layout by their codebook form (Gguf.to_codebook): IQ4_NL's fp16 block
    scales as the group scales; IQ4_XS's super-block d and 6-bit ls as they are (layout.super_scale_words: the
    file's bytes), the kernels forming d * (ls - 32) per group (SUPER_SCALED)."""
    cb = w.to_codebook()
    if cb is None:
        raise UnsupportedError(f"gguf {w.type.name} {list(w.shape)}: a block scale times 128 leaves fp16's range")
    if w.type.name == "iq4_nl":
        return pack(cb.codes, 4, 32, cb.absmax.view(w.shape[0], -1), dtype, mode=LUT, lut=cb.table)
    return pack(cb.codes, 4, 32, None, dtype, zero=SUPER_SCALED, mode=LUT, lut=cb.table,
                scale_words=super_scale_words(*w.iq4_xs_scales()))


def apply(x: torch.Tensor, state: AffineState, bias: torch.Tensor | None = None,
          lora: LoRAEpilogue | None = None) -> torch.Tensor:
    """y = x @ W.T + bias by the affine plan's path for M: the GEMV at M = 1 (M <= 2 off sm90 where the
    byte-permute lookup runs, fp16), on sm90 the MMA kernel up to M = 512, from M = 1 for bf16 where the GEMV
    would gather, else dequantize + cuBLAS, where the split-K kernel's gathers would make the fused GEMM slower
    than a separate decode. `lora`: adapter products the GEMV's epilogue adds (lora_fuses)."""
    return plan.matmul(x, state, bias, lora=lora)


def lora_fuses(state: AffineState, m: int) -> bool:
    """Whether m rows run on the GEMV, whose epilogue adds LoRA products (plan.lora_fuses)."""
    return plan.lora_fuses(state, m)


def path(state: AffineState, m: int) -> tuple[str, str]:
    """(NAME/the affine path that runs an M-row input on the state's device, why)."""
    name, reason = plan.explain(state, device_caps(state.packed.device), m)
    return f"{NAME}/{name}", reason
