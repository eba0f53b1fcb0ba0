"""Which checkpoint family a path holds, read from its metadata (never from file names).

- `synthetic:...` (loaders/synthetic.py)                       -> "synthetic"
- a file that starts with the GGUF magic                       -> "gguf"
- a directory with config.json: `quantization_config.quant_method` picks the family, else the first
  quantization sidecar present (QUANT_SIDECARS, the order every loader reads them in), else "hf"
- a directory without config.json holding exactly one GGUF file -> "gguf"
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from quanta.loaders.formats import of_quant_config
from quanta.loaders.gguf.file import GGUF_MAGIC
from quanta.loaders.safetensors_io import read_config, read_json
from quanta.quant.errors import ConfigError, UnsupportedError

SYNTHETIC_PREFIX = "synthetic:"      # models made in memory, no files (loaders/synthetic.py)
# Quantization sidecar files written beside config.json by tools that predate `quantization_config`
# (AutoGPTQ, AutoAWQ, modelopt), in the order detection and the loaders search them.
QUANT_SIDECARS = ("quantize_config.json", "quant_config.json", "hf_quant_config.json")


def is_gguf_file(path: Path) -> bool:
    """True if `path` is a file whose first four bytes are the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False


def quant_family(qc: dict[str, Any], source: Path) -> str:
    """The loader family of a quantization config dict (`quantization_config` or a sidecar file): its
    quant_method, else its keys, as the format table (formats.FORMATS) recognizes them."""
    return of_quant_config(qc, source).name


def detect_dir(path: Path, config: dict[str, Any] | None = None) -> str:
    """Family of checkpoint directory `path` holding config.json ("hf" or a quantized family).

    `config` may be passed when the caller has already read config.json.
    """
    config = read_config(path) if config is None else config
    qc = config.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise ConfigError(f"{path / 'config.json'}: quantization_config must be an object, got {qc!r}")
        return quant_family(qc, path / "config.json")
    found = read_sidecar(path)
    return "hf" if found is None else quant_family(*found)


def read_sidecar(path: Path) -> tuple[dict[str, Any], Path] | None:
    """The first quantization sidecar in directory `path` as a quantization config, with its file; or None.

    modelopt's hf_quant_config.json nests its settings under "quantization"; they are returned lifted
    out, with quant_method "modelopt", so every sidecar reads like a `quantization_config`.
    """
    for name in QUANT_SIDECARS:
        if (path / name).is_file():
            qc = read_json(path / name, name)
            if name == "hf_quant_config.json":
                qc = {"quant_method": "modelopt", **(qc.get("quantization") or {})}
            return qc, path / name
    return None


def detect(path: str | Path) -> str:
    """The checkpoint family at `path` (a formats.FORMATS name: "gguf", "hf", "awq", "gptq", "bnb", "fp8",
    "compressed-tensors", ...); "synthetic" for a `synthetic:...` spec.

    UnsupportedError naming the path when nothing recognizable is there.
    """
    if str(path).startswith(SYNTHETIC_PREFIX):
        return "synthetic"
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such file or directory")
    if path.is_file():
        if is_gguf_file(path):
            return "gguf"
        raise UnsupportedError(f"{path}: not a GGUF file (no GGUF magic) and not a checkpoint directory")
    if (path / "config.json").is_file():
        return detect_dir(path)
    ggufs = gguf_files_in(path)
    if len(ggufs) == 1:
        return "gguf"
    if len(ggufs) > 1:
        raise UnsupportedError(f"{path}: holds {len(ggufs)} GGUF files ({', '.join(p.name for p in ggufs)}); "
                               "pass the one to load")
    raise UnsupportedError(f"{path}: no config.json and no GGUF file: not a checkpoint quanta can read")


def gguf_files_in(path: Path) -> list[Path]:
    """The .gguf files in directory `path` that really start with the GGUF magic, sorted."""
    return [p for p in sorted(path.iterdir()) if p.suffix == ".gguf" and is_gguf_file(p)]
