"""Which GGML type each weight of a GGUF model has: read from a file's header, or assigned as
llama.cpp's llama-quantize assigns them (llama_tensor_get_type, roughly) for a type name.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from quanta.loaders.checkpoint import ModelConfig
from quanta.quant.errors import ConfigError
from quanta.quant.ggml.types import GGML_TYPES_BY_NAME, QK_K

ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
MIXES = {"q3_k_m": "q3_K", "q4_k_m": "q4_K", "q5_k_m": "q5_K"}
MIXED_TYPES = ("q2_k", "iq4_nl", "iq4_xs")     # type names llama-quantize gives some tensors other types too
K_FALLBACK = {"q2_K": "q4_0", "q3_K": "q4_0", "q4_K": "q5_0", "q5_K": "q5_1", "q6_K": "q8_0", "iq4_xs": "iq4_nl"}
WEIGHT_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K",
                "iq4_nl", "iq4_xs")


@dataclass(frozen=True, eq=False)
class GgufTypes:
    """GGML type name by (role, layer); the embedding is ("token_embd", None), the lm_head ("output", None)."""
    name: str
    types: dict[tuple[str, int | None], str] = field(repr=False)

    def of(self, role: str, layer: int | None = None) -> str:
        return self.types[(role, layer)]

    def all_of(self, role: str) -> list[str]:
        """The distinct types of `role` over the layers."""
        return sorted({t for (r, _), t in self.types.items() if r == role})

    def roles(self) -> set[str]:
        return {r for r, _ in self.types}

    def of_tensor(self, gguf_name: str) -> str | None:
        """The type of GGUF tensor `gguf_name` ("blk.3.attn_v.weight", "output.weight"), or None for a
        tensor the mix does not assign (norms, biases: llama-quantize keeps those as they are)."""
        base, _, suffix = gguf_name.rpartition(".")
        parts = base.split(".")
        if suffix != "weight":
            return None
        if len(parts) == 1:
            return self.types.get((parts[0], None))
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            return self.types.get((parts[2], int(parts[1])))
        return None


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's choice of layers that get more bits in the _M mixes (integer division as in C)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def is_mix(spec: str) -> bool:
    """Whether llama-quantize gives `spec`'s weights more than one type (the _M mixes, Q2_K, IQ4_NL, IQ4_XS)."""
    return spec.strip().lower() in MIXES or spec.strip().lower() in MIXED_TYPES


def _tensor_type(mix: str, t: str, role: str, layer: int, layers: int, gqa: int, imatrix: bool) -> str:
    """llama_tensor_get_type's rules for a Llama-style model: the type of `role` in `layer` for type or mix `mix`
    whose base type is `t`."""
    if mix in ("q4_0", "q5_0") and role == "ffn_down" and layer < layers // 8 and imatrix:
        t = {"q4_0": "q4_1", "q5_0": "q5_1"}[mix]
    elif mix == "q2_k" and role in ("attn_v", "attn_output", "ffn_down"):
        t = "q4_K" if role == "attn_v" and gqa >= 4 else "q3_K"
    elif mix in ("iq4_nl", "iq4_xs") and role == "attn_v" and gqa >= 4:
        t = "q5_K"
    elif mix in ("iq4_nl", "iq4_xs") and role == "ffn_down" and layer < layers // 8 and not imatrix:
        t = "q5_K"
    elif mix in ("q4_k_m", "q5_k_m") and role in ("attn_v", "ffn_down") and use_more_bits(layer, layers):
        t = "q6_K"
    elif mix == "q3_k_m" and role == "attn_v":
        t = "q5_K" if layer < 2 else "q4_K"
    elif mix == "q3_k_m" and role == "attn_output":
        t = "q4_K"
    elif mix == "q3_k_m" and role == "ffn_down":
        t = "q5_K" if layer < layers // 16 else "q4_K"
    if is_mix(mix) and role == "attn_v" and layers == 80 and t in ("q3_K", "q4_K"):
        t = "q5_K"
    return t


