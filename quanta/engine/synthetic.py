"""Synthetic checkpoints: real model shapes, random weights built in memory (vLLM's dummy load format),
for speed and memory work without downloads.

    LLM(model="synthetic:llama3-8b:w4g128")      # shape : weight format [: seed]

Formats: fp16 | bf16 (dense), wNgG (affine N-bit, groups of G, symmetric, e.g. w4g128, w8g128),
wN (per-channel). Embedding and lm_head stay fp16, as quantized checkpoints usually keep them.
Tensors are generated on first access, directly on the target device, so the full-precision model
never exists. There is no tokenizer: prompts are token ids.
"""
from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.quant.errors import ConfigError
from quanta.quant.kinds.affine import Affine

PREFIX = "synthetic:"
SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      max_position_embeddings=8192, rms_norm_eps=1e-5),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
                       max_position_embeddings=8192, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5),
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def is_synthetic(model: str) -> bool:
    """Whether `model` names a synthetic model (`synthetic:...`)."""
    return str(model).startswith(PREFIX)


def parse(spec: str) -> tuple[str, str, int]:
    """`synthetic:shape[:format[:seed]]` -> (shape, format, seed), checked."""
    parts = spec[len(PREFIX):].split(":")
    shape, fmt = parts[0], parts[1] if len(parts) > 1 else "fp16"
    seed = int(parts[2]) if len(parts) > 2 else 0
    if shape not in SHAPES:
        raise ConfigError(f"{spec}: unknown synthetic shape {shape!r} (known: {', '.join(SHAPES)})")
    if fmt not in ("fp16", "bf16") and not re.fullmatch(r"w[2-8](g\d+)?", fmt):
        raise ConfigError(f"{spec}: unknown synthetic format {fmt!r} (fp16, bf16, w4g128, w8, ...)")
    return shape, fmt, seed


class SyntheticTensors(Mapping):
    """name -> a random tensor or Affine QTensor, made on access (deterministic per name and seed)."""

    def __init__(self, config: ModelConfig, fmt: str, seed: int, device: torch.device):
        self.config, self.fmt, self.seed, self.device = config, fmt, seed, torch.device(device)
        c = config
        kv = c.num_key_value_heads * c.head_dim
        out_in = {"self_attn.q_proj": (c.num_attention_heads * c.head_dim, c.hidden_size),
                  "self_attn.k_proj": (kv, c.hidden_size), "self_attn.v_proj": (kv, c.hidden_size),
                  "self_attn.o_proj": (c.hidden_size, c.num_attention_heads * c.head_dim),
                  "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
                  "mlp.up_proj": (c.intermediate_size, c.hidden_size),
                  "mlp.down_proj": (c.hidden_size, c.intermediate_size)}
        self.shapes: dict[str, tuple[tuple[int, ...], str]] = {
            "model.embed_tokens.weight": ((c.vocab_size, c.hidden_size), "embed"),
            "model.norm.weight": ((c.hidden_size,), "norm"),
            "lm_head.weight": ((c.vocab_size, c.hidden_size), "dense"),
        }
        for i in range(c.num_hidden_layers):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                self.shapes[f"model.layers.{i}.{norm}.weight"] = ((c.hidden_size,), "norm")
            for name in LINEARS:
                self.shapes[f"model.layers.{i}.{name}.weight"] = (out_in[name], "linear")

    def __len__(self) -> int:
        return len(self.shapes)

    def __iter__(self):
        return iter(self.shapes)

    def __getitem__(self, name: str):
        shape, role = self.shapes[name]
        gen = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        dtype = torch.bfloat16 if self.fmt == "bf16" else torch.float16
        if role == "norm":
            return (1 + 0.1 * torch.rand(shape, generator=gen, device=self.device)).to(dtype)
        # Dense tensors are drawn in their own dtype and scaled in place: no float32 copy of a 128k-row
        # embedding exists, so a synthetic load's transient memory is a real checkpoint's.
        if role == "embed":
            return torch.randn(shape, generator=gen, device=self.device, dtype=dtype)
        std = shape[1] ** -0.5
        if role == "dense" or self.fmt in ("fp16", "bf16"):
            return torch.randn(shape, generator=gen, device=self.device, dtype=dtype).mul_(std)
        match = re.fullmatch(r"w(\d)(?:g(\d+))?", self.fmt)
        bits, group = int(match[1]), int(match[2] or shape[1])
        n, k = shape
        codes = torch.randint(0, 2 ** bits, shape, generator=gen, device=self.device, dtype=torch.uint8)
        code_std = ((4 ** bits - 1) / 12) ** 0.5            # std of a uniform code
        scales = (std / code_std) * (0.9 + 0.2 * torch.rand(n, -(-k // group), generator=gen, device=self.device))
        return Affine(codes=codes, scales=scales.to(torch.float16), bits=bits, group_size=group,
                      zeros=2 ** (bits - 1))


def load_synthetic(spec: str, device: torch.device | str) -> Checkpoint:
    """A Checkpoint with the spec's shapes whose tensors are made on first access, on `device`."""
    shape, fmt, seed = parse(spec)
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
    config = ModelConfig(model_type="llama", torch_dtype=dtype, **SHAPES[shape])
    return Checkpoint(path=Path(spec), format="synthetic", config=config,
                      tensors=SyntheticTensors(config, fmt, seed, device), tokenizer=None,
                      quant_config={"synthetic": fmt})
