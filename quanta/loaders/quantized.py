"""Shared machinery of the quantized HF-style loaders (AWQ, GPTQ, bnb, FP8, compressed-tensors).

Each family module supplies the quantization config and one function `read(store, prefix, shape)` that
turns the tensors stored under a linear layer's prefix into a canonical QTensor; `build_checkpoint` does
the rest: which layers are quantized, shape checks against config.json, plain tensors, tied embeddings,
lazy reading. `unpack_bits` is the one bit unpacker the families share (vectorized, any width 1..8).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders.config_fields import MISSING, get_int
from quanta.loaders.detection import QUANT_SIDECARS, read_sidecar
from quanta.loaders.hf import (FLOAT_DTYPES, TOKENIZER_FILES, canonical_shapes, check_layer_count, load_tokenizer,
                               model_config_from_hf)
from quanta.loaders.safetensors_io import TensorStore, open_weights, read_config
from quanta.quant.chunks import chunk_rows
from quanta.quant.errors import ConfigError, CorruptFileError, ShapeError
from quanta.quant.qtensor import QTensor

# A family's reader: (store, "model.layers.0.self_attn.q_proj", (N, K)) -> QTensor, or None when that
# layer is stored unquantized (plain `.weight`).
Reader = Callable[[TensorStore, str, tuple[int, int]], QTensor | None]


def quant_config(path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's `quantization_config`, else the first sidecar file present (ConfigError if neither)."""
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict):
        return qc
    found = read_sidecar(path)
    if found is None:
        raise ConfigError(f"{path}: no quantization_config in config.json and no {' / '.join(QUANT_SIDECARS)}")
    return found[0]


def need(store: TensorStore, name: str, field: str) -> torch.Tensor:
    """Tensor `name` from the store; CorruptFileError naming the tensor and its role when absent."""
    if name not in store:
        raise CorruptFileError(f"{store.path}: tensor {name!r} ({field}) is missing")
    return store[name]


def group_size(qc: dict[str, Any], keys: tuple[str, ...], source: Path, default: Any = MISSING) -> int:
    """A quantization config's group size: a positive integer, or -1 / 0 for one group per row."""
    group = get_int(qc, keys, source, default)
    if group < -1:
        raise ConfigError(f"{source}: {keys[0]} must be a positive integer or -1 (one group per row), got {group}")
    return group


def group_geometry(group_size: int, k: int) -> tuple[int, int]:
    """(group, groups per row) of a layer with K = `k` inputs; group_size -1 or 0 means one group of K."""
    group = k if group_size in (-1, 0) else group_size
    return group, -(-k // group)


def check_shapes(store: TensorStore, prefix: str, got: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]],
                 layer: str) -> None:
    """ShapeError naming the first of `prefix`'s tensors `got[field]` whose shape is not `want[field]`;
    `layer` says what the shapes were derived from ("an AWQ GEMM layer [N, K] with group_size G")."""
    for field, w in want.items():
        if tuple(got[field].shape) != w:
            raise ShapeError(f"{store.path}: {prefix}.{field} has shape {list(got[field].shape)}, expected {list(w)} "
                             f"for {layer}")


def load_packed(path: str | Path, fmt: str, settings: Callable[[dict[str, Any], Path], dict[str, Any]],
                read: Callable[[TensorStore, str, tuple[int, int], dict[str, Any]], QTensor | None], *,
                tokenizer: bool | None = None) -> Checkpoint:
    """Load a packed-int checkpoint directory (AWQ, GPTQ): its quantization config normalized by
    `settings(qc, source)`, each linear layer read by `read(store, prefix, shape, settings)`."""
    path = Path(path)
    cfg = read_config(path)
    qc = quant_config(path, cfg)
    s = settings(qc, path / "config.json")
    return build_checkpoint(path, fmt, lambda st, p, sh: read(st, p, sh, s), qc | s, cfg=cfg, tokenizer=tokenizer)


