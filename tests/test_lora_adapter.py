"""quanta.lora.adapter: peft adapter directories and llama.cpp GGUF LoRA files read as float32 A/B pairs.
Oracles: peft's own LoRA modules (A, B and scaling after get_peft_model, rank_pattern / alpha_pattern /
use_rslora included) and, for GGUF, files written with gguf-py's GGUFWriter in convert_lora_to_gguf.py's layout
(gguf-py's tensor name map, LlamaModel.permute applied to lora_b of q and k)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from quanta.loaders.hf import model_config_from_hf
from quanta.lora.adapter import Adapter, LoRAWeights, load_adapter
from quanta.quant.errors import ConfigError, CorruptFileError, ShapeError, UnsupportedError

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama(seed: int = 0, **overrides):
    """A random transformers LlamaForCausalLM: hidden 64, 2 layers, 4 heads / 2 kv heads, vocab 256."""
    from transformers import LlamaConfig, LlamaForCausalLM
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5) | overrides
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


def quanta_config(model):
    return model_config_from_hf(model.config.to_dict(), "tiny")


def peft_adapter(model, path: Path, seed: int = 1, safe: bool = True, **lora):
    """`model` wrapped by peft with LoraConfig(r=8, lora_alpha=16, the seven projections, **lora), lora_B made
    random (peft starts it at zero), saved to `path`: the peft model."""
    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(**({"r": 8, "lora_alpha": 16, "target_modules": SEVEN} | lora))
    pm = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    pm.save_pretrained(str(path), safe_serialization=safe)
    return pm


def peft_modules(pm) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{HF module name: (A, B, scaling)} from peft's own LoRA layers."""
    from peft.tuners.lora import LoraLayer
    out = {}
    for name, m in pm.named_modules():
        if isinstance(m, LoraLayer) and "default" in m.lora_A:
            out[name.removeprefix("base_model.model.")] = (m.lora_A["default"].weight.detach(),
                                                          m.lora_B["default"].weight.detach(), m.scaling["default"])
    return out


def assert_matches_peft(adapter: Adapter, pm) -> None:
    ref = peft_modules(pm)
    assert set(adapter.weights) == set(ref) and len(ref) == 14
    for module, (a, b, scaling) in ref.items():
        w = adapter.weights[module]
        assert w.a.dtype == w.b.dtype == torch.float32
        assert torch.equal(w.a, a.float()) and torch.equal(w.b, b.float()), module
        assert w.scaling == pytest.approx(scaling, rel=1e-12), module
    assert adapter.rank == max(a.shape[0] for a, _, _ in ref.values())
    assert adapter.nbytes() == sum(4 * (a.numel() + b.numel()) for a, b, _ in ref.values())


# --- peft ---------------------------------------------------------------------------------------------
def test_peft_adapter_equals_peft_modules(tmp_path):
    model = tiny_llama()
    pm = peft_adapter(model, tmp_path / "a")
    adapter = load_adapter(tmp_path / "a", quanta_config(model))
    assert isinstance(adapter, Adapter) and adapter.path == tmp_path / "a"
    assert_matches_peft(adapter, pm)
    assert "model.layers.1.mlp.down_proj" in adapter.weights
    assert all(w.scaling == 2.0 for w in adapter.weights.values())
    assert load_adapter(str(tmp_path / "a")).weights.keys() == adapter.weights.keys()     # config optional


def test_rank_and_alpha_patterns_follow_peft(tmp_path):
    model = tiny_llama()
    pm = peft_adapter(model, tmp_path / "a", rank_pattern={"q_proj": 4, "layers.1.mlp.down_proj": 2},
                      alpha_pattern={"v_proj": 3, "model.layers.0.mlp.up_proj": 40})
    adapter = load_adapter(tmp_path / "a", quanta_config(model))
    assert_matches_peft(adapter, pm)
    w = adapter.weights
    assert w["model.layers.0.self_attn.q_proj"].a.shape == (4, 64) and w["model.layers.0.self_attn.q_proj"].scaling == 4
    assert w["model.layers.1.mlp.down_proj"].rank == 2 and w["model.layers.0.mlp.down_proj"].rank == 8
    assert w["model.layers.1.self_attn.v_proj"].scaling == 3 / 8 and w["model.layers.0.mlp.up_proj"].scaling == 5
    assert adapter.rank == 8


