"""`resolve_config`: the ModelConfig of a known shape name (loaders/shapes.py), a config.json, an HF checkpoint
directory, a GGUF file or a synthetic spec, read from metadata alone (no tensor is loaded), with where its
weights come from (a formats.Source)."""
from __future__ import annotations

from pathlib import Path

from quanta.loaders.checkpoint import ModelConfig
from quanta.loaders.detection import detect, detect_dir, gguf_files_in, is_gguf_file
from quanta.loaders.formats import Source
from quanta.loaders.gguf.reader import read_header
from quanta.loaders.hf import model_config_from_hf
from quanta.loaders.quantized import quant_config
from quanta.loaders.safetensors_io import read_config
from quanta.loaders.shapes import known_config
from quanta.loaders.synthetic import is_synthetic, model_config, parse


def resolve_config(model: str | Path | ModelConfig) -> ModelConfig:
    """The ModelConfig of `model`: a ModelConfig (returned as is), a known shape name, a config.json file,
    an HF-style checkpoint directory (its config.json), a GGUF file or directory (its header) or a
    synthetic model spec."""
    return resolve(model)[0]


def resolve(model: str | Path | ModelConfig) -> tuple[ModelConfig, Source]:
    """(ModelConfig, where its weights come from) for `model` (see resolve_config), from metadata alone.

    The Source is the checkpoint's family (detect()'s name), its quantization config and path; a shape name
    or a ModelConfig comes as plain "hf" weights in its own dtype.
    """
    if isinstance(model, ModelConfig):
        return model, Source()
    if is_synthetic(str(model)):
        shape, fmt, _ = parse(str(model))
        return model_config(shape, fmt), Source("synthetic", {"synthetic": fmt})
    path = Path(model)
    if not path.exists():
        return known_config(str(model)), Source()
    if path.is_file() and not is_gguf_file(path):
        directory = path.parent                        # a bare config.json
    elif detect(path) == "gguf":
        path = path if path.is_file() else gguf_files_in(path)[0]
        return read_header(path)[0], Source("gguf", {}, path)
    else:
        directory = path
    cfg = read_config(path)
    family = detect_dir(directory, cfg)
    qc = {} if family == "hf" else quant_config(directory, cfg)
    return model_config_from_hf(cfg, path), Source(family, qc, directory)
