"""Plain (fp32 / fp16 / bf16) Hugging Face checkpoints: config.json -> ModelConfig, safetensors -> tensors.

`model_config_from_hf` and `canonical_shapes` are shared by every HF-style loader (AWQ, GPTQ, bnb, FP8):
they normalize the config and say which tensors a llama-family model has, under which names and shapes.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from quanta.loaders.checkpoint import SUPPORTED_ARCHITECTURES, Checkpoint, ModelConfig
from quanta.loaders.config_fields import get_dict, get_int, get_number, get_str, get_str_list
from quanta.loaders.detection import detect_dir
from quanta.loaders.safetensors_io import TensorStore, open_weights, read_config
from quanta.loaders.weight_format import WeightFormat, dense_format
from quanta.quant.errors import ConfigError, CorruptFileError, QuantaError, ShapeError, UnsupportedError

FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)       # buffers some old checkpoints saved


def _rope(cfg: dict[str, Any], source: Path) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers-5 `rope_parameters` or v4 `rope_theta` + `rope_scaling`."""
    params = get_dict(cfg, "rope_parameters", source, None)
    if params is None:
        params = dict(get_dict(cfg, "rope_scaling", source, {}))
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if "type" in scaling:                                   # transformers < 4.45 spelling
        scaling.setdefault("rope_type", scaling.pop("type"))
    theta = get_number(params, "rope_theta", source, get_number(cfg, "rope_theta", source, 10000.0))
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return theta, scaling


def _sliding_window(cfg: dict[str, Any], model_type: str, source: Path) -> int | None:
    """The one sliding window all layers use, or None; mixed full/sliding layers are unsupported."""
    window = get_int(cfg, "sliding_window", source, None)
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return None
        kinds = set(get_str_list(cfg, "layer_types", source))
        if not kinds:        # layers from max_window_layers on slide: told apart without listing the layers
            first, layers = get_int(cfg, "max_window_layers", source, 28), cfg["num_hidden_layers"]
            kinds = {"full_attention"} if first >= layers else {"sliding_attention"} if first <= 0 else \
                {"full_attention", "sliding_attention"}
        if kinds == {"full_attention"}:
            return None
        if kinds != {"sliding_attention"}:
            raise UnsupportedError(f"{source}: layer_types mixes sliding and full attention ({sorted(kinds)}); "
                                   "only one window for all layers is supported")
    return window


def _dtype(cfg: dict[str, Any], source: Path) -> torch.dtype:
    name = cfg.get("dtype", cfg.get("torch_dtype")) or "float32"
    name = str(name).removeprefix("torch.")
    if name not in FLOAT_DTYPES:
        raise ConfigError(f"{source}: dtype {name!r} is not a float dtype quanta loads "
                          "(float32, float16, bfloat16)")
    return FLOAT_DTYPES[name]


