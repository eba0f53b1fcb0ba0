"""Can the model take the scheme, and can the output format hold it? Answered before any work.

    check_model(opts, ckpt)     # ConfigError / UnsupportedError naming the tensor and what would work

The scheme is checked against every decoder linear's shape (quantize_model.linear_shapes). For the
checkpoint formats the format's own writer decides: a sample weight of the scheme, one per distinct
linear shape, goes through the writer's Layout (the same convert_quantized and quantization_config
that will write the real weights), so the rules live once, in the writer. For GGUF every weight's
type comes from gguf.mix.assign; a plain type whose blocks do not tile a row is refused (a mix such
as Q4_K_M takes llama-quantize's fallback types instead).
"""
from __future__ import annotations

import torch

from quanta.loaders import formats
from quanta.quant.errors import ConfigError, UnsupportedError
from quanta.quant.kinds import Affine
from quanta.toolkit.quantize.options import QuantizeOptions

# Writer options quantize passes: scales are computed in float32 and stored as the format's float16.
WRITER_OPTIONS = {"awq": {"round_scales": True}, "gptq": {"round_scales": True}}


def writer_options(opts: QuantizeOptions) -> dict:
    """Keyword arguments for the format's writer (GPTQ: format v2 for asymmetric zeros, which may be 0)."""
    kw = dict(WRITER_OPTIONS.get(opts.format, {}))
    if opts.format == "gptq" and not opts.symmetric:
        kw["checkpoint_format"] = "gptq_v2"
    return kw


def check_model(opts: QuantizeOptions, ckpt) -> None:
    """Every check of `opts` against `ckpt` that does not need the weights' values."""
    from quanta.quant.quantize_model import linear_shapes

    cfg = ckpt.config
    shapes = {f"model.layers.0.{n}.weight": s for n, s in linear_shapes(cfg).items()}
    missing = [n for n in (f"model.layers.{i}.{m}.weight" for i in range(cfg.num_hidden_layers)
                           for m in linear_shapes(cfg)) if n not in ckpt.tensors]
    if missing:
        raise ConfigError(f"quantize: {ckpt.path}: no tensor {missing[0]} (and {len(missing) - 1} more)")
    if opts.method == "gguf":
        _check_gguf(opts, cfg)
        return
    if opts.affine:
        from quanta.quant.rtn import check_scheme
        for name, shape in shapes.items():
            check_scheme(name, shape, opts.bits, opts.group_size)
    _check_writer(opts, ckpt, shapes)


def _sample(opts: QuantizeOptions, name: str, shape: tuple[int, int]):
    """A weight of `shape` in the scheme `opts` produces (values irrelevant, layout exact)."""
    n, k = shape
    if opts.affine:
        group = k if opts.group_size in (-1, 0) else opts.group_size
        groups = k // group
        zeros = 1 << (opts.bits - 1) if opts.symmetric else torch.ones(n, groups, dtype=torch.uint8)
        g_idx = (torch.arange(k) // group).to(torch.int32) if opts.act_order and groups > 1 else None
        return Affine(codes=torch.zeros(n, k, dtype=torch.uint8), scales=torch.ones(n, groups), bits=opts.bits,
                      group_size=group, zeros=zeros, g_idx=g_idx)
    if opts.method == "fp8" or opts.scheme == "fp8":
        from quanta.quant.fp8_quant import fp8_weight
        return fp8_weight(torch.zeros(n, k), opts.spec().fp8_strategy, name=name)
    from quanta.quant.codebook_quant import quantize_4bit
    spec = opts.spec()
    return quantize_4bit(torch.zeros(n, k), spec.quant_type, spec.blocksize, spec.double_quant, name=name)


def _check_writer(opts: QuantizeOptions, ckpt, shapes: dict[str, tuple[int, int]]) -> None:
    layout = formats.layout(opts.format, ckpt.config, **writer_options(opts))
    seen = set()
    for name, shape in shapes.items():
        if shape in seen:
            continue
        seen.add(shape)
        try:
            layout.convert(name, _sample(opts, name, shape))
        except UnsupportedError as e:
            raise UnsupportedError(f"quantize: {opts.describe()}: the {opts.format} format cannot hold it: {e}"
                                   f"{_alternatives(opts)}") from None
    layout.quantization_config()


def _alternatives(opts: QuantizeOptions) -> str:
    others = [f for f in formats.quantize_formats(opts.method) if f != opts.format]
    return f" (other formats for {opts.method}: {', '.join(others)})" if others else ""


def _check_gguf(opts: QuantizeOptions, cfg) -> None:
    from quanta.loaders.gguf.mix import assign, is_mix
    from quanta.loaders.gguf.writer import ARCH_OF
    from quanta.quant.ggml.quantize import QUANTIZERS

    if cfg.model_type not in ARCH_OF:
        raise UnsupportedError(f"quantize: the GGUF writer has no architecture for model type {cfg.model_type!r}")
    types = assign(opts.type, cfg)
    wanted = opts.type.strip().lower()
    for (role, layer), t in types.types.items():
        if t not in ("f16", "f32", "bf16") and t not in QUANTIZERS:
            raise UnsupportedError(f"quantize: GGUF type {t} ({role}) cannot be produced by quanta's quantizers")
        if not is_mix(wanted) and role not in ("output", "token_embd") and t.lower() != wanted:
            k = cfg.intermediate_size if role == "ffn_down" else \
                cfg.num_attention_heads * cfg.head_dim if role == "attn_output" else cfg.hidden_size
            raise ConfigError(f"quantize: GGUF {opts.type.upper()} blocks do not tile the rows of "
                              f"blk.{layer}.{role}.weight (K={k}); llama-quantize would write it as "
                              f"{t.upper()}. Use --type {t.upper()} or a mix (Q4_K_M, Q5_K_M) that falls back "
                              "per tensor")
