"""GGUF loader: the real SmolLM2 file against transformers' own GGUF reading; tiny written files; errors."""
import struct

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as T

from quanta.loaders.gguf.reader import llama3_freq_factors, load_gguf
from quanta.quant.errors import ConfigError, CorruptFileError, UnsupportedError
from quanta.quant.kinds.gguf import Gguf

CONFIG_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                 "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type"]


def dense(x) -> torch.Tensor:
    return x.dequantize() if isinstance(x, Gguf) else x.float()


# --- the real file ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm(default_model_path):
    return load_gguf(default_model_path)


@pytest.fixture(scope="module")
def hf_config(default_model_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    return load_gguf_checkpoint(str(default_model_path), return_tensors=False)["config"]


def test_config_matches_transformers(smollm, hf_config):
    for name in CONFIG_FIELDS:
        assert getattr(smollm.config, name) == hf_config[name], name
    assert smollm.format == "gguf" and smollm.config.rope_scaling is None
    assert smollm.quant_config["tensor_types"] == {"q8_0": 1, "q4_1": 210, "f32": 61}


def test_tokenizer_and_chat_template(smollm):
    tok = smollm.tokenizer
    assert tok.bos_token_id == smollm.config.bos_token_id and tok.eos_token_id == smollm.config.eos_token_id
    assert tok("Hello world, how are you?").input_ids == [19556, 905, 28, 638, 359, 346, 47]
    assert smollm.chat_template and smollm.chat_template == tok.chat_template
    assert "<|im_start|>user\nhi<|im_end|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_tensors_stay_quantized(smollm):
    t = smollm.tensors
    assert len(t) == 272 and "lm_head.weight" not in t        # tied embeddings
    emb, q = t["model.embed_tokens.weight"], t["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(emb, Gguf) and emb.describe() == "gguf q8_0" and emb.shape == (49152, 576)
    assert isinstance(q, Gguf) and q.describe() == "gguf q4_1" and q.shape == (576, 576)
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert t["model.norm.weight"].dtype == torch.float32


def test_layer0_matches_transformers_processor(smollm, hf_config, default_model_path):
    # transformers' own un-permutation (LlamaTensorProcessor) applied to gguf-py's dequantization
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    proc = LlamaTensorProcessor(config=hf_config)
    tensors = {t.name: t for t in GGUFReader(default_model_path).tensors}
    for gname, hf in [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                      ("ffn_down", "mlp.down_proj"), ("attn_norm", "input_layernorm")]:
        name = f"blk.0.{gname}.weight"
        ref = proc.process(weights=quants.dequantize(tensors[name].data, tensors[name].tensor_type), name=name).weights
        assert torch.equal(dense(smollm.tensors[f"model.layers.0.{hf}.weight"]), torch.from_numpy(np.array(ref)))


@pytest.mark.slow
def test_every_tensor_matches_transformers(smollm, default_model_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    cfg = AutoConfig.from_pretrained(default_model_path.parent, gguf_file=default_model_path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    ref = load_gguf_checkpoint(str(default_model_path), return_tensors=True, model_to_load=model)["tensors"]
    assert set(ref) == set(smollm.tensors)
    for name in list(ref):
        assert torch.equal(dense(smollm.tensors[name]), ref.pop(name)), name


# --- tiny files written with gguf.GGUFWriter --------------------------------------------------------
H, HEADS, KV, FF, VOCAB = 256, 4, 2, 512, 32
RNG = np.random.default_rng(0)


def permute(w, n_head, n_kv=None):   # convert_hf_to_gguf.py LlamaModel.permute
    if n_kv is not None and n_head != n_kv:
        n_head = n_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch="llama", meta=None, tensors=None, drop=()):
    """A GGUF file with llama-style metadata; tensors: gguf name -> (float array, GGML type)."""
    kv = {f"{arch}.block_count": 1, f"{arch}.embedding_length": H, f"{arch}.feed_forward_length": FF,
          f"{arch}.attention.head_count": HEADS, f"{arch}.attention.head_count_kv": KV,
          f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.rope.freq_base": 500000.0,
          f"{arch}.context_length": 2048, f"{arch}.vocab_size": VOCAB, "general.name": "tiny",
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **(meta or {})}
    w = GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if key not in drop:
            {str: w.add_string, float: w.add_float32, int: w.add_uint32}[type(value)](key, value)
    for name, (array, t) in (tensors or {}).items():
        if t in (T.F32, T.F16):
            w.add_tensor(name, quants.quantize(array, t))
        else:
            w.add_tensor(name, quants.quantize(array, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rt(w, t):
    """What a weight reads back as after a round trip through type t (gguf-py's own dequantization)."""
    return torch.from_numpy(np.array(quants.dequantize(quants.quantize(w, t), t), dtype=np.float32))


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


LLAMA = {  # HF name: (gguf name, HF-layout weight, type)
    "model.embed_tokens.weight": ("token_embd.weight", randn(VOCAB, H), T.Q8_0),
    "model.layers.0.input_layernorm.weight": ("blk.0.attn_norm.weight", randn(H), T.F32),
    "model.layers.0.post_attention_layernorm.weight": ("blk.0.ffn_norm.weight", randn(H), T.F32),
    "model.layers.0.self_attn.q_proj.weight": ("blk.0.attn_q.weight", randn(H, H), T.Q4_0),
    "model.layers.0.self_attn.k_proj.weight": ("blk.0.attn_k.weight", randn(KV * 64, H), T.Q5_1),
    "model.layers.0.self_attn.v_proj.weight": ("blk.0.attn_v.weight", randn(KV * 64, H), T.Q5_0),
    "model.layers.0.self_attn.o_proj.weight": ("blk.0.attn_output.weight", randn(H, H), T.Q4_1),
    "model.layers.0.mlp.gate_proj.weight": ("blk.0.ffn_gate.weight", randn(FF, H), T.MXFP4),
    "model.layers.0.mlp.up_proj.weight": ("blk.0.ffn_up.weight", randn(FF, H), T.TQ2_0),
    "model.layers.0.mlp.down_proj.weight": ("blk.0.ffn_down.weight", randn(H, FF), T.F16),
    "model.norm.weight": ("output_norm.weight", randn(H), T.F32),
    "lm_head.weight": ("output.weight", randn(VOCAB, H), T.BF16),
}


def llama_file(path, meta=None, extra=None, drop=(), arch="llama"):
    tensors = {}
    for hf, (name, w, t) in LLAMA.items():
        if "q_proj" in hf:
            w = permute(w, HEADS, HEADS)
        elif "k_proj" in hf:
            w = permute(w, HEADS, KV)
        tensors[name] = (w, t)
    return write_gguf(path, arch, meta, {**tensors, **(extra or {})}, drop)


def test_tiny_llama_loads_and_unpermutes(tmp_path):
    ck = load_gguf(llama_file(tmp_path / "tiny.gguf"), tokenizer=False)
    c = ck.config
    assert (c.model_type, c.hidden_size, c.num_key_value_heads, c.head_dim, c.vocab_size) == ("llama", H, KV, 64, VOCAB)
    assert not c.tie_word_embeddings and not c.attention_bias and not c.qk_norm and c.rope_scaling is None
    assert c.rope_theta == 500000.0 and c.max_position_embeddings == 2048 and c.eos_token_id == 2
    assert set(ck.tensors) == set(LLAMA)
    for hf, (_, w, t) in LLAMA.items():
        x = ck.tensors[hf]
        assert isinstance(x, Gguf) == (t not in (T.F32, T.F16, T.BF16)), hf
        assert torch.equal(dense(x), rt(w, t)), hf
    assert ck.tensors["lm_head.weight"].dtype == torch.bfloat16 and c.torch_dtype == torch.bfloat16
    assert ck.quant_config["tensor_types"]["q5_1"] == 1


def test_mistral_name_and_llama3_rope(tmp_path):
    spec = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    freqs = llama3_freq_factors(500000.0, 64, spec).astype(np.float32)
    path = llama_file(tmp_path / "m.gguf", meta={"general.name": "Mistral 7B tiny"},
                      extra={"rope_freqs.weight": (freqs, T.F32)})
    ck = load_gguf(path, tokenizer=False)
    assert ck.config.model_type == "mistral" and "rope_freqs.weight" not in ck.tensors
    assert ck.config.rope_scaling == {"rope_type": "llama3", **spec, "freq_factors": freqs.tolist()}
    w = LLAMA["model.layers.0.self_attn.k_proj.weight"][1]
    assert torch.equal(dense(ck.tensors["model.layers.0.self_attn.k_proj.weight"]), rt(w, T.Q5_1))

    odd = np.linspace(1, 3, 32).astype(np.float32)
    ck = load_gguf(llama_file(tmp_path / "o.gguf", extra={"rope_freqs.weight": (odd, T.F32)}), tokenizer=False)
    assert ck.config.rope_scaling == {"rope_type": "llama3", "factor": 3.0, "freq_factors": odd.tolist()}


def test_qwen2_bias_and_qwen3_qk_norm_are_not_permuted(tmp_path):
    wq, bq = randn(H, H), randn(H)
    base = {"token_embd.weight": (randn(VOCAB, H), T.Q8_0), "blk.0.attn_q.weight": (wq, T.Q8_0),
            "blk.0.attn_q.bias": (bq, T.F32), "blk.0.attn_k.bias": (randn(KV * 64), T.F32)}
    ck = load_gguf(write_gguf(tmp_path / "q2.gguf", "qwen2", tensors=base), tokenizer=False)
    assert ck.config.model_type == "qwen2" and ck.config.attention_bias and ck.config.tie_word_embeddings
    assert torch.equal(ck.tensors["model.layers.0.self_attn.q_proj.bias"], torch.from_numpy(bq))
    assert torch.equal(dense(ck.tensors["model.layers.0.self_attn.q_proj.weight"]), rt(wq, T.Q8_0))

    q3 = {"blk.0.attn_q.weight": (randn(HEADS * 128, H), T.Q4_0), "blk.0.attn_q_norm.weight": (randn(128), T.F32),
          "blk.0.attn_k_norm.weight": (randn(128), T.F32)}
    ck = load_gguf(write_gguf(tmp_path / "q3.gguf", "qwen3", meta={"qwen3.attention.key_length": 128},
                              tensors=q3), tokenizer=False)
    assert ck.config.qk_norm and ck.config.head_dim == 128 and not ck.config.attention_bias
    wq3 = q3["blk.0.attn_q.weight"][0]
    assert torch.equal(dense(ck.tensors["model.layers.0.self_attn.q_proj.weight"]), rt(wq3, T.Q4_0))
    assert "model.layers.0.self_attn.k_norm.weight" in ck.tensors


# --- typed errors naming the file -------------------------------------------------------------------
def test_not_gguf_and_empty(tmp_path):
    for name, content, words in (("bad.gguf", b"GGML" + bytes(64), "not a GGUF file"),
                                 ("empty.gguf", b"", "the file is empty")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CorruptFileError, match=f"{name}: {words}"):
            load_gguf(tmp_path / name)


@pytest.mark.parametrize("keep, where", [(24, "metadata entry 0"), (200, "metadata entry"),
                                         (-100, "tensor 'output.weight'")])
def test_truncated(tmp_path, keep, where):
    data = llama_file(tmp_path / "full.gguf").read_bytes()
    keep %= len(data)
    (tmp_path / "cut.gguf").write_bytes(data[:keep])
    with pytest.raises(CorruptFileError, match=f"cut.gguf: truncated.* the file ends at byte {keep} but {where}"):
        load_gguf(tmp_path / "cut.gguf", tokenizer=False)


def test_unknown_architecture(tmp_path):
    with pytest.raises(UnsupportedError, match="arch.gguf.*'gpt2'"):
        load_gguf(write_gguf(tmp_path / "arch.gguf", "gpt2"), tokenizer=False)


def test_missing_key(tmp_path):
    with pytest.raises(ConfigError, match="nokey.gguf.*'llama.block_count'"):
        load_gguf(llama_file(tmp_path / "nokey.gguf", drop=("llama.block_count",)), tokenizer=False)


def test_unknown_tensor_name(tmp_path):
    with pytest.raises(UnsupportedError, match="extra.gguf.*'blk.0.ffn_gate_exps.weight'"):
        load_gguf(llama_file(tmp_path / "extra.gguf", extra={"blk.0.ffn_gate_exps.weight": (randn(4, 32), T.F32)}),
                  tokenizer=False)


def patch_tensor_info(path, name: bytes, type_id=None, ne0=None):
    """Rewrite the GGML type id or first dim of tensor `name` in a GGUF file's tensor infos."""
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    if ne0 is not None:
        struct.pack_into("<Q", data, at + 4, ne0)
    if type_id is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("type_id, match", [(4, "q4_2.*q4_0"), (33, "q4_0_8_8.*q4_0"), (99, "unknown GGML type id 99")])
def test_retired_or_unknown_type(tmp_path, type_id, match):
    path = llama_file(tmp_path / "old.gguf")
    patch_tensor_info(path, b"blk.0.attn_q.weight", type_id=type_id)
    with pytest.raises(UnsupportedError, match=f"old.gguf.*blk.0.attn_q.weight.*{match}"):
        load_gguf(path, tokenizer=False)


def test_size_disagrees_with_type(tmp_path):
    path = llama_file(tmp_path / "size.gguf")
    patch_tensor_info(path, b"token_embd.weight", ne0=H + 16)      # not a whole number of q8_0 blocks
    with pytest.raises(CorruptFileError, match="size.gguf.*token_embd.weight.*q8_0 blocks of 32"):
        load_gguf(path, tokenizer=False)


def test_bad_config_value_and_rope_scaling_keys(tmp_path):
    with pytest.raises(ConfigError, match="kv.gguf.*num_key_value_heads=3"):
        load_gguf(llama_file(tmp_path / "kv.gguf", meta={"llama.attention.head_count_kv": 3}), tokenizer=False)
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    ck = load_gguf(llama_file(tmp_path / "lin.gguf", meta=meta), tokenizer=False)
    assert ck.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_tokenizer_cache_round_trips_exactly(default_model_path, tmp_path, monkeypatch):
    """The cached conversion tokenizes, decodes and templates exactly as a fresh conversion."""
    from quanta.loaders.gguf.reader import convert_tokenizer, load_tokenizer, tokenizer_cache_dir
    monkeypatch.setenv("QUANTA_CACHE", str(tmp_path))
    cached = load_tokenizer(default_model_path)            # converted in a child process, read from its entry
    assert (tokenizer_cache_dir(default_model_path) / "tokenizer_config.json").is_file()
    fresh = convert_tokenizer(default_model_path)
    texts = ["Hello world", "  leading spaces\tand tabs\n", "<|im_start|>user\nhi<|im_end|>", "naïve café 日本語 🙂",
             "def f(x):\n    return x**2"]
    for text in texts:
        ids = fresh(text)["input_ids"]
        assert cached(text)["input_ids"] == ids
        assert cached.decode(ids) == fresh.decode(ids)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        fresh.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (cached.bos_token_id, cached.eos_token_id) == (fresh.bos_token_id, fresh.eos_token_id)


def test_a_first_load_leaves_the_converters_imports_to_a_child_process(default_model_path, tmp_path):
    """A GGUF file's first tokenizer load converts in a child process: this one never imports transformers'
    GGUF code or gguf-py, which would stay resident, and still gets the file's tokenizer."""
    import subprocess
    import sys
    code = ("import sys, pathlib; from quanta.loaders.gguf.reader import load_tokenizer; "
            "tok = load_tokenizer(pathlib.Path(sys.argv[1])); "
            "print(tok('Hello world')['input_ids'], 'transformers.integrations.ggml' in sys.modules, "
            "'gguf' in sys.modules)")
    env = {**__import__("os").environ, "QUANTA_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code, str(default_model_path)], env=env, capture_output=True,
                         text=True, timeout=600, check=True).stdout.split()
    assert out[-2:] == ["False", "False"] and out[0].startswith("[")
    assert any(tmp_path.glob("gguf-tokenizers/*/tokenizer_config.json"))


def test_tokenizer_cache_can_be_turned_off(default_model_path, monkeypatch):
    from quanta.loaders.gguf.reader import tokenizer_cache_dir
    monkeypatch.setenv("QUANTA_CACHE", "")
    assert tokenizer_cache_dir(default_model_path) is None


def test_two_writers_of_the_tokenizer_cache_both_succeed_silently(default_model_path, tmp_path, monkeypatch, caplog):
    """Two servers starting at once convert the tokenizer and both rename their entry into place: the second
    finds the first's entry there. That entry stands, nothing is reported and no temporary entry is left."""
    import logging
    from quanta.loaders.gguf import reader
    monkeypatch.setenv("QUANTA_CACHE", str(tmp_path))
    tok = reader.load_tokenizer(default_model_path)
    cache = reader.tokenizer_cache_dir(default_model_path)
    with caplog.at_level(logging.INFO, logger=reader.__name__):
        reader._save_atomically(tok, cache)                 # the later writer of the race
    assert "not written" not in caplog.text
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]
    assert reader.load_tokenizer(default_model_path)("Hello world")["input_ids"] == tok("Hello world")["input_ids"]


def test_an_unwritable_tokenizer_cache_is_reported_and_skipped(default_model_path, tmp_path, caplog):
    import logging
    from quanta.loaders.gguf import reader
    tok = reader.load_tokenizer(default_model_path)
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.INFO, logger=reader.__name__):
        reader._save_atomically(tok, blocked / "entry")
    assert "tokenizer cache not written" in caplog.text
