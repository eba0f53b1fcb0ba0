"""Fuzzing config.json and quantization-config parsing: ModelConfig (hf.model_config_from_hf), detect.py,
and the AWQ, GPTQ, bitsandbytes, FP8 and compressed-tensors settings readers, through the real loaders.

Seeds are the committed checkpoints of tests/fixtures/{awq,gptq,bnb,fp8,ct} (written by the reference
tools). A mutation edits their config.json as a JSON tree: a value anywhere (top level, inside
quantization_config, its config_groups, rope_parameters) replaced by another type, a huge, negative,
NaN or infinite number, or nested garbage; keys deleted or added from the names the readers look up.
The checkpoint directory is rebuilt beside it with the weight files linked, loaded with
`quanta.loaders.load`, and a few tensors (each family's quantized layers among them) read; the property
is that of tests/fuzz_support.py.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import shutil
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from fuzz_support import FUZZ, fuzz_dir, loads_or_refuses
from quanta.loaders import load

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = ("awq", "gptq", "bnb", "fp8", "ct")
_DIR = fuzz_dir("cfg")
READ = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight",
        "model.norm.weight")

KEYS = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
        "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
        "hidden_act", "use_sliding_window", "sliding_window", "layer_types", "max_window_layers", "dtype",
        "torch_dtype", "bos_token_id", "eos_token_id", "quantization_config",
        # quantization_config, config_groups and their weights
        "quant_method", "bits", "w_bit", "group_size", "q_group_size", "version", "format", "zero_point",
        "modules_to_not_convert", "checkpoint_format", "is_marlin_format", "pack_dtype", "sym", "desc_act",
        "quant_algo", "exclude_modules", "ignored_layers", "ignore", "weight_block_size", "activation_scheme",
        "config_groups", "sparsity_config", "targets", "weights", "num_bits", "strategy", "type", "symmetric",
        "block_structure", "input_activations", "dynamic", "kv_cache_scheme", "rope_type", "factor"]
EDGE = [0, 1, -1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 2**31, 2**40, 2**63, 10**30, -2**40, 0.5, 1e308, -1e308,
        math.inf, -math.inf, math.nan, True, False, None, "", "4", "gemm", "gemv", "gptq", "gptq_v2", "awq",
        "fp8", "int", "float", "group", "channel", "tensor", "block", "Linear", "re:.*", "re:(", "re:[",
        "pack-quantized", "naive-quantized", "float-quantized", "linear", "llama3", "yarn", "float16",
        "bfloat16", "torch.float16", "silu", "gelu", "full_attention", "sliding_attention",
        "LlamaForCausalLM", "Qwen2ForCausalLM", "BertModel", "modelopt", "compressed-tensors", "bitsandbytes"]
SCALARS = st.one_of(st.sampled_from(EDGE), st.integers(), st.floats(), st.text(max_size=6))
JSON_ANY = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)),
                        max_leaves=10)


def variants() -> list[Path]:
    return sorted(p for f in FAMILIES for p in (FIXTURES / f).iterdir() if (p / "config.json").is_file())


@functools.cache
def seed_config(variant: Path) -> dict[str, Any]:
    return json.loads((variant / "config.json").read_text())


def paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into the dicts and lists of `tree` (the root's children and below)."""
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    for k, v in items:
        out.append(prefix + (k,))
        out += paths(v, prefix + (k,))
    return out


@st.composite
def edited(draw, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with one to four edits anywhere in its tree."""
    cfg = copy.deepcopy(cfg)
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(paths(cfg) or [("vocab_size",)]))
        parent = cfg
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["set", "set", "set", "delete", "add"]))
        if op == "set":
            parent[path[-1]] = draw(JSON_ANY)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYS))] = draw(JSON_ANY)
    return cfg


@st.composite
def mutated(draw) -> tuple[Path, dict[str, Any]]:
    """(a fixture checkpoint, an edit of its config.json)."""
    variant = draw(st.sampled_from(variants()))
    return variant, draw(edited(seed_config(variant)))


def check(case: tuple[Path, dict[str, Any]]) -> Exception | None:
    """The property for one edited config; a failing directory is kept as _DIR/failing/."""
    variant, cfg = case
    ckpt = _DIR / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir()
    for f in variant.iterdir():
        if f.name != "config.json":
            (ckpt / f.name).symlink_to(f.resolve())
    text = json.dumps(cfg, allow_nan=True)
    (ckpt / "config.json").write_text(text)

    def run():
        ck = load(ckpt, tokenizer=False)
        for name in READ:
            if name in ck.tensors:
                ck.tensors[name]
    try:
        return loads_or_refuses("configs", run, len(text))
    except BaseException:
        shutil.rmtree(_DIR / "failing", ignore_errors=True)
        shutil.copytree(ckpt, _DIR / "failing", symlinks=True)
        raise


def test_seeds_load():
    """Every unedited fixture loads, and its tensors read, so the fuzz starts from accepted configs."""
    for variant in variants():
        assert check((variant, seed_config(variant))) is None, variant


@FUZZ
@given(case=mutated())
def test_fuzz_configs(case):
    check(case)
