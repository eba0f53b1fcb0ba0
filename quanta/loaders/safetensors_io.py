"""Reading a Hugging Face checkpoint directory: config.json and lazily opened weight files.

Every HF-style loader (plain, AWQ, GPTQ, bnb, FP8) builds on this module:

    config = read_config(path)                      # dict, typed errors naming config.json
    with open_weights(path) as store:               # Mapping name -> torch.Tensor, read on access
        store.info("model.embed_tokens.weight")     # dtype/shape/file from the header, no read
        store["model.norm.weight"]                  # one tensor read from its shard

Safetensors headers are parsed and checked against the file size by us before the file is handed to
`safetensors.safe_open`, so a truncated or garbled file fails at open time with the file named.
Pickle checkpoints (`.bin`, `.pt`) are refused unless the caller passes `allow_pickle=True`.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from quanta.quant.errors import ConfigError, CorruptFileError, UnsupportedError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "model.pt", "consolidated.pt")
PICKLE_INDEX = "pytorch_model.bin.index.json"

MAX_HEADER_BYTES = 100 * 1024 * 1024          # the limit safetensors itself enforces

# Bits per element of each safetensors dtype string (the `Dtype` enum of safetensors' Rust core).
DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8,
              "U64": 64, "U32": 32, "U16": 16, "U8": 8, "BOOL": 8, "C64": 64,
              "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4}


def read_json(path: Path, what: str = "file") -> dict[str, Any]:
    """Parse a JSON object file; CorruptFileError naming the file if it is not valid JSON / not an object."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{path}: cannot read {what}: {e}") from e
    return parse_json(text, path)


def parse_json(text: str | bytes, source: Path | str) -> dict[str, Any]:
    """A JSON object from `text`; CorruptFileError naming `source` for invalid JSON, numbers Python
    refuses to convert (over 4300 digits), nesting deeper than the parser's recursion, or a non-object."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorruptFileError(f"{source}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from e
    except (ValueError, RecursionError) as e:
        raise CorruptFileError(f"{source}: not valid JSON as Python reads it "
                               f"({type(e).__name__}: {str(e)[:100]})") from e
    if not isinstance(data, dict):
        raise CorruptFileError(f"{source}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config(path: str | Path) -> dict[str, Any]:
    """The config.json of checkpoint directory `path` (or the file itself) as a dict.

    ConfigError if the file is missing, CorruptFileError if it is not a JSON object.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    return read_json(path, "config.json")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What a weight file's header says about one tensor, without reading its data."""

    name: str
    dtype: str                  # safetensors dtype string ("BF16", "F8_E4M3", ...) or torch name for pickles
    shape: tuple[int, ...]
    file: Path


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a .safetensors header: (tensor infos by name, `__metadata__`).

    Checks what a truncated or garbled file breaks: header length against the file size, the JSON,
    each entry's types, its byte range against its dtype and shape, and that the ranges tile the data
    section exactly (no gap, overlap or trailing byte), as safetensors itself requires.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CorruptFileError(f"{path}: {size} bytes is too short for a safetensors header")
            (n,) = struct.unpack("<Q", prefix)
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise CorruptFileError(f"{path}: header length {n} exceeds the file size {size} "
                                       "(truncated or not a safetensors file)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CorruptFileError(f"{path}: weight file not found") from None
    except OSError as e:
        raise CorruptFileError(f"{path}: cannot read: {e}") from e
    try:
        header = parse_json(raw.decode("utf-8"), f"{path}: safetensors header")
    except UnicodeDecodeError as e:
        raise CorruptFileError(f"{path}: safetensors header is not UTF-8: {e}") from e
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptFileError(f"{path}: safetensors __metadata__ must map strings to strings, got {metadata!r:.100}")
    infos, ranges = {}, []
    for name, entry in header.items():
        dtype, shape, (begin, stop) = _header_entry(entry, f"{path}: tensor {name!r}")
        if dtype not in DTYPE_BITS:
            raise UnsupportedError(f"{path}: tensor {name!r} has dtype {dtype!r}, which safetensors does not define")
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or stop - begin != bits // 8:
            raise CorruptFileError(f"{path}: tensor {name!r}: {dtype}{list(shape)} needs {bits / 8:g} bytes, "
                                   f"header gives {stop - begin}")
        infos[name] = TensorInfo(name, dtype, shape, path)
        ranges.append((begin, stop, name))
    # As safetensors requires: the tensors tile the data section, in some order, without gaps or overlaps.
    data_size, end = size - 8 - n, 0
    for begin, stop, name in sorted(ranges):
        if begin != end:
            raise CorruptFileError(f"{path}: tensor {name!r} starts at data byte {begin}, expected {end} "
                                   "(tensors overlap or leave a gap)")
        end = stop
    if end != data_size:
        raise CorruptFileError(f"{path}: data section is {data_size} bytes but tensors cover {end} "
                               "(file truncated, trailing bytes or a bad header)")
    return infos, metadata


def _header_entry(entry: Any, what: str) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, data_offsets) of one header entry, each of the JSON type safetensors requires."""
    def is_size(x: Any) -> bool:
        return type(x) is int and 0 <= x < 2**64
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CorruptFileError(f"{what}: header entry must hold dtype, shape and data_offsets, got {entry!r:.100}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise CorruptFileError(f"{what}: dtype must be a string, got {dtype!r:.60}")
    if not isinstance(shape, list) or not all(map(is_size, shape)):
        raise CorruptFileError(f"{what}: shape must be a list of sizes, got {shape!r:.60}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_size, offsets)) \
            or offsets[0] > offsets[1]:
        raise CorruptFileError(f"{what}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r:.60}")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def read_index(index_path: Path, what: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(weight_map, metadata) of a sharded checkpoint's index file, checked: tensor name -> shard file
    name, each a plain relative path that stays inside the index's directory (never absolute, never ..)."""
    index = read_json(index_path, what)
    weight_map, metadata = index.get("weight_map") or {}, index.get("metadata") or {}
    if not isinstance(weight_map, dict) or not isinstance(metadata, dict):
        raise CorruptFileError(f"{index_path}: 'weight_map' and 'metadata' must be JSON objects")
    for name, shard in weight_map.items():
        parts = Path(shard).parts if isinstance(shard, str) else ()
        if not parts or Path(shard).is_absolute() or ".." in parts:
            raise CorruptFileError(f"{index_path}: tensor {name!r} is mapped to {shard!r}, which is not a file name "
                                   "inside the checkpoint directory")
    return weight_map, metadata


