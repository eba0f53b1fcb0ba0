"""What every checkpoint writer shares: the atomic destination, safetensors sharding, config and tokenizer files.

A writer is a `Layout` (how one canonical tensor becomes the stored tensors of its format, and which
`quantization_config` describes them) handed to `write_checkpoint`, which streams the tensors through it:

    write_awq(dst, ckpt)          # = write_checkpoint(dst, ckpt, None, AwqLayout(...))

The destination appears complete or not at all: everything is built in `dst.parent/.<dst.name>.tmp-XXXX`
and renamed onto `dst` at the end; any exception (KeyboardInterrupt included) removes the temporary
folder. Tensors are consumed once, in order; at most one shard of converted tensors is held at a time.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders.hf import canonical_shapes
from quanta.loaders.safetensors_io import SAFETENSORS_FILE, SAFETENSORS_INDEX
from quanta.quant.errors import ConfigError, ShapeError, UnsupportedError
from quanta.quant.kinds import Affine
from quanta.quant.qtensor import QTensor
from quanta.sizes import parse_bytes

DEFAULT_SHARD_SIZE = 5 * 10**9          # transformers' save_pretrained default, "5GB"
UNQUANTIZED = ("model.embed_tokens.weight", "lm_head.weight")    # kept in float by a layout unless it says otherwise

Tensor = torch.Tensor | QTensor


class Layout:
    """How one format stores tensors. Subclasses override `convert_quantized` and `quantization_config`; each
    is made as `Layout(config, **options)` (the model's ModelConfig, then the format's writer options), so the
    format table can make one to ask whether it holds a weight."""

    fmt = "hf"
    float_only = UNQUANTIZED        # tensors its quantization config cannot declare quantized

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.plain_linears: list[str] = []      # decoder linear modules that came unquantized

    def convert_plain(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored tensors of an unquantized tensor (default: itself)."""
        return {name: t}

    def convert_quantized(self, name: str, qt: QTensor) -> dict[str, torch.Tensor]:
        """The stored tensors of quantized linear weight `name`; UnsupportedError if the format cannot hold it."""
        raise UnsupportedError(f"{name}: the {self.fmt} layout cannot store a quantized {qt.describe()} weight")

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """Stored tensors that are not in the canonical stream (e.g. KV-cache scales), added at the end."""
        return {}

    def quantization_config(self) -> dict[str, Any] | None:
        """config.json's `quantization_config` once every tensor went through (may raise UnsupportedError)."""
        return None

    def convert(self, name: str, t: Tensor) -> dict[str, torch.Tensor]:
        """Stored tensors of canonical tensor `name` (quantized linear weights go to `convert_quantized`)."""
        if isinstance(t, QTensor):
            if name in self.float_only:
                raise UnsupportedError(f"{name}: a {self.fmt} checkpoint keeps {name} in float; a quantized "
                                       f"{t.describe()} weight there cannot be written (dequantize it first)")
            return self.convert_quantized(name, t)
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            self.plain_linears.append(module_of(name))
        return self.convert_plain(name, t)


def affine_of(name: str, qt: QTensor, fmt: str) -> Affine:
    """`qt` as an Affine (its exact integer form); UnsupportedError naming `name` when it has none."""
    a = qt.to_affine()
    if a is None:
        raise UnsupportedError(f"{name}: a {qt.describe()} weight has no exact integer (affine) form, which {fmt} "
                               "stores")
    if a.post_scale is not None:
        raise UnsupportedError(f"{name}: {a.describe()} has a post_scale (bnb LLM.int8 rounding), which {fmt} "
                               "cannot store")
    if a.mins is not None:
        raise UnsupportedError(f"{name}: {a.describe()} has float mins (w = q*s + m); {fmt} stores integer zero "
                               "points (w = (q - z)*s)")
    return a


def zeros_of(a: Affine) -> torch.Tensor:
    """The integer zero points [N, G] of `a` as uint8 (one int for all groups expanded)."""
    if isinstance(a.zeros, torch.Tensor):
        return a.zeros.to(torch.uint8)
    return torch.full(tuple(a.scales.shape), int(a.zeros), dtype=torch.uint8, device=a.scales.device)


def module_of(name: str) -> str:
    """"model.layers.0.mlp.up_proj.weight" -> "model.layers.0.mlp.up_proj"."""
    return name.removesuffix(".weight")


