"""Reading LoRA adapters: a peft directory (adapter_config.json + adapter_model.safetensors / .bin) or a GGUF
LoRA file (gguf_adapter.py), as float32 A/B pairs under quanta's HF module names.

    adapter = load_adapter("my-lora/", config)       # config: the base model's, to check the adapter fits it
    w = adapter.weights["model.layers.3.self_attn.q_proj"]
    delta = w.scaling * w.b @ w.a                    # [out, in], added to the base weight

peft's scaling is lora_alpha / r (alpha / sqrt(r) with use_rslora), r and alpha per module from rank_pattern /
alpha_pattern, matched as peft matches them. What quanta cannot apply exactly (DoRA, other LoRA variants,
modules_to_save, embedding or lm_head LoRA, trained biases, modules outside the seven decoder projections)
is refused with an UnsupportedError naming the file and the feature, before any tensor is read.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quanta.loaders.checkpoint import ModelConfig
from quanta.quant.errors import ConfigError, CorruptFileError, ShapeError, UnsupportedError

MODULE = re.compile(r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")
TARGETS = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
# peft options whose adapters compute something other than W + scaling * B @ A, by what they are.
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)", "use_qalora": "QALoRA (use_qalora)", "lora_bias": "a bias on lora_B (lora_bias)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)", "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing", "kasa_config": "KaSA", "monteclora_config": "MonteCLoRA",
    "layer_replication": "layer replication", "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
}
# A peft tensor name: [base_model.model.]MODULE.lora_{A,B}[.ADAPTER].{weight,bias}
PEFT_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+?)\.lora_(?P<ab>[AB])(?:\.(?P<name>[^.]+))?"
                      r"\.(?P<kind>weight|bias)")
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class LoRAWeights:
    """One module's adapter: delta W = scaling * b @ a."""
    a: torch.Tensor        # [rank, in_features] float32
    b: torch.Tensor        # [out_features, rank] float32
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class Adapter:
    """A LoRA adapter read from `path`: its A/B pairs by HF module name ("model.layers.3.mlp.down_proj")."""
    path: Path
    rank: int                           # the largest rank over its modules
    weights: dict[str, LoRAWeights]

    def nbytes(self) -> int:
        """Bytes of every A and B tensor."""
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def load_adapter(path: str | Path, config: ModelConfig | None = None) -> Adapter:
    """The adapter at `path`: a peft adapter directory or a GGUF LoRA file (told apart by the GGUF magic,
    not the name). With `config` (the base model's), every module must exist in that architecture with
    A [rank, in] and B [out, rank] fitting it. A GGUF adapter of llama / mistral needs `config` (or head
    counts in its metadata) to undo the converter's q/k row permutation. ConfigError / CorruptFileError /
    ShapeError / UnsupportedError naming the file and the problem."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such LoRA adapter (a peft adapter directory or a GGUF LoRA file)")
    if path.is_dir():
        weights = read_peft(path)
    elif _is_gguf(path):
        weights = _read_gguf(path, config)
    else:
        raise ConfigError(f"{path}: not a LoRA adapter: expected a peft adapter directory (adapter_config.json "
                          "and adapter_model.safetensors) or a GGUF LoRA file")
    if not weights:
        raise CorruptFileError(f"{path}: the adapter holds no LoRA weights")
    if config is not None:
        check_fits(path, weights, config)
    return Adapter(path, max(w.rank for w in weights.values()), weights)


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the adapter ({e.strerror or e})") from e


def module_name(path: Path, name: str, module: str) -> str:
    """`module` as quanta's HF module name; UnsupportedError for modules LoRA cannot target here."""
    if module.startswith("layers."):            # adapters trained on the bare decoder (LlamaModel)
        module = "model." + module
    if MODULE.fullmatch(module):
        return module
    if module.endswith(("embed_tokens", "lm_head")):
        raise UnsupportedError(f"{path}: tensor {name!r}: LoRA on the embedding or the lm_head is not supported "
                               f"(supported target modules: {TARGETS})")
    raise UnsupportedError(f"{path}: tensor {name!r}: target module {module!r} is not one quanta supports "
                           f"(supported: {TARGETS} of the decoder layers)")


def check_fits(path: Path, weights: dict[str, LoRAWeights], config: ModelConfig) -> None:
    """ConfigError / ShapeError unless every module is a layer of `config`'s model with matching in/out."""
    from quanta.loaders.hf import canonical_shapes
    layer0 = canonical_shapes(dataclasses.replace(config, num_hidden_layers=1))
    for module, w in weights.items():
        m = MODULE.fullmatch(module)
        assert m is not None, module                   # the readers map every name through module_name
        if int(m[1]) >= config.num_hidden_layers:
            raise ConfigError(f"{path}: the adapter targets {module}, but the {config.model_type} base model has "
                              f"{config.num_hidden_layers} layers")
        out, inp = layer0[f"model.layers.0.{m[2]}.weight"]
        if tuple(w.a.shape) != (w.rank, inp) or tuple(w.b.shape) != (out, w.rank):
            raise ShapeError(f"{path}: {module}: A {list(w.a.shape)} and B {list(w.b.shape)} do not fit the base "
                             f"weight [{out}, {inp}] (expected A [rank, {inp}], B [{out}, rank])")