def model_config_from_hf(cfg: dict[str, Any], path: str | Path) -> ModelConfig:
    """Normalize a transformers config.json dict (v4 or v5 layout) into a ModelConfig.

    `path` is the config file (or its directory) named in errors. UnsupportedError for architectures
    outside SUPPORTED_ARCHITECTURES or features the llama-family model lacks; ConfigError for missing fields.
    """
    source = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    archs = get_str_list(cfg, "architectures", source)
    arch = archs[0] if archs else {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}.get(
        get_str(cfg, "model_type", source, None))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedError(f"{source}: architecture {arch or cfg.get('model_type')!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    model_type = SUPPORTED_ARCHITECTURES[arch]
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        get_int(cfg, name, source)
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("mlp_bias"):
        raise UnsupportedError(f"{source}: mlp_bias=true is not supported")
    if model_type != "qwen2" and cfg.get("attention_bias"):
        raise UnsupportedError(f"{source}: attention_bias=true ({arch} then has an o_proj bias) is not supported")
    theta, scaling = _rope(cfg, source)
    kwargs = dict(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim"),
        rms_norm_eps=get_number(cfg, "rms_norm_eps", source, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        sliding_window=_sliding_window(cfg, model_type, source),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        torch_dtype=_dtype(cfg, source),
    )
    if cfg.get("max_position_embeddings") is not None:
        kwargs["max_position_embeddings"] = get_int(cfg, "max_position_embeddings", source)
    try:
        return ModelConfig(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e


MIN_LAYER_TENSORS = 9    # q, k, v, o, gate, up, down and two norms


def check_layer_count(config: ModelConfig, stored: int, source: Path) -> None:
    """CorruptFileError when `stored` tensors cannot hold config.num_hidden_layers layers: refused by
    arithmetic before canonical_shapes lists every layer (a damaged layer count may be 2**40)."""
    if config.num_hidden_layers * MIN_LAYER_TENSORS > stored:
        raise CorruptFileError(f"{source}: the config says {config.num_hidden_layers} layers, but the weights hold "
                               f"only {stored} tensors (each layer has at least {MIN_LAYER_TENSORS})")


def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a llama-family model under its canonical HF name, with its full-precision shape."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


class TensorView(Mapping[str, torch.Tensor]):
    """A lazy Mapping over the chosen names of a TensorStore (reads each tensor on access)."""

    def __init__(self, store: TensorStore, names: list[str]):
        self.store, self.names, self._chosen = store, names, frozenset(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._chosen:
            raise KeyError(name)
        return self.store[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def load_tokenizer(path: str | Path):
    """The tokenizer saved in directory `path`, via `AutoTokenizer.from_pretrained` with local files only.

    QuantaError naming the directory when no tokenizer files are there or transformers cannot read them.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        present = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        raise QuantaError(f"{path}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}; "
                          f"the directory holds {present})")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
        raise QuantaError(f"{path}: transformers cannot load the tokenizer: {e}") from e


def _check_tensors(store: TensorStore, config: ModelConfig, path: Path) -> list[str]:
    """Names of the canonical tensors, after checking presence, shape and float dtype of each."""
    check_layer_count(config, len(store), path)
    expected = canonical_shapes(config)
    for name in store:
        if name in expected or name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue                                          # a stored copy of the tied embedding
        raise UnsupportedError(f"{store.info(name).file}: unexpected tensor {name!r} for a "
                               f"{config.model_type} model")
    for name, shape in expected.items():
        if name not in store:
            raise CorruptFileError(f"{path}: tensor {name!r} is missing from the weights "
                                   f"({', '.join(p.name for p in store.files)})")
        info = store.info(name)
        if info.shape != shape:
            raise ShapeError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, config.json "
                             f"implies {list(shape)}")
        if info.dtype not in FLOAT_DTYPES:
            raise UnsupportedError(f"{info.file}: tensor {name!r} is {info.dtype}; a plain HF checkpoint "
                                   "holds float tensors (quantized checkpoints need quantization_config)")
    return list(expected)


def load_hf(path: str | Path, *, allow_pickle: bool = False, tokenizer: bool | None = None) -> Checkpoint:
    """Load a plain fp32/fp16/bf16 HF checkpoint directory; tensors keep their stored dtype, read lazily.

    tokenizer: None loads it if tokenizer files are present, True requires it, False skips it.
    A checkpoint with quantization metadata is refused with UnsupportedError pointing to its loader.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: an HF checkpoint is a directory holding config.json")
    cfg = read_config(path)
    family = detect_dir(path, cfg)
    if family != "hf":
        raise UnsupportedError(f"{path}: quant_method {family}: use the {family} loader "
                               "(quanta.loaders.load picks it)")
    config = model_config_from_hf(cfg, path)
    store = open_weights(path, allow_pickle=allow_pickle)
    names = _check_tensors(store, config, path)
    config.torch_dtype = FLOAT_DTYPES[store.info("model.embed_tokens.weight").dtype]   # stored dtype wins
    tok = None
    if tokenizer or (tokenizer is None and any((path / f).is_file() for f in TOKENIZER_FILES)):
        tok = load_tokenizer(path)
    return Checkpoint(path=path, format="hf", config=config, tensors=TensorView(store, names), tokenizer=tok,
                      chat_template=getattr(tok, "chat_template", None))


def weight_format(config: ModelConfig, qc: dict[str, Any], path: Path | None) -> WeightFormat:
    """What a plain checkpoint's linear weights are, for the memory plan: its float dtype."""
    return dense_format({torch.float32: "fp32", torch.bfloat16: "bf16"}.get(config.torch_dtype, "fp16"))