def exact_cast(t: torch.Tensor, dtype: torch.dtype, what: str, allow_rounding: bool) -> torch.Tensor:
    """`t` in `dtype`; UnsupportedError naming `what` when that changes a value and rounding is not allowed."""
    out = t.to(dtype)
    if not allow_rounding and t.dtype != dtype and not torch.equal(out.to(t.dtype), t):
        raise UnsupportedError(f"{what} are {str(t.dtype).removeprefix('torch.')} and not exactly representable "
                               f"in {str(dtype).removeprefix('torch.')} (the format's scale dtype); quantize with "
                               f"{str(dtype).removeprefix('torch.')} scales or pass round_scales=True")
    return out


def common_group_size(layers: dict[str, tuple[int, int, int]], fmt: str) -> int:
    """The one `group_size` a format's config declares for `layers` (module -> (group_size, groups, K)).

    Layers with several groups must agree on their group size G; one-group (per-channel) layers fit G when
    K <= G. All layers per-channel gives -1. UnsupportedError naming two disagreeing layers otherwise.
    """
    grouped = {}
    for module, (group, ngroups, _) in layers.items():
        if ngroups > 1:
            grouped.setdefault(group, module)
    if len(grouped) > 1:
        (g1, m1), (g2, m2) = list(grouped.items())[:2]
        raise UnsupportedError(f"{m1} has group_size {g1} but {m2} has {g2}: a {fmt} config declares one "
                               "group size for every layer")
    if not grouped:
        return -1
    group, first = next(iter(grouped.items()))
    for module, (_, ngroups, k) in layers.items():
        if ngroups == 1 and k > group:
            raise UnsupportedError(f"{module} is quantized per channel (one group of K={k}) but {first} has "
                                   f"group_size {group}: a {fmt} config declares one group size for every layer")
    return group


