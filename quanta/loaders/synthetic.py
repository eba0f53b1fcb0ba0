"""Synthetic checkpoints: real model shapes, random weights built in memory (vLLM's dummy load format),
for speed and memory work without downloads.

    LLM(model="synthetic:llama3-8b:w4g128")      # shape : weight format [: seed]

Formats: fp16 | bf16 (dense), wNgG (affine N-bit, groups of G, symmetric, e.g. w4g128, w8g128),
wN (per-channel), wNgGact (act-order: a random g_idx permutation, as GPTQ desc_act writes), nf4
(bitsandbytes blocks of 64), fp8 (e4m3, per-channel scales), fp8bB (B x B block scales) and gguf-TYPE
(ggml blocks of TYPE, e.g. gguf-q4_K, gguf-q8_0; random codes, sane scales) -- the kinds tensor
parallelism cuts. Embedding and lm_head stay fp16, as quantized checkpoints usually keep them (an affine format
with -head, e.g. w4g128-head, holds the lm_head in that format too). Tensors are generated on first access,
directly on the target device, so the full-precision model never exists. There is no tokenizer: prompts are ids.
"""
from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch

from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders.detection import SYNTHETIC_PREFIX as PREFIX
from quanta.loaders.hf import canonical_shapes
from quanta.loaders.gguf.mix import MIXES, assign
from quanta.loaders.gguf.writer import gguf_name
from quanta.loaders.shapes import KNOWN_MODELS
from quanta.loaders.weight_format import WeightFormat, affine_format, dense_format
from quanta.quant.errors import ConfigError
from quanta.quant.ggml.types import GGML_TYPES_BY_NAME
from quanta.quant.kinds import NF4_TABLE, Affine, Codebook, Fp8, Gguf

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      max_position_embeddings=8192, rms_norm_eps=1e-5),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
                       max_position_embeddings=8192, rms_norm_eps=1e-5),
    # one rank's share of llama3-70b at tensor-parallel size 4 (16 query and 2 KV heads, a quarter of the MLP and
    # of the vocabulary) as a whole model: one rank's decode work on one GPU, without the all-reduces
    "llama3-70b-rank-of-4": dict(vocab_size=32064, hidden_size=8192, intermediate_size=7168, num_hidden_layers=80,
                                 num_attention_heads=16, num_key_value_heads=2, head_dim=128, rope_theta=500000.0,
                                 max_position_embeddings=8192, rms_norm_eps=1e-5),
    # big enough for tensor-parallel cuts of 4 on every kind (256-wide K-quant blocks at 2); 8 heads over
    # 2 KV heads (replicated at 4 ranks); a vocabulary that 4 ranks pad
    "tiny-tp": dict(vocab_size=510, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5),
    # tiny-tp with an MLP whose 1280 columns cut into pieces of 640 / 320: down_proj's 256-wide ggml blocks and
    # 128-column groups straddle the ranks at tensor-parallel sizes 2 and 4 (o_proj's at 4)
    "tiny-tp-straddle": dict(vocab_size=510, hidden_size=512, intermediate_size=1280, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                             rms_norm_eps=1e-5),
    # a Qwen2-style tiny model: q/k/v biases, tied embeddings
    "tiny-qwen2": dict(model_type="qwen2", attention_bias=True, tie_word_embeddings=True, vocab_size=512,
                       hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5),
}
# Byte offsets of the float16 scale fields in one block of each ggml type synthetic models make:
# random bytes elsewhere are valid codes, random float16 scales could be inf / nan.
GGUF_SCALE_OFFSETS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
                      "q2_K": (80, 82), "q3_K": (108,), "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,),
                      "iq4_nl": (0,), "iq4_xs": (0,)}
# What a unit scale spreads a type's values over, where not its codes' (within 8 in blocks of 32, else 16): IQ4's
# table reaches 127 (about 64 in the mean), and IQ4_XS's sub-block scales (ls - 32) multiply that by up to 32.
GGUF_SPREAD = {"iq4_nl": 64, "iq4_xs": 64 * 16}


HEAD = "-head"          # an affine format's suffix: the lm_head in that format too (GPTQModel's lm_head=True)
AFFINE = re.compile(r"w([2-8])(?:g(\d+)(act|z)?)?")     # wN[gG[act|z]]: bits, group size, act-order or zero points


def is_synthetic(model: str) -> bool:
    """Whether `model` names a synthetic model (`synthetic:...`)."""
    return str(model).startswith(PREFIX)


