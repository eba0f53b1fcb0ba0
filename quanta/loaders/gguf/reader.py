"""GGUF loader (llama.cpp files): metadata -> ModelConfig, tensors -> canonical HF names, tokenizer.

Quantized weights stay `Gguf` QTensors holding the ggml blocks as stored (never dequantized here);
F32/F16/BF16 tensors become plain torch tensors. llama.cpp's converter permutes the rows of the
llama/mistral q and k projections (convert_hf_to_gguf.py `LlamaModel.permute`, for interleaved RoPE);
that is undone here by selecting whole rows, which is exact for blocks too. Qwen2/Qwen3 files are
written unpermuted (`Qwen2Model` does not permute). Tensors are read lazily from the memory-mapped
file, so iterating `Checkpoint.tensors` costs one tensor at a time.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders.gguf.file import GgufFile, TensorInfo, read_gguf
from quanta.loaders.gguf.mix import from_file
from quanta.loaders.hf import canonical_shapes
from quanta.loaders.weight_format import WeightFormat
from quanta.quant.errors import ConfigError, CorruptFileError, ShapeError, UnsupportedError
from quanta.quant.kinds.gguf import Gguf

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")   # general.architecture values we run
PERMUTED_QK = ("llama", "mistral")                        # archs whose q/k rows the converter permutes

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_REQUIRED = object()


def load_gguf(path: str | Path, tokenizer: bool = True) -> Checkpoint:
    """Read a GGUF file into a Checkpoint (format "gguf"); see the module docstring."""
    file = read_gguf(path)
    path, meta = file.path, _Meta(file)
    arch = meta("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedError(f"{path}: GGUF architecture {arch!r} is not supported "
                               f"(supported: {', '.join(ARCHITECTURES)})")
    config = read_config(meta, arch, file)
    # Shapes as one layer has them: a file may hold a subset of the tensors, and block_count is not
    # trusted to be small enough to list every layer's.
    layer0, tensors = canonical_shapes(dataclasses.replace(config, num_hidden_layers=1)), _LazyTensors(file)
    for t in file.tensors:
        if t.name == "rope_freqs.weight":
            continue                                   # folded into config.rope_scaling
        name = hf_name(t.name)
        if name is None:
            raise UnsupportedError(f"{path}: tensor {t.name!r} is not part of the {arch} architecture")
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        want = layer0.get(name if layer is None else f"model.layers.0.{name[layer.end():]}")
        if want is None or (layer is not None and int(layer[1]) >= config.num_hidden_layers):
            raise CorruptFileError(f"{path}: tensor {t.name!r} is not part of the {config.num_hidden_layers}-layer "
                                   f"{arch} model the metadata describes")
        if t.dims != want:
            raise ShapeError(f"{path}: tensor {t.name!r} has shape {list(t.dims)}, the metadata implies {list(want)}")
        tensors.add(name, _tensor_reader(file, t, arch, config))
    quant_config = {"quant_method": "gguf", "file_type": meta("general.file_type", None),
                    "tensor_types": dict(Counter(t.type.name for t in file.tensors))}
    return Checkpoint(path=path, format="gguf", config=config, tensors=tensors,
                      tokenizer=load_tokenizer(path) if tokenizer and "tokenizer.ggml.model" in file.metadata
                      else None, quant_config=quant_config,
                      chat_template=meta("tokenizer.chat_template", None))


# --- metadata -------------------------------------------------------------------------------------
# What a metadata value of each expected kind must be (bool is an int in Python, never one here).
_KINDS = {int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
          float: ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
          str: ("a string", lambda v: isinstance(v, str))}


class _Meta:
    """Metadata lookup: meta(key) or meta(key, default), optionally of a `kind` (int, float or str);
    a missing required key or a value of another kind is a ConfigError naming the key."""

    def __init__(self, file: GgufFile):
        self.metadata, self.path = file.metadata, file.path

    def __call__(self, key: str, default: Any = _REQUIRED, kind: type | None = None) -> Any:
        if key not in self.metadata:
            if default is _REQUIRED:
                raise ConfigError(f"{self.path}: required GGUF metadata key {key!r} is missing")
            return default
        value = self.metadata[key]
        if kind is not None and not _KINDS[kind][1](value):
            raise ConfigError(f"{self.path}: GGUF metadata {key!r} must be {_KINDS[kind][0]}, got "
                              f"{type(value).__name__} {str(value)[:60]}")
        return value

    def count(self, key: str) -> int | None:
        value = self.metadata.get(key)
        return None if value is None else len(value) if isinstance(value, list) else 1


# --- config ---------------------------------------------------------------------------------------
def read_config(meta: _Meta, arch: str, file: GgufFile) -> ModelConfig:
    """The ModelConfig of a GGUF file from its `{arch}.*` and `tokenizer.ggml.*` metadata."""
    tensors = {t.name: t for t in file.tensors}
    name = str(meta("general.name", "") or "")
    model_type = "mistral" if arch == "llama" and "mistral" in name.lower() else arch
    heads = meta(f"{arch}.attention.head_count", kind=int)
    vocab = meta(f"{arch}.vocab_size", None, int) or meta.count("tokenizer.ggml.tokens")
    if vocab is None:
        raise ConfigError(f"{meta.path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
    head_dim = meta(f"{arch}.attention.key_length", None, int) or meta(f"{arch}.rope.dimension_count", None, int)
    theta = meta(f"{arch}.rope.freq_base", 10000.0, float)
    eos, eot = meta("tokenizer.ggml.eos_token_id", None, int), meta("tokenizer.ggml.eot_token_id", None, int)
    bf16 = any(t.type.name == "bf16" for t in file.tensors)
    kw = dict(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=meta(f"{arch}.embedding_length", kind=int),
        intermediate_size=meta(f"{arch}.feed_forward_length", kind=int),
        num_hidden_layers=meta(f"{arch}.block_count", kind=int),
        num_attention_heads=heads,
        num_key_value_heads=meta(f"{arch}.attention.head_count_kv", heads, int),
        head_dim=head_dim,
        rms_norm_eps=meta(f"{arch}.attention.layer_norm_rms_epsilon", kind=float),
        rope_theta=theta,
        max_position_embeddings=meta(f"{arch}.context_length", 4096, int),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=meta(f"{arch}.attention.sliding_window", None, int),
        bos_token_id=meta("tokenizer.ggml.bos_token_id", None, int),
        eos_token_id=[eos, eot] if None not in (eos, eot) and eot != eos else eos,
        torch_dtype=torch.bfloat16 if bf16 else torch.float16,   # GGUF scales and activations: f16
    )
    try:
        config = ModelConfig(**kw)
    except ConfigError as e:   # a field of the wrong value: name the file
        raise ConfigError(f"{meta.path}: {e}") from e
    # After ModelConfig has checked rope_theta, which the llama3 factors are computed from.
    config.rope_scaling = read_rope_scaling(meta, arch, _vector(file, tensors.get("rope_freqs.weight")), theta)
    return config


def read_rope_scaling(meta: _Meta, arch: str, factors: np.ndarray | None, theta: float) -> dict[str, Any] | None:
    """`{arch}.rope.scaling.*` keys, or the Llama-3 `rope_freqs` tensor, as an HF-style rope_scaling.

    llama.cpp divides frequency i by rope_freqs[i]; those factors are kept exactly as "freq_factors".
    Where they equal HF's llama3 formula with Llama 3.1's low/high factors (1, 4) and original
    context (8192), those parameters are filled in too, so the dict is a valid transformers one.
    """
    kind = meta(f"{arch}.rope.scaling.type", None, str)
    if kind not in (None, "none"):
        keys = {"factor": "factor", "original_max_position_embeddings": "original_context_length",
                "attention_factor": "attn_factor", "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}
        out = {hf: meta(f"{arch}.rope.scaling.{g}", None, float) for hf, g in keys.items()}
        return {"rope_type": kind, **{k: v for k, v in out.items() if v is not None}}
    if factors is None:
        return None
    spec = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if not np.allclose(llama3_freq_factors(theta, 2 * factors.size, spec), factors, rtol=1e-5):
        spec = {"rope_type": "llama3", "factor": spec["factor"]}
    return {**spec, "freq_factors": factors.tolist()}


def llama3_freq_factors(theta: float, dim: int, spec: dict[str, Any]) -> np.ndarray:
    """The divisors llama.cpp's converter writes as rope_freqs for an HF llama3 rope_scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = spec["factor"], spec["low_freq_factor"], spec["high_freq_factor"]
    old = spec["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


# --- tensors --------------------------------------------------------------------------------------
def hf_name(gguf_name: str) -> str | None:
    """The canonical HF llama name of a GGUF tensor name, or None for a name we do not know."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m[2] in LAYER_NAMES:
        return f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.{suffix}"
    return None


def qk_unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order undoing convert_hf_to_gguf's q/k `permute` (transformers' reverse_permute_weights)."""
    dim = rows // n_head // 2
    return torch.arange(rows).view(n_head, dim, 2).transpose(1, 2).reshape(rows)


def _tensor_reader(file: GgufFile, t: TensorInfo, arch: str, config: ModelConfig) -> Callable[[], Any]:
    what = f"{file.path}: tensor {t.name!r}"
    gt, dims = t.type, list(t.dims)                                  # numpy order: [N, K] or [K]
    if len(dims) > 2:
        raise UnsupportedError(f"{what}: {len(dims)}-D tensors are not supported")
    perm = None
    if arch in PERMUTED_QK and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", t.name):
        heads = config.num_attention_heads if ".attn_q." in t.name else config.num_key_value_heads
        if dims[0] % (2 * heads):
            raise CorruptFileError(f"{what}: {dims[0]} rows do not split into {heads} heads of pairs")
        perm = qk_unpermute_index(dims[0], heads)

    def raw() -> torch.Tensor:
        return torch.from_numpy(file.read(t))

    if gt.float_dtype is not None:
        def read():
            x = raw().view(gt.float_dtype).reshape(dims)
            return x if perm is None else x[perm]
    elif gt.block_size > 1:
        def read():
            if len(dims) == 1:                                        # a quantized vector: decode it
                return Gguf(raw().view(1, -1), gt.id, (1, dims[0])).dequantize().view(dims)
            q = Gguf(raw().view(dims[0], -1), gt.id, tuple(dims))
            return q if perm is None else q.take_rows(perm)
    else:
        raise UnsupportedError(f"{what}: GGML type {gt.name} is not a weight type")
    return read


def _vector(file: GgufFile, t: TensorInfo | None) -> np.ndarray | None:
    """The values of float vector `t` (rope_freqs) as float32, or None when the file has no such tensor."""
    if t is None:
        return None
    if t.type.float_dtype is None:
        raise UnsupportedError(f"{file.path}: tensor {t.name!r} is {t.type.name}, expected a float type")
    if len(t.dims) != 1 or t.nbytes == 0:
        raise CorruptFileError(f"{file.path}: tensor {t.name!r} has shape {list(t.dims)}, expected a non-empty vector")
    values = torch.from_numpy(file.read(t)).view(t.type.float_dtype).float().numpy()
    if not (np.isfinite(values) & (values > 0)).all():   # they divide the rope frequencies
        raise CorruptFileError(f"{file.path}: tensor {t.name!r} must hold finite positive factors, got values "
                               f"from {values.min()} to {values.max()}")
    return values


class _LazyTensors(Mapping):
    """name -> tensor, each read from the memory-mapped file when asked for; `file` is that file, parsed
    (the GGUF writer copies its vocabulary from it rather than parsing it again)."""

    def __init__(self, file: GgufFile):
        self.file = file
        self._read: dict[str, Callable[[], Any]] = {}

    def add(self, name: str, read: Callable[[], Any]) -> None:
        assert name not in self._read, name    # read_gguf already rejects duplicated tensor names
        self._read[name] = read

    def __getitem__(self, name: str):
        return self._read[name]()

    def __contains__(self, name: object) -> bool:
        return name in self._read              # Mapping's default would read the tensor to answer

    def __iter__(self) -> Iterator[str]:
        return iter(self._read)

    def __len__(self) -> int:
        return len(self._read)


# --- tokenizer ------------------------------------------------------------------------------------
def load_tokenizer(path: Path):
    """The transformers tokenizer converted from the file's tokenizer.ggml.* metadata (offline).

    The conversion is slow (transformers rebuilds the BPE model from tokens and merges), so the result is kept
    in a per-file cache directory and later loads read that; the cache key covers the file's path, size and
    modification time, and a cache that cannot be written is simply skipped. A file's first conversion runs in
    a child process that writes the entry: the converter's imports (transformers' GGUF code, gguf-py and what
    they pull in) would otherwise stay resident in this process for as long as it serves the model.
    """
    from transformers import AutoTokenizer
    cache = tokenizer_cache_dir(path)
    if cache is not None:
        if not (cache / "tokenizer_config.json").is_file():
            _convert_in_child(path)
        if (cache / "tokenizer_config.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
            except Exception as e:   # a damaged cache entry: rebuild it below
                log.warning("ignoring unreadable tokenizer cache %s (%s)", cache, e)
    tok = convert_tokenizer(path)
    if cache is not None:
        _save_atomically(tok, cache)
    return tok


def convert_tokenizer(path: Path):
    """The transformers tokenizer built from the file's metadata in this process (no cache)."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:   # re-raised typed: transformers raises many kinds here
        raise UnsupportedError(f"{path}: transformers could not build the tokenizer from the GGUF "
                               f"metadata ({type(e).__name__}: {e})") from e


def build_tokenizer_cache(path: Path) -> None:
    """Convert `path`'s tokenizer and write its cache entry: what load_tokenizer's child process runs."""
    cache = tokenizer_cache_dir(path)
    if cache is not None:
        _save_atomically(convert_tokenizer(path), cache)


def _convert_in_child(path: Path) -> None:
    """build_tokenizer_cache(path) in a child Python with this one's import path. A child that fails leaves no
    entry behind, and the caller then converts here (which raises the typed error if the conversion is at fault)."""
    code = ("import pathlib, sys; from quanta.loaders.gguf.reader import build_tokenizer_cache; "
            "build_tokenizer_cache(pathlib.Path(sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, timeout=900,
                       check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.info("tokenizer conversion in a child process failed (%s); converting in this one", e)


def tokenizer_cache_dir(path: Path) -> Path | None:
    """Where the converted tokenizer of `path` is cached ($QUANTA_CACHE or ~/.cache/quanta), or None
    when QUANTA_CACHE is set to an empty string (caching off)."""
    root = os.environ.get("QUANTA_CACHE", str(Path.home() / ".cache" / "quanta"))
    if not root:
        return None
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return Path(root) / "gguf-tokenizers" / key


def _save_atomically(tok, cache: Path) -> None:
    """Write the cache entry under a temporary name and rename it into place, so that a reader sees a whole
    entry or none. When another process renamed its entry first (two servers starting at once), that entry
    stands and ours is dropped; only a cache that cannot be written at all is reported."""
    tmp = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".tmp-"))
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cache)
        tmp = None
    except OSError as e:
        if not (cache / "tokenizer_config.json").is_file():     # read-only home, full disk: run without it
            log.info("tokenizer cache not written (%s)", e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def read_header(path: str | Path) -> tuple[ModelConfig, dict[str, str]]:
    """The config and per-tensor GGML type names ({GGUF tensor name: type name}) of a GGUF file, from one
    read of its header (the tensor data stays mapped, unread)."""
    file = read_gguf(path)
    meta = _Meta(file)
    arch = meta("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedError(f"{file.path}: GGUF architecture {arch!r} is not supported "
                               f"(supported: {', '.join(ARCHITECTURES)})")
    return read_config(meta, arch, file), {t.name: t.type.name for t in file.tensors}


def weight_format(config: ModelConfig, qc: dict[str, Any], path: Path) -> WeightFormat:
    """What a GGUF file's weights are, for the memory plan: each tensor's GGML type, from its header."""
    return WeightFormat("gguf (as stored)", "gguf", gguf=from_file("gguf (as stored)", read_header(path)[1]))
