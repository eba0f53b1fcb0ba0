"""FP8 checkpoints outside compressed-tensors -> Fp8: fbgemm_fp8, NVIDIA modelopt, and vLLM/DeepSeek "fp8".

- fbgemm_fp8 (transformers integrations/fbgemm_fp8.py): weight float8_e4m3fn [N, K], weight_scale [N, 1];
  activations dynamic per row (activation_scale_ub); `modules_to_not_convert`.
- modelopt (hf_quant_config.json `quantization.quant_algo` FP8, or config.json quant_method "modelopt"):
  per-tensor weight_scale and input_scale (FP8_PER_CHANNEL_PER_TOKEN: weight_scale [N]); KV-cache scales
  `k_proj.k_scale` / `v_proj.v_scale`; `exclude_modules`.
- "fp8" (vLLM Fp8Config): weight_scale per tensor, or `weight_scale_inv` with `weight_block_size`.
compressed-tensors FP8 is read by compressed_tensors.py.
"""
from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

from quanta.loaders.checkpoint import Checkpoint
from quanta.loaders.config_fields import get_block, get_str_list
from quanta.loaders.quantized import build_checkpoint, kv_scale_names, need, quant_config
from quanta.loaders.safetensors_io import TensorStore, read_config
from quanta.loaders.weight_format import WeightFormat
from quanta.quant.errors import ShapeError, UnsupportedError
from quanta.quant.kinds import Fp8

METHODS = ("fbgemm_fp8", "modelopt", "fp8")


def fp8_settings(path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Normalize the FP8 quantization config: method, skipped module patterns, block size, activation scheme."""
    qc = quant_config(path, cfg)
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise UnsupportedError(f"{path}: quant_method {method!r} is not an FP8 format ({', '.join(METHODS)})")
    algo = str(qc.get("quant_algo", "FP8")).upper()
    if method == "modelopt" and algo not in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        raise UnsupportedError(f"{path}: modelopt quant_algo {algo!r} is not supported")
    skip = next((names for key in ("modules_to_not_convert", "exclude_modules", "ignored_layers", "ignore")
                 if (names := get_str_list(qc, key, path))), [])
    return {"quant_method": method, "skip": skip, "block": get_block(qc, "weight_block_size", path, None),
            "activation_scheme": qc.get("activation_scheme", "static" if algo == "FP8" else "dynamic"),
            "raw": qc}


def read_fp8(store: TensorStore, prefix: str, shape: tuple[int, int], s: dict[str, Any]) -> Fp8 | None:
    """The Fp8 weight of linear `prefix`, or None when it is skipped / stored in a float dtype."""
    if any(fnmatch.fnmatch(prefix, p) or prefix.endswith(p) or ("." + p + ".") in prefix + "." for p in s["skip"]):
        return None
    if prefix + ".weight" not in store or store.info(prefix + ".weight").dtype not in ("F8_E4M3", "F8_E5M2"):
        return None
    n, _ = shape
    data = store[prefix + ".weight"]
    if s["block"] is not None:
        scale = need(store, prefix + ".weight_scale_inv", "block weight_scale_inv")
        return Fp8(data=data, scale=scale, block_size=s["block"], shape=shape)
    scale = need(store, prefix + ".weight_scale", "FP8 weight_scale")
    if scale.numel() not in (1, n):
        raise ShapeError(f"{store.path}: {prefix}.weight_scale has shape {list(scale.shape)}, expected [] or [{n}, 1]")
    scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(n)
    input_scale = store[prefix + ".input_scale"] if prefix + ".input_scale" in store else None
    return Fp8(data=data, scale=scale, input_scale=input_scale, shape=shape)


def load_fp8(path: str | Path, *, tokenizer: bool | None = None) -> Checkpoint:
    """Load an fbgemm_fp8, modelopt or vLLM-"fp8" checkpoint directory."""
    path = Path(path)
    cfg = read_config(path)
    s = fp8_settings(path, cfg)
    return build_checkpoint(path, "fp8", lambda st, p, sh: read_fp8(st, p, sh, s), s["raw"], cfg=cfg,
                            tokenizer=tokenizer, kv_scales=kv_scale_names)


def check_method(qc: dict[str, Any], source: Path) -> None:
    """UnsupportedError for a modelopt config whose quant_algo is not FP8 (detection asks before loading)."""
    algo = qc.get("quant_algo")
    if str(qc.get("quant_method", "")).lower() == "modelopt" and algo is not None and "FP8" not in str(algo).upper():
        raise UnsupportedError(f"{source}: modelopt quant_algo {algo!r} is not supported (only FP8)")


def weight_format(config, qc: dict[str, Any], path: Path) -> WeightFormat:
    """What an FP8 checkpoint's linear weights are, for the memory plan: one byte a weight."""
    return WeightFormat("fp8", "fp8")