class TensorStore(Mapping[str, torch.Tensor]):
    """A lazy, read-only Mapping from tensor name to torch.Tensor over one checkpoint's weight files.

    Subclasses fill `self._infos` (name -> TensorInfo) and implement `_read(info)`. Usable as a context
    manager; `close()` releases open files.
    """

    path: Path
    metadata: dict[str, Any]
    _infos: dict[str, TensorInfo]

    def info(self, name: str) -> TensorInfo:
        """Header facts about tensor `name` (dtype, shape, file) without reading it."""
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._read(self.info(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    @property
    def files(self) -> list[Path]:
        """The weight files this store reads, in order of first appearance."""
        return list(dict.fromkeys(i.file for i in self._infos.values()))

    def _read(self, info: TensorInfo) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """Release open file handles (the store may be reopened by reading again)."""

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SafetensorsDir(TensorStore):
    """`model.safetensors`, a sharded `model.safetensors.index.json` + shards, or one .safetensors file.

    Headers of every file are read and validated at construction (cheap: a few KB each); tensor data is
    read through `safetensors.safe_open` only when a tensor is accessed.
    """

    def __init__(self, path: str | Path):
        self.path = path = Path(path)
        self._handles: dict[Path, Any] = {}
        self._infos = {}
        if path.is_file():
            self._infos, self.metadata = read_safetensors_header(path)
        elif (path / SAFETENSORS_INDEX).is_file():
            self._open_index(path / SAFETENSORS_INDEX)
        elif (path / SAFETENSORS_FILE).is_file():
            self._infos, self.metadata = read_safetensors_header(path / SAFETENSORS_FILE)
        else:
            raise ConfigError(f"{path}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}")

    def _open_index(self, index_path: Path) -> None:
        weight_map, self.metadata = read_index(index_path, "safetensors index")
        if not weight_map:
            raise CorruptFileError(f"{index_path}: missing or empty 'weight_map'")
        shards: dict[str, dict[str, TensorInfo]] = {}
        for name, shard in weight_map.items():
            if shard not in shards:
                shard_path = index_path.parent / shard
                if not shard_path.is_file():
                    raise CorruptFileError(f"{index_path}: shard {shard!r} (holding tensor {name!r}) "
                                           f"is missing from {index_path.parent}")
                shards[shard], shard_meta = read_safetensors_header(shard_path)
                self.metadata.update(shard_meta)
            if name not in shards[shard]:
                raise CorruptFileError(f"{index_path}: tensor {name!r} is mapped to shard {shard!r} "
                                       "but that file does not hold it")
            self._infos[name] = shards[shard][name]

    def _handle(self, info: TensorInfo):
        if (handle := self._handles.get(info.file)) is None:
            try:
                handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CorruptFileError(f"{info.file}: cannot open: {e}") from e
        return handle

    def _read(self, info: TensorInfo) -> torch.Tensor:
        try:
            return self._handle(info).get_tensor(info.name)
        except (SafetensorError, OSError) as e:
            raise CorruptFileError(f"{info.file}: cannot read tensor {info.name!r}: {e}") from e
        except TypeError as e:       # a dtype this torch build does not have
            raise UnsupportedError(f"{info.file}: tensor {info.name!r} of dtype {info.dtype}: {e}") from e

    def get_slice(self, name: str):
        """A safetensors slice of tensor `name` (index it, e.g. `[rows]`, to read only that part)."""
        info = self.info(name)
        return self._handle(info).get_slice(name)

    def close(self) -> None:
        """Drop the open safe_open handles (their memory maps are released by the GC)."""
        self._handles.clear()


class PickleDir(TensorStore):
    """A `pytorch_model.bin` (optionally sharded) or `.pt` checkpoint, read with `weights_only=True`.

    Pickle files cannot be read lazily by header, so each file is loaded (memory-mapped) when first needed.
    """

    def __init__(self, path: str | Path):
        self.path = path = Path(path)
        self.metadata = {}
        self._loaded: dict[Path, dict[str, torch.Tensor]] = {}
        if path.is_file():
            files = [path]
        elif (path / PICKLE_INDEX).is_file():
            weight_map, self.metadata = read_index(path / PICKLE_INDEX, "pickle index")
            files = [path / f for f in dict.fromkeys(weight_map.values())]
        else:
            files = [path / f for f in PICKLE_FILES if (path / f).is_file()][:1]
            if not files:
                raise ConfigError(f"{path}: no pickle checkpoint ({', '.join(PICKLE_FILES)})")
        self._infos = {}
        for file in files:
            for name, t in self._load(file).items():
                self._infos[name] = TensorInfo(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), file)

    def _load(self, file: Path) -> dict[str, torch.Tensor]:
        if file not in self._loaded:
            if not file.is_file():
                raise CorruptFileError(f"{file}: pickle shard is missing")
            try:
                sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:   # torch raises many types for a bad pickle; all mean "unreadable"
                raise CorruptFileError(f"{file}: cannot load with torch.load(weights_only=True): {e}") from e
            if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
                sd = sd["state_dict"]
            if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
                raise CorruptFileError(f"{file}: expected a dict of tensors")
            self._loaded[file] = sd
        return self._loaded[file]

    def _read(self, info: TensorInfo) -> torch.Tensor:
        return self._load(info.file)[info.name]

    def close(self) -> None:
        """Drop the loaded state dicts."""
        self._loaded.clear()


def find_pickle_weights(path: Path) -> list[Path]:
    """Pickle weight files in directory `path` (or `path` itself if it is a .bin/.pt file)."""
    if path.is_file():
        return [path] if path.suffix in (".bin", ".pt", ".pth") else []
    return sorted(p for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth") and p.is_file())


def open_weights(path: str | Path, *, allow_pickle: bool = False) -> TensorStore:
    """Open the weights of a checkpoint directory (or a single weight file) as a lazy TensorStore.

    Safetensors is preferred. Pickle files are refused with UnsupportedError naming them unless
    `allow_pickle=True`, which loads them with `torch.load(weights_only=True)`.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such file or directory")
    if (path.is_file() and path.suffix == ".safetensors") or (path.is_dir() and (
            (path / SAFETENSORS_INDEX).is_file() or (path / SAFETENSORS_FILE).is_file())):
        return SafetensorsDir(path)
    singles = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if len(singles) == 1:
        return SafetensorsDir(singles[0])
    if singles:
        raise CorruptFileError(f"{path}: {len(singles)} .safetensors files but no {SAFETENSORS_INDEX} "
                               "saying which tensor is in which")
    if pickles := find_pickle_weights(path):
        if not allow_pickle:
            raise UnsupportedError(
                f"{path}: weights are pickle files ({', '.join(p.name for p in pickles)}), which can run code "
                "when loaded; convert them to safetensors, or opt in with --allow-pickle (quanta commands), "
                "LLM(..., allow_pickle=True) or quanta.loaders.load(path, allow_pickle=True), which load them "
                "with torch.load(weights_only=True)")
        return PickleDir(path)
    raise ConfigError(f"{path}: no weight files ({SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or pickle)")
