"""bitsandbytes checkpoints as transformers saves them, the inverse of bnb.read_bnb (layout in bnb.py's docstring).

4-bit (Codebook NF4/FP4): weight uint8 [ceil(N*K/2), 1] (row-major codes, element 2i in the high nibble),
weight.absmax (float32, or uint8 codes with double quant), weight.quant_map float32 [16],
weight.nested_absmax / weight.nested_quant_map (double quant), and weight.quant_state.bitsandbytes__<type>:
the UTF-8 bytes of QuantState.as_dict(packed=True)'s JSON. 8-bit (Affine LLM.int8 form): weight int8 [N, K],
SCB float32 [N], weight_format uint8 0 ("row"). The config is BitsAndBytesConfig.to_dict's.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders.checkpoint_write import DEFAULT_SHARD_SIZE, Layout, Tensor, write_checkpoint
from quanta.quant.errors import UnsupportedError
from quanta.quant.kinds import FP4_TABLE, NF4_TABLE, Affine, Codebook
from quanta.quant.qtensor import QTensor

TABLES = {"nf4": NF4_TABLE, "fp4": FP4_TABLE}
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)      # bitsandbytes quantize_4bit's accepted sizes
INT8_POST_SCALE = 7.874015718698502e-3                       # bnb's float32 1/127, as bnb.read_int8 sets it


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class BnbLayout(Layout):
    """Codebook NF4/FP4 -> Linear4bit tensors; Affine in LLM.int8 form -> Linear8bitLt tensors."""

    fmt = "bitsandbytes"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.mode: tuple | None = None          # (quant_type, double_quant, dtype) or ("int8",), one per checkpoint
        self.first = ""

    def _same_mode(self, name: str, mode: tuple) -> None:
        if self.mode is None:
            self.mode, self.first = mode, name
        elif mode != self.mode:
            raise UnsupportedError(f"{name} is {mode} but {self.first} is {self.mode}: a bitsandbytes config "
                                   "declares one quant type, double-quant setting and compute dtype")

    def convert_quantized(self, name: str, qt: QTensor) -> dict[str, torch.Tensor]:
        if isinstance(qt, Codebook):
            return self._four_bit(name, qt)
        if isinstance(qt, Affine) and qt.bits == 8 and qt.post_scale == INT8_POST_SCALE and qt.num_groups == 1 \
                and qt.g_idx is None and not isinstance(qt.zeros, torch.Tensor) and qt.zeros == 128:
            self._same_mode(name, ("int8",))
            return {name: (qt.codes.to(torch.int16) - 128).to(torch.int8),
                    name.removesuffix(".weight") + ".SCB": qt.scales.float().reshape(-1),
                    name.removesuffix(".weight") + ".weight_format": torch.tensor(0, dtype=torch.uint8)}
        raise UnsupportedError(f"{name}: bitsandbytes stores NF4/FP4 codebooks or LLM.int8 row-scaled int8 "
                               f"(codes - 128) * SCB / 127, not {qt.describe()}")

    def _four_bit(self, name: str, c: Codebook) -> dict[str, torch.Tensor]:
        if c.quant_type not in TABLES or not torch.equal(c.table.float(), torch.tensor(TABLES[c.quant_type])):
            raise UnsupportedError(f"{name}: {c.describe()}: bitsandbytes dequantizes with its own nf4/fp4 table; "
                                   "a custom table cannot be stored")
        if c.blocksize not in BLOCKSIZES:
            raise UnsupportedError(f"{name}: blocksize {c.blocksize} is not one bitsandbytes uses {BLOCKSIZES}")
        if c.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise UnsupportedError(f"{name}: compute dtype {c.dtype} is not float16/bfloat16/float32")
        self._same_mode(name, (c.quant_type, c.double_quant, dtype_name(c.dtype)))
        codes = c.codes.reshape(-1)
        if codes.numel() % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        packed = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).reshape(-1, 1)
        state: dict[str, Any] = {"quant_type": c.quant_type, "blocksize": c.blocksize, "dtype": dtype_name(c.dtype),
                                 "shape": list(c.shape)}
        out = {name: packed, name + ".absmax": c.absmax if c.double_quant else c.absmax.float(),
               name + ".quant_map": c.table.float()}
        if c.double_quant:
            state |= {"nested_blocksize": c.nested_blocksize, "nested_dtype": "float32",
                      "nested_offset": float(c.nested_offset)}
            out |= {name + ".nested_absmax": c.nested_absmax.float(), name + ".nested_quant_map": c.nested_table.float()}
        blob = json.dumps(state).encode("utf-8")
        out[f"{name}.quant_state.bitsandbytes__{c.quant_type}"] = torch.tensor(list(blob), dtype=torch.uint8)
        return out

    def quantization_config(self) -> dict[str, Any]:
        if self.mode is None:
            raise UnsupportedError("no quantized weight came: a bitsandbytes checkpoint needs at least one "
                                   "Codebook or LLM.int8 layer")
        four = self.mode[0] != "int8"
        quant_type, double_quant, dtype = self.mode if four else ("fp4", False, "float32")
        return {"_load_in_4bit": four, "_load_in_8bit": not four, "bnb_4bit_compute_dtype": dtype,
                "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": quant_type,
                "bnb_4bit_use_double_quant": double_quant, "llm_int8_enable_fp32_cpu_offload": False,
                "llm_int8_has_fp16_weight": False,
                "llm_int8_skip_modules": ["lm_head", *self.plain_linears] if self.plain_linears else None,
                "llm_int8_threshold": 6.0, "load_in_4bit": four, "load_in_8bit": not four,
                "quant_method": "bitsandbytes"}


def write_bnb(dst: str | Path, ckpt: Checkpoint, tensors: Iterable[tuple[str, Tensor]] | None = None, *,
              overwrite: bool = False, max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write a transformers + bitsandbytes checkpoint (4-bit NF4/FP4 ± double quant, or 8-bit LLM.int8).

    Quantized linear weights: Codebook with bitsandbytes' own nf4/fp4 table (one quant type, double-quant
    setting and dtype for all), or Affine in the LLM.int8 form bnb.read_int8 builds. Anything else is
    UnsupportedError before the rename. Peak memory: one shard plus one layer's tensors.
    """
    return write_checkpoint(dst, ckpt, tensors, BnbLayout(ckpt.config), overwrite=overwrite, max_shard_size=max_shard_size)