def parse(spec: str) -> tuple[str, str, int]:
    """`synthetic:shape[:format[:seed]]` -> (shape, format, seed), checked. The shape is one of SHAPES or a
    published one (shapes.KNOWN_MODELS, e.g. llama-3-8b); a GGUF format a type or a llama-quantize mix."""
    parts = spec[len(PREFIX):].split(":")
    shape, fmt = parts[0], parts[1] if len(parts) > 1 else "fp16"
    seed = int(parts[2]) if len(parts) > 2 else 0
    if shape not in SHAPES and shape.lower() not in KNOWN_MODELS:
        raise ConfigError(f"{spec}: unknown synthetic shape {shape!r} (known: {', '.join([*SHAPES, *KNOWN_MODELS])})")
    base = fmt.removesuffix(HEAD)
    gguf = base.removeprefix("gguf-").lower()
    affine = AFFINE.fullmatch(base)
    if (base not in ("fp16", "bf16", "nf4", "fp8") and not affine and not re.fullmatch(r"fp8b\d+", base)
            and not (base.startswith("gguf-") and (gguf in MIXES or base[5:] in GGUF_SCALE_OFFSETS))) \
            or (fmt.endswith(HEAD) and not affine):
        raise ConfigError(f"{spec}: unknown synthetic format {fmt!r} (fp16, bf16, w4g128, w4g128z (zero points), "
                          f"w4g128act, w8, nf4, fp8, fp8b128, gguf-TYPE with TYPE one of "
                          f"{', '.join(GGUF_SCALE_OFFSETS)} or a mix: {', '.join(MIXES)}; an affine format "
                          f"with {HEAD} quantizes the lm_head too, e.g. w4g128{HEAD})")
    return shape, fmt, seed


def model_config(shape: str, fmt: str) -> ModelConfig:
    """The ModelConfig of a synthetic model: the shape's, in float16 (bfloat16 for the bf16 format)."""
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
    known = SHAPES[shape] if shape in SHAPES else KNOWN_MODELS[shape.lower()]
    return ModelConfig(**{"model_type": "llama", **known, "torch_dtype": dtype})


class SyntheticTensors(Mapping):
    """name -> a random tensor or Affine QTensor, made on access (deterministic per name and seed)."""

    def __init__(self, config: ModelConfig, fmt: str, seed: int, device: torch.device):
        self.config, self.seed, self.device = config, seed, torch.device(device)
        self.fmt, self.head_quantized = fmt.removesuffix(HEAD), fmt.endswith(HEAD)
        self.shapes = canonical_shapes(config)
        # GGUF models hold every weight in the type llama-quantize gives it, the embedding and lm_head too
        self.gguf_types = assign(fmt[5:], config) if fmt.startswith("gguf-") else None

    def __len__(self) -> int:
        return len(self.shapes)

    def __iter__(self):
        return iter(self.shapes)

    def __getitem__(self, name: str):
        shape, role = self.shapes[name], _role(name)
        gen = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        dtype = torch.bfloat16 if self.fmt == "bf16" else torch.float16
        if role == "norm":
            return (1 + 0.1 * torch.rand(shape, generator=gen, device=self.device)).to(dtype)
        if role == "bias":
            return (0.02 * torch.randn(shape, generator=gen, device=self.device)).to(dtype)
        std = 1.0 if role == "embed" else shape[1] ** -0.5
        if self.gguf_types is not None:
            t = self.gguf_types.of_tensor(gguf_name(name))
            if t in GGUF_SCALE_OFFSETS:
                return random_gguf(t, shape, std, gen, self.device)
        # Dense tensors are drawn in their own dtype and scaled in place: no float32 copy of a 128k-row
        # embedding exists, so a synthetic load's transient memory is a real checkpoint's.
        if role == "embed" or (role == "dense" and not self.head_quantized) or self.fmt in ("fp16", "bf16") \
                or self.gguf_types is not None:
            return torch.randn(shape, generator=gen, device=self.device, dtype=dtype).mul_(std)
        return quantized_weight(self.fmt, shape, std, gen, self.device, order=self._order(name))

    def _order(self, name: str) -> torch.Generator:
        """The generator of an act-order weight's column order. GPTQ orders a weight's columns by its
        Hessian's diagonal, which comes from the layer's input alone, so weights over one input (q/k/v;
        gate/up) share their g_idx in real checkpoints and stack into one GEMM: so do these."""
        prefix, _, leaf = name.rpartition(".")[0].rpartition(".")
        shared = {"q_proj": "attn_input", "k_proj": "attn_input", "v_proj": "attn_input",
                  "gate_proj": "mlp_input", "up_proj": "mlp_input"}.get(leaf)
        key = f"{prefix}.{shared}" if shared else name
        return torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()) + 1)


def _role(name: str) -> str:
    """How a tensor is drawn: norm, bias, embed, dense (the lm_head, kept dense unless GGUF) or linear."""
    if name == "model.embed_tokens.weight":
        return "embed"
    if name == "lm_head.weight":
        return "dense"
    if name.endswith(".bias"):
        return "bias"
    return "norm" if "norm" in name.rsplit(".", 2)[-2] else "linear"