def unpack_bits(words: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """Unpack int32 `words` holding a dense little-endian stream of `bits`-bit values along `dim`.

    Value i sits at bit offset i*bits of the concatenated words, as GPTQ (2/3/4/8-bit) and
    compressed-tensors `pack_to_int32` write it; 2/4/8 bits reduce to the plain sequential layout.
    Returns uint8 with `count` values along `dim`, unpacked a few rows at a time (bounded int64 scratch).
    """
    w = words.movedim(dim, -1)
    lead, nwords = w.shape[:-1], w.shape[-1]
    offsets = torch.arange(count, device=w.device) * bits
    idx, shift = offsets // 32, offsets % 32
    if idx[-1] + 1 >= nwords + 1 + (0 if shift[-1] + bits > 32 else 1):
        raise ShapeError(f"packed tensor of {words.shape[dim]} words along dim {dim} cannot hold "
                         f"{count} values of {bits} bits")
    rows = w.reshape(math.prod(lead), nwords)
    out = torch.empty(rows.shape[0], count, dtype=torch.uint8, device=w.device)
    step = chunk_rows(count, w.device)
    for r in range(0, rows.shape[0], step):
        c = rows[r:r + step].to(torch.int64) & 0xFFFFFFFF
        c = torch.cat([c, torch.zeros_like(c[:, :1])], dim=-1)          # a zero word for straddling reads
        pair = c[:, idx] | (c[:, idx + 1] << 32)
        out[r:r + step] = (pair >> shift) & ((1 << bits) - 1)
    return out.reshape(*lead, count).movedim(-1, dim)


def check_shape(qt: QTensor, name: str, shape: tuple[int, int], store: TensorStore) -> QTensor:
    """`qt` if its shape is the config's `shape` for layer `name`, else ShapeError naming both."""
    if tuple(qt.shape) != tuple(shape):
        raise ShapeError(f"{store.path}: quantized weight {name!r} has shape {list(qt.shape)}, config.json "
                         f"implies {list(shape)}")
    return qt


class StagedStore:
    """A TensorStore whose tensors are moved to `device` as they are read, so that a family's reader unpacks
    the stored words there: a checkpoint's packed int32 words cross to the GPU as they are, and the one byte
    per weight of the canonical codes exists only on the GPU, never on the host."""

    def __init__(self, store: TensorStore, device: torch.device):
        self.store, self.device = store, device

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.store[name].to(self.device)

    def __contains__(self, name: object) -> bool:
        return name in self.store

    def __getattr__(self, name: str):
        return getattr(self.store, name)


class QuantView(Mapping[str, Any]):
    """The canonical tensors of a quantized checkpoint, read (and unpacked) lazily on access; on the device
    given to `read_on`, the CPU by default."""

    def __init__(self, store: TensorStore, shapes: dict[str, tuple[int, ...]], read: Reader,
                 extra: dict[str, str]):
        self.store, self.shapes, self.read, self.extra = store, shapes, read, extra
        self.names = list(shapes) + list(extra)
        self.staged: TensorStore | StagedStore = store

    def read_on(self, device: torch.device | str) -> None:
        """Unpack quantized weights on `device` from now on (their stored words are moved there first)."""
        device = torch.device(device)
        self.staged = self.store if device.type == "cpu" else StagedStore(self.store, device)

    def __getitem__(self, name: str):
        if name in self.extra:
            return self.store[self.extra[name]]
        if name not in self.shapes:
            raise KeyError(name)
        shape = self.shapes[name]
        # the lm_head too where the file stores it quantized (GPTQModel's lm_head=True, compressed-tensors without
        # it in `ignore`): the reader finds its quantized parts, else gives None and the float weight is read
        if name.endswith(".weight") and len(shape) == 2 and name != "model.embed_tokens.weight":
            qt = self.read(self.staged, name.removesuffix(".weight"), shape)
            if qt is not None:
                return check_shape(qt, name, shape, self.store)
        t = need(self.store, name, "unquantized tensor")
        if tuple(t.shape) != tuple(shape):
            raise ShapeError(f"{self.store.path}: tensor {name!r} has shape {list(t.shape)}, config.json "
                             f"implies {list(shape)}")
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def kv_scale_names(store: TensorStore, config: ModelConfig) -> dict[str, str]:
    """Canonical `model.layers.{i}.self_attn.{k,v}_scale` -> stored name (compressed-tensors or modelopt)."""
    out = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for kv in "kv":
            for stored in (f"{p}{kv}_scale", f"{p}{kv}_proj.{kv}_scale", f"{p}attn.{kv}_scale"):
                if stored in store:
                    out[f"{p}{kv}_scale"] = stored
                    break
    return out


def build_checkpoint(path: str | Path, fmt: str, read: Reader, qc: dict[str, Any], *,
                     cfg: dict[str, Any] | None = None, tokenizer: bool | None = None,
                     kv_scales: Callable[[TensorStore, ModelConfig], dict[str, str]] | None = None) -> Checkpoint:
    """A Checkpoint of the quantized HF directory `path`, whose linear layers `read` turns into QTensors.

    Every canonical tensor must be present (quantized or plain); quantized ones are checked against the
    config's shapes when read. `extra` names additional canonical -> stored tensors (e.g. KV-cache scales).
    """
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: a {fmt} checkpoint is a directory holding config.json")
    cfg = read_config(path) if cfg is None else cfg
    config = model_config_from_hf(cfg, path)
    store = open_weights(path)
    check_layer_count(config, len(store), path)
    shapes = canonical_shapes(config)
    prefixes = {n.rsplit(".", 1)[0] for n in store} | {n.rsplit(".", 2)[0] for n in store}   # bnb: x.weight.absmax
    for name in shapes:
        if name not in store and name.removesuffix(".weight") not in prefixes:
            raise CorruptFileError(f"{path}: tensor {name!r} (or its quantized parts) is missing from the weights "
                                   f"({', '.join(p.name for p in store.files)})")
    emb = store.info("model.embed_tokens.weight").dtype
    if emb in FLOAT_DTYPES:
        config.torch_dtype = FLOAT_DTYPES[emb]
    tok = None
    if tokenizer or (tokenizer is None and any((path / f).is_file() for f in TOKENIZER_FILES)):
        tok = load_tokenizer(path)
    view = QuantView(store, shapes, read, {})
    kv = {canon: store[stored] for canon, stored in names.items()} \
        if kv_scales is not None and (names := kv_scales(store, config)) else {}
    return Checkpoint(path=path, format=fmt, config=config, tensors=view, tokenizer=tok, quant_config=qc,
                      chat_template=getattr(tok, "chat_template", None), kv_cache_scales=kv)