def _fits(t: str, k: int) -> str:
    """t, or llama-quantize's fallback when its blocks do not tile rows of k."""
    if t in K_FALLBACK and k % QK_K:
        t = K_FALLBACK[t]
    if k % GGML_TYPES_BY_NAME[t].block_size:
        t = "f16"
    return t


def assign(spec: str, config: ModelConfig, imatrix: bool = False) -> GgufTypes:
    """The types llama-quantize gives `config`'s weights for type or mix `spec` (e.g. "Q4_K_M", "q8_0").

    A plain type (Q4_0, Q8_0, Q4_K, Q6_K, ...) quantizes every weight matrix to it, except the output
    tensor (the lm_head, or the tied embedding), which llama-quantize makes Q6_K unless the type is Q8_0.
    The mixes follow llama-quantize's rules for Llama-style models:
      Q4_K_M / Q5_K_M: Q4_K / Q5_K, with attn_v and ffn_down in Q6_K on the layers `use_more_bits` picks
        (the first and last eighth, and every third between);
      Q3_K_M: Q3_K, attn_v Q5_K on the first two layers and Q4_K after, attn_output Q4_K, ffn_down Q5_K on
        the first sixteenth of the layers and Q4_K after;
      Q2_K: Q2_K, attn_v Q4_K (4 or more query heads a KV head) or Q3_K, attn_output and ffn_down Q3_K;
      IQ4_NL / IQ4_XS: attn_v Q5_K with 4 or more query heads a KV head, ffn_down Q5_K on the first eighth of
        the layers unless an importance matrix is given;
      80-layer models (70B) take attn_v at Q5_K where the rules say Q3_K or Q4_K.
    A K-quant whose 256-element blocks do not tile a row falls back as llama-quantize does
    (Q2_K / Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL), and a type whose
    32-element blocks do not tile it either becomes F16. With an importance matrix (`imatrix`), Q4_0 and Q5_0
    take ffn_down of the first eighth of the layers in Q4_1 / Q5_1, as llama-quantize does."""
    key = spec.strip().lower()
    plain = {t.lower(): t for t in WEIGHT_TYPES}
    if key not in MIXES and key not in plain:
        raise ConfigError(f"gguf:{spec}: not a GGUF weight type or mix (known: "
                          f"{', '.join(t.upper() for t in (*WEIGHT_TYPES, *MIXES))})")
    layers, h = config.num_hidden_layers, config.hidden_size
    gqa = config.num_attention_heads // config.num_key_value_heads
    k_of = {"attn_output": config.num_attention_heads * config.head_dim, "ffn_down": config.intermediate_size}
    base = MIXES.get(key, plain.get(key))
    types: dict[tuple[str, int | None], str] = {}
    for i in range(layers):
        for role in ROLES:
            types[(role, i)] = _fits(_tensor_type(key, base, role, i, layers, gqa, imatrix), k_of.get(role, h))
    quantized = GGML_TYPES_BY_NAME[base].block_size > 1
    output = "q6_K" if quantized and base != "q8_0" else base
    types[("output", None)] = _fits(output, h)
    types[("token_embd", None)] = types[("output", None)] if config.tie_word_embeddings else _fits(base, h)
    return GgufTypes(f"gguf:{spec.strip().upper()}", types)


def from_file(name: str, tensor_types: dict[str, str]) -> GgufTypes:
    """The types of a GGUF file's weights, from {GGUF tensor name: type name}; a file without an output
    tensor ties the lm_head to token_embd."""
    types: dict[tuple[str, int | None], str] = {}
    for tensor, t in tensor_types.items():
        base, _, suffix = tensor.rpartition(".")
        if suffix != "weight":
            continue
        if base in ("token_embd", "output"):
            types[(base, None)] = t
            continue
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in ROLES:
            types[(parts[2], int(parts[1]))] = t
    if ("token_embd", None) not in types:
        raise ConfigError(f"{name}: the GGUF file has no token_embd.weight")
    types.setdefault(("output", None), types[("token_embd", None)])
    return GgufTypes(name, types)