def quantized_weight(fmt: str, shape: tuple[int, int], std: float, gen: torch.Generator, device: torch.device,
                     order: torch.Generator | None = None):
    """A random weight [N, K] of about `std` in synthetic format `fmt` (not fp16 / bf16); an act-order
    format's column order is drawn from `order` (default `gen`)."""
    n, k = shape
    if fmt.startswith("gguf-"):
        return random_gguf(fmt[5:], shape, std, gen, device)
    if fmt.startswith("fp8"):
        data = (torch.randn(shape, generator=gen, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        if fmt == "fp8":
            return Fp8(data=data, scale=torch.full((n,), std / 64, device=device))
        b = int(fmt[4:])
        blocks = (-(-n // b), -(-k // b))
        scale = (std / 64) * (0.9 + 0.2 * torch.rand(blocks, generator=gen, device=device))
        return Fp8(data=data, scale=scale, block_size=(b, b))
    if fmt == "nf4":
        codes = torch.randint(0, 16, shape, generator=gen, device=device, dtype=torch.uint8)
        absmax = 2 * std * (0.9 + 0.2 * torch.rand(-(-n * k // 64), generator=gen, device=device))
        return Codebook(codes=codes, table=torch.tensor(NF4_TABLE, device=device), blocksize=64, absmax=absmax)
    match = AFFINE.fullmatch(fmt)
    bits, group = int(match[1]), int(match[2] or k)
    codes = torch.randint(0, 2 ** bits, shape, generator=gen, device=device, dtype=torch.uint8)
    code_std = ((4 ** bits - 1) / 12) ** 0.5            # std of a uniform code
    scales = (std / code_std) * (0.9 + 0.2 * torch.rand(n, -(-k // group), generator=gen, device=device))
    if match[3] == "z":                                 # a zero point per group near the codes' middle (AWQ)
        zeros = torch.randint(2 ** (bits - 1) - 2, 2 ** (bits - 1) + 2, scales.shape, generator=gen,
                              device=device, dtype=torch.uint8)
        return Affine(codes=codes, scales=scales.to(torch.float16), bits=bits, group_size=group, zeros=zeros)
    g_idx = None
    if match[3]:
        columns = torch.randperm(k, generator=gen if order is None else order, device=device)
        g_idx = torch.empty(k, dtype=torch.int32, device=device)
        g_idx[columns] = (torch.arange(k, device=device) // group).to(torch.int32)
    return Affine(codes=codes, scales=scales.to(torch.float16), bits=bits, group_size=group,
                  zeros=2 ** (bits - 1), g_idx=g_idx)


def random_gguf(type_name: str, shape: tuple[int, int], std: float, gen: torch.Generator,
                device: torch.device) -> Gguf:
    """Random ggml blocks of `type_name` for a weight [N, K], their float16 scales set to keep values
    near `std` (the codes' own spread is the type's)."""
    t = GGML_TYPES_BY_NAME[type_name]
    n, k = shape
    blocks = torch.randint(0, 256, (n * k // t.block_size, t.type_size), generator=gen, device=device,
                           dtype=torch.uint8)
    step = std / GGUF_SPREAD.get(type_name, 8 if t.block_size == 32 else 16)
    for at in GGUF_SCALE_OFFSETS[type_name]:
        scale = (step * (0.5 + torch.rand(blocks.shape[0], generator=gen, device=device))).to(torch.float16)
        blocks[:, at:at + 2] = scale.view(torch.uint8).view(-1, 2)
    return Gguf(data=blocks.view(n, -1), ggml_type=t.id, shape=shape)


def load_synthetic(spec: str, device: torch.device | str = "cpu") -> Checkpoint:
    """A Checkpoint with the spec's shapes whose tensors are made on first access, on `device`."""
    shape, fmt, seed = parse(spec)
    config = model_config(shape, fmt)
    return Checkpoint(path=Path(spec), format="synthetic", config=config,
                      tensors=SyntheticTensors(config, fmt, seed, device), tokenizer=None,
                      quant_config={"synthetic": fmt})


def weight_format(config: ModelConfig, qc: dict, path: Path | None) -> WeightFormat:
    """What a synthetic model's linear weights are, for the memory plan (its format, `qc["synthetic"]`)."""
    fmt = qc["synthetic"]
    if fmt.endswith(HEAD):
        return replace(weight_format(config, {"synthetic": fmt.removesuffix(HEAD)}, path), lm_head_quantized=True)
    if fmt in ("fp16", "bf16"):
        return dense_format(fmt)
    if fmt == "nf4":
        return WeightFormat("nf4", "codebook", 4, 64)
    if fmt.startswith("fp8"):
        return WeightFormat("fp8", "fp8")
    if fmt.startswith("gguf-"):
        return WeightFormat(f"gguf:{fmt[5:]}", "gguf", gguf=assign(fmt[5:], config))
    match = AFFINE.fullmatch(fmt)
    zeros = match[3] == "z"
    return affine_format("awq" if zeros else "gptq", int(match[1]), int(match[2]) if match[2] else None,
                         symmetric=not zeros, act_order=match[3] == "act")
