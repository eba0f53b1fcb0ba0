"""GGUF LoRA adapters as llama.cpp's convert_lora_to_gguf.py writes them (adapter.py builds the LoRAWeights).

Metadata general.type = "adapter", adapter.type = "lora", adapter.lora.alpha (f32, 0 when absent); tensors
`<base GGUF tensor name>.lora_a` [rank, in] and `.lora_b` [out, rank] (numpy order) in F32 / F16 / BF16 or a
quantized type. llama.cpp's scale is alpha / rank of each pair, or 1 where alpha is 0 (llama-adapter.h
get_scale), times the user's scale. The converter reshapes the adapter as convert_hf_to_gguf reshapes the
base weight, so for llama / mistral it permutes the rows of lora_b of attn_q and attn_k as it permutes
q_proj / k_proj; that is undone here with the base reader's index, which needs the base model's head counts
(from `config`, or the adapter's own `{arch}.attention.head_count[_kv]` where it has them).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quanta.loaders.checkpoint import ModelConfig
from quanta.loaders.gguf.file import GgufFile, TensorInfo, read_gguf
from quanta.loaders.gguf.reader import ARCHITECTURES, PERMUTED_QK, hf_name, qk_unpermute_index
from quanta.quant.errors import ConfigError, CorruptFileError, ShapeError, UnsupportedError

SUFFIXES = {".lora_a": "a", ".lora_b": "b"}


@dataclass
class GgufLoRA:
    """An opened GGUF LoRA file, checked and not yet read: its pairs' tensor infos by HF module name (as
    the base reader maps the base tensor's name; adapter.py checks that quanta supports each)."""
    file: GgufFile
    alpha: float
    pairs: dict[str, dict[str, TensorInfo]]        # module -> {"a": lora_a info, "b": lora_b info}
    heads: tuple[int, int] | None                  # (q, kv) heads where lora_b rows of q / k are permuted

    def scaling(self, rank: int) -> float:
        """llama.cpp's scale of a pair of `rank`, at the user's scale 1."""
        return self.alpha / rank if self.alpha else 1.0

    def read(self, module: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(A [rank, in], B [out, rank]) of `module` as float32, B's q / k rows back in HF order."""
        ab = self.pairs[module]
        a, b = (_read(self.file, ab[k]) if k in ab else None for k in "ab")
        if self.heads is not None and b is not None and module.endswith(("q_proj", "k_proj")):
            n_head = self.heads[0] if module.endswith("q_proj") else self.heads[1]
            if b.shape[0] % (2 * n_head):
                raise ShapeError(f"{self.file.path}: {ab['b'].name!r}: {b.shape[0]} rows do not split into "
                                 f"{n_head} heads of pairs")
            b = b[qk_unpermute_index(b.shape[0], n_head)]
        return a, b


def open_gguf_adapter(path: Path, config: ModelConfig | None) -> GgufLoRA:
    """GGUF LoRA file `path`, its metadata and tensor names checked (see the module docstring)."""
    file = read_gguf(path)
    meta = file.metadata
    if meta.get("general.type") != "adapter":
        raise ConfigError(f"{path}: a GGUF file of general.type {meta.get('general.type')!r}, not a LoRA adapter "
                          "(general.type 'adapter')")
    if meta.get("adapter.type") != "lora":
        raise UnsupportedError(f"{path}: adapter.type {meta.get('adapter.type')!r} is not supported (only 'lora')")
    if meta.get("adapter.alora.invocation_tokens"):
        raise UnsupportedError(f"{path}: activated LoRA (adapter.alora.invocation_tokens) is not supported")
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedError(f"{path}: adapter architecture {arch!r} is not supported "
                               f"(supported: {', '.join(ARCHITECTURES)})")
    if config is not None:
        from quanta.loaders.gguf.writer import ARCH_OF
        if ARCH_OF.get(config.model_type) != arch:
            raise ConfigError(f"{path}: an adapter for {arch} models; the base model is {config.model_type}")
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not np.isfinite(alpha):
        raise ConfigError(f"{path}: adapter.lora.alpha must be a number, got {alpha!r}")
    pairs: dict[str, dict[str, TensorInfo]] = {}
    for t in file.tensors:
        base, suffix = next(((t.name[:-len(s)], s) for s in SUFFIXES if t.name.endswith(s)), (t.name, None))
        if suffix is None:
            raise UnsupportedError(f"{path}: tensor {t.name!r} is not a LoRA lora_a / lora_b tensor (norm and other "
                                   "full tensors in an adapter are not supported)")
        hf = hf_name(base)
        if hf is None or not hf.endswith(".weight"):
            raise UnsupportedError(f"{path}: tensor {t.name!r} targets no {arch} weight quanta knows")
        pairs.setdefault(hf.removesuffix(".weight"), {})[SUFFIXES[suffix]] = t
    permuted = arch in PERMUTED_QK and any(m.endswith(("q_proj", "k_proj")) for m in pairs)
    return GgufLoRA(file, float(alpha), pairs, _head_counts(path, file, arch, config) if permuted else None)


def _head_counts(path: Path, file: GgufFile, arch: str, config: ModelConfig | None) -> tuple[int, int]:
    """(query heads, key/value heads) of the base model: from `config`, else from the adapter's metadata."""
    if config is not None:
        return config.num_attention_heads, config.num_key_value_heads
    heads = file.metadata.get(f"{arch}.attention.head_count")
    if not isinstance(heads, int) or heads <= 0:
        raise ConfigError(f"{path}: a {arch} GGUF adapter's attn_q / attn_k rows are permuted by head; reading it "
                          "needs the base model's config (load_adapter(path, config)) for the head counts")
    kv = file.metadata.get(f"{arch}.attention.head_count_kv", heads)
    if not isinstance(kv, int) or kv <= 0:
        raise ConfigError(f"{path}: {arch}.attention.head_count_kv must be a positive integer, got {kv!r}")
    return heads, kv


def _read(file: GgufFile, t: TensorInfo) -> torch.Tensor:
    """Tensor `t` as float32 in numpy order; quantized types are dequantized by the gguf package."""
    if len(t.dims) != 2:
        raise ShapeError(f"{file.path}: tensor {t.name!r} has shape {list(t.dims)}, expected a matrix")
    raw = file.read(t)
    if t.type.float_dtype is not None:
        return torch.from_numpy(raw).view(t.type.float_dtype).reshape(t.dims).float()
    if t.type.block_size <= 1 or t.type.retired:
        raise UnsupportedError(f"{file.path}: tensor {t.name!r}: GGML type {t.type.name} is not a weight type")
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    try:
        values = dequantize(raw.reshape(t.dims[0], -1), GGMLQuantizationType(t.type.id))
    except (NotImplementedError, ValueError) as e:
        raise UnsupportedError(f"{file.path}: tensor {t.name!r}: the gguf package cannot dequantize "
                               f"{t.type.name} ({e})") from e
    if values.shape != t.dims:
        raise CorruptFileError(f"{file.path}: tensor {t.name!r} dequantizes to {list(values.shape)}, "
                               f"its header says {list(t.dims)}")
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
