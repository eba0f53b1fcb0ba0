"""Per-tensor conversion: each source tensor becomes what the target format stores, exactly where the
format can hold it, re-quantized otherwise, with a TensorRecord saying which.

Exactness is decided by the target's own writer layout (a throwaway `Layout` converts the weight and
refuses what it cannot store), so the rules here never drift from the writers. The layer-wide choices a
format's config declares once (group size, bit width, bitsandbytes mode) are fixed by the first quantized
weight; a later weight that is exact but disagrees is re-quantized in the fixed scheme.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from quanta.loaders.checkpoint import Checkpoint
from quanta.loaders.formats import layout as layout_of, resolve
from quanta.quant.codebook_quant import quantize_4bit
from quanta.quant.errors import UnsupportedError
from quanta.quant.fp8_quant import fp8_weight
from quanta.quant.kinds import Affine
from quanta.quant.kinds.gguf import Gguf
from quanta.quant.qtensor import QTensor
from quanta.quant.rtn import rtn_affine
from quanta.toolkit.convert.defaults import DEFAULT_GROUP
from quanta.toolkit.convert.report import TensorRecord, scheme_of
from quanta.toolkit.convert.rows import cast, dequantize, rel_error
from quanta.toolkit.convert.target import Target

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")

Tensor = torch.Tensor | QTensor


def is_linear(name: str) -> bool:
    """A decoder linear weight (what every format quantizes)."""
    return bool(LINEAR.fullmatch(name))


def _fp16_scales(a: Affine) -> Affine:
    """`a` with scales rounded to float16 (AWQ and GPTQ store them so): the codes stay, the error counts it."""
    return dataclasses.replace(a, scales=a.scales.half().float())


class TensorConverter:
    """Callable (name, tensor) -> (tensor to write, record), for one conversion of `ckpt` to `target`;
    `writer_options` are what the target's writer (and its layout) is given."""

    def __init__(self, ckpt: Checkpoint, target: Target, group_size: int = DEFAULT_GROUP):
        self.ckpt, self.target, self.default_group = ckpt, target, group_size
        self.dtype = target.dtype or ckpt.config.torch_dtype
        self.group: int | None = None        # the group size fixed for the output (integer formats)
        self.bits: int | None = None         # integer formats: the one bit width
        self.mode: tuple | None = None       # bitsandbytes: (quant_type, double_quant, dtype)
        self.blocksize = 64                  # bitsandbytes: the blocksize of re-quantized weights
        own = target.format.writer_options
        self.writer_options = dict(resolve(own)(ckpt)) if own is not None else {}
        if target.requantize == "float":
            self.writer_options["dtype"] = self.dtype
        self.types = None
        if target.requantize == "gguf" and target.ggml_type:
            from quanta.loaders.gguf.mix import assign
            self.types = assign(target.ggml_type, ckpt.config)

    def __call__(self, name: str, t: Tensor) -> tuple[Tensor, TensorRecord]:
        if self.target.requantize == "gguf":
            return self._gguf(name, t)
        if self.target.requantize == "float" or not is_linear(name):
            return self._plain(name, t)
        if isinstance(t, QTensor) and self._exact(name, t):
            return t, TensorRecord(name, scheme_of(t), scheme_of(t), "lossless", True, 0.0)
        w = dequantize(t) if isinstance(t, QTensor) else t       # the quantizers take any float dtype
        q, method = self._quantize(name, w)
        action = "requantized" if isinstance(t, QTensor) else "quantized"
        return q, TensorRecord(name, scheme_of(t), scheme_of(q), action, False, rel_error(q, w), method)

    # --- float tensors and HF output ---------------------------------------------------------------
    def _plain(self, name: str, t: Tensor) -> tuple[torch.Tensor, TensorRecord]:
        """A float tensor in the output dtype (hf: always; others: when --dtype is given or it was quantized)."""
        if isinstance(t, QTensor):
            out, same, error = cast(t, self.dtype)
            return out, TensorRecord(name, scheme_of(t), scheme_of(out), "dequantized", same, error)
        if not t.is_floating_point():
            return t, TensorRecord(name, scheme_of(t), scheme_of(t), "copied", True, 0.0)
        dtype = self.dtype if self.target.requantize == "float" or self.target.dtype is not None else t.dtype
        if t.dtype == dtype:
            return t, TensorRecord(name, scheme_of(t), scheme_of(t), "copied", True, 0.0)
        out, same, error = cast(t, dtype)
        return out, TensorRecord(name, scheme_of(t), scheme_of(out), "cast", same, error)

    # --- exactness through the writer's layout -----------------------------------------------------
    def _exact(self, name: str, qt: QTensor) -> bool:
        """Whether the target writer stores `qt` as it is, in a scheme compatible with the ones fixed so far."""
        layout = layout_of(self.target.format.name, self.ckpt.config, **self.writer_options)
        try:
            layout.convert_quantized(name, qt)
        except UnsupportedError:
            return False
        kind = self.target.requantize
        if kind.startswith("int") and isinstance(qt.to_affine(), Affine):
            a = qt.to_affine()
            group = a.shape[1] if a.num_groups == 1 else a.group_size
            if not self._fits_group(group, a.num_groups, a.shape[1]) or self.bits not in (None, a.bits):
                return False
            self.bits = a.bits
            if a.num_groups > 1:
                self.group = group
        if kind == "nf4":
            if self.mode is None:
                self.mode, self.blocksize = layout.mode, qt.blocksize
            elif (layout.mode, qt.blocksize) != (self.mode, self.blocksize):
                return False
        return kind != "fp8" or qt.kind == "fp8"

    def _fits_group(self, group: int, num_groups: int, k: int) -> bool:
        if self.group is None:
            return True
        return group == self.group if num_groups > 1 else k <= self.group

    # --- re-quantization without calibration ---------------------------------------------------------
    def _quantize(self, name: str, w: torch.Tensor) -> tuple[QTensor, str]:
        kind = self.target.requantize
        if kind == "fp8":
            return fp8_weight(w, "channel", name=name), "fp8 per-channel"
        if kind == "nf4":
            quant_type, double_quant, dtype = self.mode or ("nf4", False, _dtype_name(self.dtype))
            q = quantize_4bit(w.to(getattr(torch, dtype)), quant_type, self.blocksize, double_quant, name=name)
            self.mode = (quant_type, double_quant, dtype)
            return q, f"bitsandbytes {quant_type}"
        k = w.shape[1]
        group = self.group or self.default_group
        if k % group:
            if k >= group:
                raise UnsupportedError(f"{name}: K={k} is not a multiple of the output's group size {group}; "
                                       "pass another group size")
            group = -1                                  # one group per row, which fits any group size >= K
        bits = self.bits or 4
        symmetric = kind == "int-sym"
        a = rtn_affine(w, bits, group, symmetric, name=name)
        if a.num_groups > 1:
            self.group = group
        self.bits = bits
        if self.target.half_scales:
            a = _fp16_scales(a)
        return a, f"rtn int{bits} {'sym' if symmetric else 'asym'}"

    # --- GGUF ---------------------------------------------------------------------------------------
    def _gguf(self, name: str, t: Tensor) -> tuple[Tensor, TensorRecord]:
        """What write_gguf stores for `t`, decided here so the record says it (write_gguf keeps a Gguf
        weight of the asked type as it is)."""
        from quanta.loaders.gguf.writer import gguf_name
        from quanta.quant.ggml.quantize import affine_to_gguf, quantize

        want = self.types.of_tensor(gguf_name(name)) if self.types is not None else None
        if isinstance(t, torch.Tensor) and t.dim() == 1:      # norms and biases: F32 in every GGUF file
            return t, TensorRecord(name, scheme_of(t), "gguf f32", "copied" if t.dtype == torch.float32 else "cast",
                                   True, 0.0)
        src = t
        if isinstance(t, QTensor) and t.kind == "affine":
            t = affine_to_gguf(t.to_affine()) or t
        if isinstance(t, Gguf) and want in (None, t.type.name):
            return t, TensorRecord(name, scheme_of(src), scheme_of(t), "lossless", True, 0.0)
        float_type = want if want in ("f16", "f32", "bf16") else "f16" if want is None else None
        if float_type is not None:
            dtype = {"f16": torch.float16, "f32": torch.float32, "bf16": torch.bfloat16}[float_type]
            out, same, error = cast(t, dtype)
            action = "dequantized" if isinstance(src, QTensor) else ("copied" if src.dtype == dtype else "cast")
            return out, TensorRecord(name, scheme_of(src), f"gguf {float_type}", action, same, error)
        w = dequantize(t) if isinstance(t, QTensor) else t        # quantize takes any float dtype
        q = quantize(w, want, None, what=f"{name} ({gguf_name(name)})")
        action = "requantized" if isinstance(src, QTensor) else "quantized"
        return q, TensorRecord(name, scheme_of(src), scheme_of(q), action, False, rel_error(q, w), f"gguf {want}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