def pair(path: Path, module: str, a: torch.Tensor | None, b: torch.Tensor | None, scaling) -> LoRAWeights:
    """A checked LoRAWeights of float32 `a` [r, in] and `b` [out, r]; `scaling(r)` gives its scaling."""
    if a is None or b is None:
        raise CorruptFileError(f"{path}: {module} has lora_{'B' if a is None else 'A'} but not "
                               f"lora_{'A' if a is None else 'B'}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0:
        raise ShapeError(f"{path}: {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not "
                         "[rank, in] and [out, rank] of one rank")
    return LoRAWeights(a.float().contiguous(), b.float().contiguous(), float(scaling(a.shape[0])))


def _read_gguf(path: Path, config: ModelConfig | None) -> dict[str, LoRAWeights]:
    from quanta.lora.gguf_adapter import open_gguf_adapter
    lora = open_gguf_adapter(path, config)
    for module, ab in lora.pairs.items():
        module_name(path, next(iter(ab.values())).name, module)
    return {module: pair(path, module, *lora.read(module), lora.scaling) for module in lora.pairs}


# --- peft ---------------------------------------------------------------------------------------------
def read_peft(path: Path) -> dict[str, LoRAWeights]:
    """The A/B pairs of peft adapter directory `path` (see the module docstring)."""
    cfg = _peft_config(path)
    file = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if file is None:
        raise ConfigError(f"{path}: no adapter weights: neither {' nor '.join(WEIGHT_FILES)} is in the directory")
    tensors = _open_weights(file)
    parts: dict[str, dict[str, str]] = {}
    names = set()
    keys = list(tensors.keys())
    foreign = [key for key in keys if PEFT_KEY.fullmatch(key) is None]
    if foreign:
        raise UnsupportedError(f"{file}: {len(foreign)} tensors are not LoRA A/B weights, e.g. {foreign[0]!r}"
                               + _why_not_lora(foreign, cfg))
    for key in keys:
        m = PEFT_KEY.fullmatch(key)
        if m["kind"] == "bias":
            raise UnsupportedError(f"{file}: tensor {key!r}: a bias on lora_{m['ab']} is not supported")
        names.add(m["name"])
        parts.setdefault(module_name(file, key, m["module"]), {})[m["ab"]] = key
    if len(names) > 1:
        raise UnsupportedError(f"{file}: holds several adapters ({', '.join(sorted(map(str, names)))}); "
                               "save one adapter per directory")
    out = {}
    for module, ab in parts.items():
        a, b = (tensors.get(ab[k]) if k in ab else None for k in "AB")
        out[module] = pair(file, module, a, b, lambda r, module=module: _peft_scaling(file, cfg, module, r))
    return out


def _peft_config(path: Path) -> dict[str, Any]:
    file = path / "adapter_config.json"
    if not file.is_file():
        raise ConfigError(f"{path}: not a peft adapter directory (no adapter_config.json)")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise CorruptFileError(f"{file}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UnsupportedError(f"{file}: peft_type {cfg['peft_type']!r} is not supported (only LORA)")
    for key, what in UNSUPPORTED_OPTIONS.items():
        if cfg.get(key):
            raise UnsupportedError(f"{file}: {what} is not supported; merge the adapter with peft "
                                   "(merge_and_unload) and load the merged model instead")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not _is_int(r) or r <= 0:
        raise ConfigError(f"{file}: r must be a positive integer, got {r!r}")
    if not _is_real(alpha):
        raise ConfigError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    for key, check in (("rank_pattern", lambda v: _is_int(v) and v > 0), ("alpha_pattern", _is_real)):
        pattern = cfg.get(key) or {}
        if not isinstance(pattern, dict) or not all(isinstance(k, str) and check(v) for k, v in pattern.items()):
            raise ConfigError(f"{file}: {key} must map module patterns to numbers, got {str(pattern)[:80]}")
        cfg[key] = pattern
    if cfg.get("bias", "none") not in ("none", "all", "lora_only"):
        raise ConfigError(f"{file}: bias must be none, all or lora_only, got {cfg['bias']!r}")
    return cfg


def _why_not_lora(keys: list[str], cfg: dict[str, Any]) -> str:
    """Why an adapter holds tensors other than LoRA pairs, as far as its names and config tell."""
    if any(".lora_embedding_" in k or k.endswith(("embed_tokens.base_layer.weight", "lm_head.base_layer.weight"))
           for k in keys):        # peft saves the base weights of the embedding and lm_head it adapts
        return ": LoRA on the embedding or the lm_head is not supported"
    if any(".lora_magnitude_vector" in k for k in keys):
        return ": DoRA magnitudes are not supported"
    if cfg.get("modules_to_save"):
        return f": modules_to_save ({', '.join(map(str, cfg['modules_to_save']))}) are not supported"
    if any(k.endswith(".bias") for k in keys) and cfg.get("bias", "none") != "none":
        return f": trained biases (bias={cfg['bias']!r}) are not supported; retrain with bias='none'"
    return ""


def _pattern_value(pattern: dict[str, Any], module: str, default):
    """peft's get_pattern_key: the first pattern that matches the end of the module name at a dot."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _peft_scaling(file: Path, cfg: dict[str, Any], module: str, rank: int) -> float:
    r = _pattern_value(cfg["rank_pattern"], module, cfg["r"])
    if r != rank:
        raise ShapeError(f"{file}: {module} has rank {rank}, adapter_config.json gives it r={r}")
    alpha = _pattern_value(cfg["alpha_pattern"], module, cfg["lora_alpha"])
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _open_weights(file: Path):
    """A mapping name -> tensor over `file` (safetensors: read on access; .bin: loaded whole, weights only)."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:   # safetensors raises its own error types for a damaged header
            raise CorruptFileError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from e
        return _Safetensors(handle)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:   # a damaged or non-weights pickle: torch raises many kinds
        raise CorruptFileError(f"{file}: not a readable weights-only torch file ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CorruptFileError(f"{file}: expected a dict of tensors")
    return state


class _Safetensors:
    def __init__(self, handle):
        self.handle = handle

    def keys(self):
        return self.handle.keys()

    def get(self, key: str) -> torch.Tensor:
        return self.handle.get_tensor(key)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