def shard_bytes(max_shard_size: int | str) -> int:
    """The shard limit in bytes from an int or a size string ("5GB", "500MiB")."""
    size = parse_bytes(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if not isinstance(size, int) or size <= 0:
        raise ConfigError(f"max_shard_size must be a positive size (e.g. 5GB), got {max_shard_size!r}")
    return size


def check_destination(dst: str | Path, overwrite: bool) -> Path:
    """`dst` as a Path; ConfigError if it exists and `overwrite` is false."""
    dst = Path(dst)
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise ConfigError(f"{dst}: already exists; pass overwrite=True to replace it")
    return dst


@contextmanager
def atomic_file(dst: Path) -> Iterator[Path]:
    """Yield a temporary file path beside `dst` that is renamed onto `dst` when the block completes; on any
    exception it is removed and `dst` is untouched (the caller checks `dst` first: check_destination)."""
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_directory(dst: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `dst` that replaces `dst` when the block completes.

    On any exception the temporary folder is removed and `dst` is untouched. An existing `dst` is refused
    unless `overwrite`; then it is moved aside, replaced, and deleted only after the new one is in place.
    """
    dst = check_destination(dst, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.tmp-"))
    old = None
    try:
        yield tmp
        if dst.exists() or dst.is_symlink():
            check_destination(dst, overwrite)             # it may have appeared while we wrote
            old = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.old-")) / dst.name
            os.replace(dst, old)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not dst.exists():
            os.replace(old, dst)                          # the new one never landed: put the old one back
            shutil.rmtree(old.parent, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old.parent, ignore_errors=True)


class ShardWriter:
    """Safetensors files of at most `max_bytes` each (a single larger tensor group gets a file of its own),
    named as transformers names them, with `model.safetensors.index.json` when there is more than one."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.names: set[str] = set()
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Queue one tensor group (a layer's stored parts stay in one file); flush when the shard is full."""
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.buffer and self.buffered + size > self.max_bytes:
            self.flush()
        for name, t in tensors.items():
            if name in self.names:
                raise ConfigError(f"tensor {name!r} is written twice")
            self.names.add(name)
            self.buffer[name] = t.detach().to("cpu").contiguous()
        self.buffered += size
        self.total += size

    def flush(self) -> None:
        """Write the buffered tensors as the next shard."""
        if not self.buffer:
            return
        path = self.directory / f".shard-{len(self.files) + 1:05d}.safetensors"
        save_file(self.buffer, path, metadata={"format": "pt"})
        self.files.append((path, list(self.buffer)))
        self.buffer, self.buffered = {}, 0

    def finish(self) -> None:
        """Flush, give the shards their final names, and write the index when sharded."""
        self.flush()
        if len(self.files) <= 1:
            if self.files:
                os.replace(self.files[0][0], self.directory / SAFETENSORS_FILE)
            else:
                save_file({}, self.directory / SAFETENSORS_FILE, metadata={"format": "pt"})
            return
        weight_map = {}
        n = len(self.files)
        for i, (path, names) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.directory / final)
            weight_map |= {name: final for name in names}
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(self.directory / SAFETENSORS_INDEX, index)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """`data` as indented JSON (transformers' style) with a trailing newline."""
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# Keys transformers' save_pretrained copies from the from_pretrained call into tokenizer_config.json.
LOAD_TIME_KEYS = ("is_local", "local_files_only")


def write_tokenizer_files(directory: Path, ckpt: Checkpoint) -> None:
    """The tokenizer (save_pretrained), its chat template and generation_config.json (bos/eos) into `directory`."""
    if ckpt.tokenizer is not None:
        ckpt.tokenizer.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    tok_cfg = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else None
    if tok_cfg is not None:
        for key in LOAD_TIME_KEYS:                   # how the tokenizer was loaded, not what it is
            tok_cfg.pop(key, None)
    template = ckpt.chat_template
    if template is not None:
        if (directory / "chat_template.jinja").is_file():      # transformers 5 keeps the template here
            (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
        else:
            tok_cfg = (tok_cfg or {}) | {"chat_template": template}
    if tok_cfg is not None:
        write_json(config_path, tok_cfg)
    c = ckpt.config
    gen = {k: v for k, v in (("bos_token_id", c.bos_token_id), ("eos_token_id", c.eos_token_id)) if v is not None}
    if gen:
        write_json(directory / "generation_config.json", {"_from_model_config": True, **gen})


def write_checkpoint(dst: str | Path, ckpt: Checkpoint, tensors: Iterable[tuple[str, Tensor]] | None,
                     layout: Layout, *, overwrite: bool = False,
                     max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Stream `tensors` (default `ckpt.tensors.items()`) through `layout` into checkpoint directory `dst`.

    Every canonical tensor of `ckpt.config` must come exactly once, with its canonical shape (a stored copy
    of a tied lm_head is dropped). Peak memory: one shard of converted tensors (`max_shard_size`, or the
    largest single layer when that is bigger) plus the tensor being converted. Returns `dst`.
    """
    dst = check_destination(dst, overwrite)
    limit = shard_bytes(max_shard_size)
    expected = canonical_shapes(ckpt.config)
    stream = ckpt.tensors.items() if tensors is None else tensors
    dtype = None
    with atomic_directory(dst, overwrite) as tmp:
        shards = ShardWriter(tmp, limit)
        seen = set()
        for name, t in stream:
            if name == "lm_head.weight" and ckpt.config.tie_word_embeddings:
                continue
            if name not in expected:
                raise UnsupportedError(f"{name}: not a tensor of a {ckpt.config.model_type} model with this config")
            if tuple(t.shape) != expected[name]:
                raise ShapeError(f"{name}: shape {list(t.shape)}, the config implies {list(expected[name])}")
            if name in seen:
                raise ConfigError(f"tensor {name!r} comes twice in the tensor stream")
            seen.add(name)
            stored = layout.convert(name, t)
            if name == "model.embed_tokens.weight":
                dtype = stored[name].dtype
            shards.add(stored)
        missing = [n for n in expected if n not in seen]
        if missing:
            raise ConfigError(f"the tensor stream ended without {len(missing)} tensors of the model: "
                              f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}")
        qc = layout.quantization_config()
        if extra := layout.extra_tensors():
            shards.add(extra)
        shards.finish()
        cfg = ckpt.config.to_hf_dict()
        if dtype is not None and dtype.is_floating_point:
            cfg["dtype"] = str(dtype).removeprefix("torch.")
        if qc is not None:
            cfg["quantization_config"] = qc
        write_json(tmp / "config.json", cfg)
        write_tokenizer_files(tmp, ckpt)
    return dst
