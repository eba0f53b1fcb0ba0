"""GGUF writer: a Checkpoint's config, tensors and tokenizer as a llama.cpp GGUF file (GGUFWriter's bytes).

Tensors are named and laid out as convert_hf_to_gguf.py writes them: GGUF names (blk.N.attn_q.weight,
...), the llama/mistral q and k rows permuted for ggml's interleaved RoPE (the inverse of what the
reader undoes), vectors in F32, and matrices as
  - their ggml blocks as they are, for `Gguf` weights (no requantization) of the asked type;
  - the exactly equal legacy blocks for `Affine` weights that have one (Q4_0 .. Q8_0);
  - otherwise dequantized, then quantized to the type llama-quantize would give the tensor for
    `ggml_type` (a type such as "Q8_0" or a mix such as "Q4_K_M", gguf.mix.assign), or written as
    F16 when no type is asked for.
Tensor bytes are spilled to a scratch file as they are converted, so the checkpoint is read once and
never held whole; the file is written under a temporary name in dst's folder and renamed at the end.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quanta.loaders.gguf import reader
from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders.checkpoint_write import atomic_file
from quanta.loaders.gguf.encode import encode_header, pad
from quanta.loaders.gguf.file import GgufFile, read_gguf
from quanta.loaders.gguf.mix import GgufTypes, assign
from quanta.loaders.gguf.vocab import copied_vocab, vocab_metadata
from quanta.quant.errors import ConfigError, UnsupportedError
from quanta.quant.ggml.quantize import QUANTIZERS, affine_to_gguf, quantize
from quanta.quant.ggml.types import GGML_TYPES_BY_NAME
from quanta.quant.kinds.gguf import Gguf
from quanta.quant.qtensor import QTensor

ARCH_OF = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_NAME = {hf: g for g, hf in reader.GLOBAL_NAMES.items()}
LAYER_GGUF = {hf: g for g, hf in reader.LAYER_NAMES.items()}
# general.file_type (llama_ftype) of a requested type or mix; plain K types take their _S mix's id.
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_K": 10,
              "q3_K": 11, "q3_k_m": 12, "q4_K": 14, "q4_k_m": 15, "q5_K": 16, "q5_k_m": 17, "q6_K": 18, "bf16": 32}


def gguf_name(hf: str) -> str:
    """The GGUF tensor name of canonical HF llama name `hf` (UnsupportedError for unknown names)."""
    base, _, suffix = hf.rpartition(".")
    if base in GGUF_NAME:
        return f"{GGUF_NAME[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) >= 4 and parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in LAYER_GGUF:
        return f"blk.{parts[2]}.{LAYER_GGUF['.'.join(parts[3:])]}.{suffix}"
    raise UnsupportedError(f"GGUF writer: tensor {hf!r} has no GGUF name in the llama architecture")


def write_gguf(dst: str | Path, ckpt: Checkpoint, tensors: Iterable[tuple[str, torch.Tensor | QTensor]] | None = None,
               *, ggml_type: str | None = None, overwrite: bool = False, float_type: str = "f16",
               imatrix: dict[str, torch.Tensor] | None = None, with_imatrix: bool = False,
               name: str | None = None, extra_metadata: Callable[[], dict[str, Any]] | None = None) -> Path:
    """Write `ckpt` (tensors from `tensors`, default ckpt.tensors.items(), read once) as GGUF file `dst`.

    ggml_type: None (keep quantized weights, floats as `float_type`), a GGML type ("Q8_0", "Q4_K") or
    a llama-quantize mix ("Q4_K_M", "Q5_K_M"). imatrix: per-input-column importance by HF weight name
    (quant.ggml.quantize.Imatrix), used where a weight is quantized; with_imatrix: the tensors were quantized
    with one (`imatrix` or upstream), which changes a few of the types llama-quantize picks. `extra_metadata`:
    entries known once the tensors are written (a stream's, say the imatrix it used), added last. Refuses an
    existing dst unless `overwrite`; on any error nothing is left at dst or beside it.
    """
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise ConfigError(f"{dst}: already exists; pass overwrite=True to replace it")
    if not dst.parent.is_dir():
        raise ConfigError(f"{dst.parent}: the destination folder does not exist")
    config = ckpt.config
    arch = ARCH_OF.get(config.model_type)
    if arch is None:
        raise UnsupportedError(f"GGUF writer: model type {config.model_type!r} is not supported "
                               f"(supported: {', '.join(ARCH_OF)})")
    if float_type not in ("f16", "f32", "bf16"):
        raise ConfigError(f"GGUF writer: float_type must be f16, f32 or bf16, got {float_type!r}")
    types = assign(ggml_type, config, imatrix=with_imatrix or imatrix is not None) if ggml_type else None
    if types is not None and any(t not in ("f16", "f32", "bf16") and t not in QUANTIZERS for t in types.types.values()):
        raise UnsupportedError(f"GGUF writer: {ggml_type} needs a GGML type quanta cannot quantize to")
    metadata = _metadata(ckpt, arch, ggml_type, name)
    items = ckpt.tensors.items() if tensors is None else tensors
    with atomic_file(dst) as tmp, tempfile.TemporaryFile(dir=dst.parent) as spill:
        infos = [_spill(spill, gguf_name(hf), hf, t, config, arch, types, float_type, imatrix) for hf, t in items]
        freqs = _rope_freqs(config)
        if freqs is not None:
            infos.append(_spill(spill, "rope_freqs.weight", "rope_freqs", freqs, config, arch, None, float_type,
                                None))
        if not any(i[0] == "token_embd.weight" for i in infos):
            raise ConfigError("GGUF writer: the tensors hold no model.embed_tokens.weight")
        if extra_metadata is not None:
            metadata |= extra_metadata()
        _assemble(tmp, arch, metadata, infos, spill)
    return dst


# --- tensors ------------------------------------------------------------------------------------
def _spill(spill, name: str, hf: str, t: torch.Tensor | QTensor, config: ModelConfig, arch: str,
           types: GgufTypes | None, float_type: str, imatrix: dict[str, torch.Tensor] | None) -> tuple:
    """Convert one tensor, append its bytes to `spill`; returns (name, shape, ggml type, offset, nbytes)."""
    want = types.of_tensor(name) if types is not None else None
    if isinstance(t, QTensor):
        if t.kind == "affine" and (g := affine_to_gguf(t.to_affine())) is not None:
            t = g
        if not (isinstance(t, Gguf) and (want is None or t.type.name == want)):
            t = t.dequantize(torch.float32)
    perm = _qk_permutation(name, config) if arch == "llama" else None
    if isinstance(t, Gguf):
        q, type_name = (t if perm is None else t.take_rows(perm)), t.type.name
        data = q.data
    else:
        t = t.detach().cpu()
        if perm is not None:
            t = t[perm]
        if t.dim() == 1 or t.dim() == 2 and (want or "f") in ("f", "f16", "f32", "bf16"):
            type_name = "f32" if t.dim() == 1 else (want or float_type)
            data = t.to(GGML_TYPES_BY_NAME[type_name].float_dtype).contiguous().view(torch.uint8)
        elif t.dim() == 2:
            weights = None if imatrix is None else imatrix.get(hf)
            data, type_name = quantize(t, want, weights, what=f"{hf} ({name})").data, want
        else:
            raise UnsupportedError(f"GGUF writer: tensor {hf!r} has {t.dim()} dimensions")
    dims = tuple(t.shape)
    raw = data.contiguous().view(torch.uint8).numpy().reshape(-1)
    offset = spill.tell()
    raw.tofile(spill)
    spill.write(bytes(pad(raw.nbytes) - raw.nbytes))      # each tensor's data starts aligned
    return name, dims, type_name, offset, raw.nbytes


def _rope_freqs(config: ModelConfig) -> torch.Tensor | None:
    """The rope_freqs vector llama.cpp reads for a llama3 rope_scaling (frequency divisors), or None."""
    rs = config.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) != "llama3":
        return None
    factors = rs.get("freq_factors")
    if factors is None:
        factors = reader.llama3_freq_factors(config.rope_theta, config.head_dim, rs)
    return torch.as_tensor(np.asarray(factors, dtype=np.float32))


def _qk_permutation(name: str, config: ModelConfig) -> torch.Tensor | None:
    """Row order convert_hf_to_gguf's `permute` gives llama q/k (inverse of the reader's unpermute)."""
    role = name.split(".")[2] if name.startswith("blk.") else ""
    if role not in ("attn_q", "attn_k"):
        return None
    heads = config.num_attention_heads if role == "attn_q" else config.num_key_value_heads
    rows = heads * config.head_dim
    return torch.argsort(reader.qk_unpermute_index(rows, heads))


def _assemble(path: str, arch: str, metadata: dict[str, Any], infos: list[tuple], spill) -> None:
    """The header (general.architecture first, as GGUFWriter puts it), then the spilled data as it lies."""
    ti = [(name, dims, GGML_TYPES_BY_NAME[type_name].id, offset) for name, dims, type_name, offset, _ in infos]
    spill.flush()
    head = encode_header({"general.architecture": arch, **metadata}, ti)
    size = spill.seek(0, os.SEEK_END)
    with open(path, "wb") as out:
        out.write(head)
        out.flush()
        done = 0
        try:                                     # in the kernel: no pass of the data through Python
            while done < size:
                n = os.copy_file_range(spill.fileno(), out.fileno(), size - done, done)
                assert n > 0, "the spill file shrank while it was copied"
                done += n
        except (AttributeError, OSError):        # no copy_file_range here: carry on through a buffer
            spill.seek(done)
            out.seek(len(head) + done)
            shutil.copyfileobj(spill, out, 1 << 24)


# --- metadata -----------------------------------------------------------------------------------
def _metadata(ckpt: Checkpoint, arch: str, ggml_type: str | None, name: str | None) -> dict[str, Any]:
    c = ckpt.config
    a = arch
    meta: dict[str, Any] = {"general.name": name or Path(ckpt.path).stem,
                            f"{a}.context_length": c.max_position_embeddings, f"{a}.embedding_length": c.hidden_size,
                            f"{a}.block_count": c.num_hidden_layers, f"{a}.feed_forward_length": c.intermediate_size,
                            f"{a}.attention.head_count": c.num_attention_heads,
                            f"{a}.attention.head_count_kv": c.num_key_value_heads,
                            f"{a}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
                            f"{a}.rope.freq_base": float(c.rope_theta), f"{a}.rope.dimension_count": c.head_dim,
                            f"{a}.vocab_size": c.vocab_size}
    if c.head_dim * c.num_attention_heads != c.hidden_size:
        meta[f"{a}.attention.key_length"] = meta[f"{a}.attention.value_length"] = c.head_dim
    if c.sliding_window:
        meta[f"{a}.attention.sliding_window"] = c.sliding_window
    rs = c.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind in ("linear", "yarn"):
        meta[f"{a}.rope.scaling.type"] = kind
        meta[f"{a}.rope.scaling.factor"] = float(rs["factor"])
        if "original_max_position_embeddings" in rs:
            meta[f"{a}.rope.scaling.original_context_length"] = int(rs["original_max_position_embeddings"])
    elif kind not in (None, "default", "llama3"):
        raise UnsupportedError(f"GGUF writer: rope_scaling type {kind!r} is not supported")
    ftype = None if ggml_type is None else {t.lower(): v for t, v in FILE_TYPES.items()}.get(ggml_type.strip().lower())
    if ftype is None:
        ftype = ckpt.quant_config.get("file_type") if ckpt.format == "gguf" else 1
    if ftype is not None:
        meta["general.file_type"] = int(ftype)
    meta["general.quantization_version"] = 2
    meta.update(_vocab(ckpt))
    template = ckpt.chat_template or getattr(ckpt.tokenizer, "chat_template", None)
    if isinstance(template, str):
        meta["tokenizer.chat_template"] = template
    return meta


def _vocab(ckpt: Checkpoint) -> dict[str, Any]:
    """Tokenizer entries: copied from a GGUF source file, else built from ckpt.tokenizer (or none)."""
    if ckpt.format == "gguf" and Path(ckpt.path).is_file():
        source = getattr(ckpt.tensors, "file", None)            # the GgufFile load_gguf parsed: no second read
        source = source if isinstance(source, GgufFile) and source.path == Path(ckpt.path) else read_gguf(ckpt.path)
        copied = copied_vocab(source.metadata)
        if "tokenizer.ggml.model" in copied:
            return copied
    if ckpt.tokenizer is None:
        return {}
    return vocab_metadata(ckpt.tokenizer, ckpt.config.vocab_size)