def test_rslora_scaling_and_bin_weights(tmp_path):
    model = tiny_llama()
    pm = peft_adapter(model, tmp_path / "a", use_rslora=True, safe=False)
    assert (tmp_path / "a" / "adapter_model.bin").is_file()
    adapter = load_adapter(tmp_path / "a")
    assert_matches_peft(adapter, pm)
    assert adapter.weights["model.layers.0.self_attn.o_proj"].scaling == pytest.approx(16 / math.sqrt(8))


def test_adapter_name_in_tensor_names_and_bare_decoder_prefix(tmp_path):
    from safetensors.torch import load_file, save_file
    model = tiny_llama()
    pm = peft_adapter(model, tmp_path / "a")
    file = tmp_path / "a" / "adapter_model.safetensors"
    state = load_file(str(file))
    renamed = {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
               .replace("base_model.model.model.layers", "base_model.model.layers"): v for k, v in state.items()}
    save_file(renamed, str(file))
    assert_matches_peft(load_adapter(tmp_path / "a", quanta_config(model)), pm)


# --- peft refusals ------------------------------------------------------------------------------------
def _edit_config(path: Path, **changes) -> None:
    file = path / "adapter_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such LoRA adapter"):
        load_adapter(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        load_adapter(tmp_path / "empty")
    (tmp_path / "other.txt").write_text("hello")
    with pytest.raises(ConfigError, match="not a LoRA adapter"):
        load_adapter(tmp_path / "other.txt")
    model = tiny_llama()
    a = tmp_path / "a"
    peft_adapter(model, a)
    (a / "adapter_model.safetensors").rename(tmp_path / "weights.safetensors")
    with pytest.raises(ConfigError, match="no adapter weights"):
        load_adapter(a)
    (a / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CorruptFileError, match="adapter_model.safetensors"):
        load_adapter(a)
    (tmp_path / "weights.safetensors").rename(a / "adapter_model.safetensors")
    text = (a / "adapter_config.json").read_text()
    (a / "adapter_config.json").write_text(text[:-20])
    with pytest.raises(CorruptFileError, match="adapter_config.json: not valid JSON"):
        load_adapter(a)
    (a / "adapter_config.json").write_text(text)
    for field, value, match in [("r", 0, "r must be a positive integer"), ("lora_alpha", "x", "lora_alpha"),
                                ("rank_pattern", {"q_proj": -1}, "rank_pattern"), ("peft_type", "LOHA", "LOHA")]:
        _edit_config(a, **{field: value})
        with pytest.raises(ConfigError if field != "peft_type" else UnsupportedError, match=match):
            load_adapter(a)
        (a / "adapter_config.json").write_text(text)
    _edit_config(a, r=4)                                                  # the tensors say 8
    with pytest.raises(ShapeError, match="rank 8.*r=4"):
        load_adapter(a)


def test_unpaired_and_foreign_tensors(tmp_path):
    from safetensors.torch import load_file, save_file
    model = tiny_llama()
    a = tmp_path / "a"
    peft_adapter(model, a)
    file = a / "adapter_model.safetensors"
    state = load_file(str(file))
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    save_file({k: v for k, v in state.items() if k != key}, str(file))
    with pytest.raises(CorruptFileError, match="k_proj has lora_A but not lora_B"):
        load_adapter(a)
    fused = {k.replace("self_attn.q_proj", "self_attn.qkv_proj"): v for k, v in state.items()}
    save_file(fused, str(file))
    with pytest.raises(UnsupportedError, match="'model.layers.0.self_attn.qkv_proj' is not one quanta supports"):
        load_adapter(a)
    save_file(state | {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": torch.zeros(64)}, str(file))
    with pytest.raises(UnsupportedError, match="bias on lora_B"):
        load_adapter(a)


def test_base_model_that_does_not_fit(tmp_path):
    model = tiny_llama()
    peft_adapter(model, tmp_path / "a")
    with pytest.raises(ConfigError, match="has 1 layers"):
        load_adapter(tmp_path / "a", quanta_config(tiny_llama(num_hidden_layers=1)))
    with pytest.raises(ShapeError, match="do not fit the base weight"):
        load_adapter(tmp_path / "a", quanta_config(tiny_llama(intermediate_size=96)))


@pytest.mark.parametrize("lora, model_kw, match", [
    ({"use_dora": True}, {}, "DoRA"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, {}, "embedding"),
    ({"target_modules": ["q_proj", "lm_head"]}, {}, "embedding or the lm_head"),
    ({"modules_to_save": ["lm_head"]}, {}, "modules_to_save"),
    ({"bias": "all"}, {"attention_bias": True}, "trained biases"),
    ({"lora_bias": True}, {"attention_bias": True}, "lora_bias"),
])
def test_peft_features_quanta_cannot_apply_are_refused(tmp_path, lora, model_kw, match):
    model = tiny_llama(**model_kw)
    peft_adapter(model, tmp_path / "a", **lora)
    with pytest.raises(UnsupportedError, match=match) as e:      # quanta runs no llama with attention_bias
        load_adapter(tmp_path / "a", None if model_kw else quanta_config(model))
    assert str(tmp_path / "a") in str(e.value)


def test_bias_all_without_biases_loads(tmp_path):
    model = tiny_llama()
    pm = peft_adapter(model, tmp_path / "a", bias="all")       # llama has no biases: nothing trained, nothing saved
    assert_matches_peft(load_adapter(tmp_path / "a", quanta_config(model)), pm)


# --- GGUF ---------------------------------------------------------------------------------------------
def llama_cpp_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.permute, which convert_lora_to_gguf applies to lora_b of q and k."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf_lora(path: Path, pm, *, arch: str = "llama", alpha: float = 16.0, kind: str = "f32",
                    heads: tuple[int, int] | None = (4, 2), meta: dict | None = None, extra=()) -> Path:
    """peft model `pm`'s adapter as convert_lora_to_gguf.py writes it. kind: f32 | f16 | bf16 | q8_0 (lora_a in
    Q8_0; lora_b, whose rows of `rank` values are not whole Q8_0 blocks, in F16 as the converter falls back).
    heads: the (q, kv) heads lora_b of q / k is permuted with (None: not permuted, as for qwen2)."""
    import gguf
    from gguf.quants import quantize
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, value in (meta or {}).items():
        w.add_key_value(key, value, gguf.GGUFValueType.UINT32 if isinstance(value, int) else gguf.GGUFValueType.STRING)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    for module, (a, b, _) in peft_modules(pm).items():
        base = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if heads is not None and module.endswith("q_proj"):
            b = llama_cpp_permute(b, heads[0], heads[0])
        elif heads is not None and module.endswith("k_proj"):
            b = llama_cpp_permute(b, heads[0], heads[1])
        for suffix, t in ((".lora_a", a.float().numpy()), (".lora_b", b.float().numpy())):
            if kind == "q8_0" and suffix == ".lora_a":
                w.add_tensor(base + suffix, quantize(t, gguf.GGMLQuantizationType.Q8_0),
                             raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            elif kind == "bf16":
                w.add_tensor(base + suffix, quantize(t, gguf.GGMLQuantizationType.BF16),
                             raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                w.add_tensor(base + suffix, t.astype(np.float32 if kind == "f32" else np.float16))
    for name, t in extra:
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _dequantized(t: torch.Tensor, kind: str, is_a: bool) -> torch.Tensor:
    """What a tensor becomes once stored as `kind` (the gguf package's own round trip)."""
    import gguf
    from gguf.quants import dequantize, quantize
    x = t.float().numpy()
    if kind == "f32":
        return torch.from_numpy(x)
    if kind == "bf16" or (kind == "q8_0" and is_a):
        qt = gguf.GGMLQuantizationType.BF16 if kind == "bf16" else gguf.GGMLQuantizationType.Q8_0
        return torch.from_numpy(dequantize(quantize(x, qt), qt).astype(np.float32))
    return torch.from_numpy(x.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0"])
def test_gguf_adapter_equals_peft_after_unpermuting(tmp_path, kind):
    model = tiny_llama()
    pm = peft_adapter(model, tmp_path / "a")
    file = write_gguf_lora(tmp_path / "lora.gguf", pm, kind=kind)
    adapter = load_adapter(file, quanta_config(model))
    ref = peft_modules(pm)
    assert set(adapter.weights) == set(ref)
    for module, (a, b, scaling) in ref.items():
        w = adapter.weights[module]
        assert torch.equal(w.a, _dequantized(a, kind, True)), module
        assert torch.equal(w.b, _dequantized(b, kind, False)), module      # q / k rows back in HF order
        assert w.scaling == scaling == 2.0
    if kind == "f32":
        assert_matches_peft(adapter, pm)


def test_gguf_adapter_head_counts_scale_and_arch(tmp_path):
    model = tiny_llama()
    pm = peft_adapter(model, tmp_path / "a")
    plain = write_gguf_lora(tmp_path / "plain.gguf", pm)
    with pytest.raises(ConfigError, match="needs the base model's config"):
        load_adapter(plain)
    meta = {"llama.attention.head_count": 4, "llama.attention.head_count_kv": 2}
    assert_matches_peft(load_adapter(write_gguf_lora(tmp_path / "m.gguf", pm, meta=meta)), pm)
    no_alpha = load_adapter(write_gguf_lora(tmp_path / "z.gguf", pm, alpha=0.0), quanta_config(model))
    assert all(w.scaling == 1.0 for w in no_alpha.weights.values())           # llama.cpp: alpha 0 -> scale 1
    qwen = load_adapter(write_gguf_lora(tmp_path / "q.gguf", pm, arch="qwen2", heads=None))   # qwen2: unpermuted
    assert_matches_peft(qwen, pm)
    with pytest.raises(ConfigError, match="adapter for qwen2 models; the base model is llama"):
        load_adapter(tmp_path / "q.gguf", quanta_config(model))


def test_gguf_refusals(tmp_path):
    import gguf
    model = tiny_llama()
    pm = peft_adapter(model, tmp_path / "a")
    cfg = quanta_config(model)
    norm = write_gguf_lora(tmp_path / "n.gguf", pm, extra=[("blk.0.attn_norm.weight", np.ones(64, np.float32))])
    with pytest.raises(UnsupportedError, match="'blk.0.attn_norm.weight' is not a LoRA"):
        load_adapter(norm, cfg)
    emb = write_gguf_lora(tmp_path / "e.gguf", pm, extra=[("token_embd.weight.lora_a", np.ones((8, 256), np.float32)),
                                                          ("token_embd.weight.lora_b", np.ones((64, 8), np.float32))])
    with pytest.raises(UnsupportedError, match="embedding or the lm_head"):
        load_adapter(emb, cfg)
    w = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.ones((64, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="not a LoRA adapter"):
        load_adapter(tmp_path / "model.gguf", cfg)
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "n.gguf").read_bytes()[:600])
    with pytest.raises(CorruptFileError):
        load_adapter(tmp_path / "cut.gguf", cfg)


def test_lora_weights_are_frozen():
    w = LoRAWeights(torch.zeros(2, 3), torch.zeros(4, 2), 1.0)
    with pytest.raises(AttributeError):
        w.scaling = 2.0
