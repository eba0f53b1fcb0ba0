"""GGUF writer: round trips through our reader, the gguf package's reader and dequantizer, and
(where llama-cpp-python is installed) llama.cpp itself."""
import dataclasses
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from quanta.loaders.gguf.reader import load_gguf  # noqa: E402
from quanta.loaders.gguf.mix import assign  # noqa: E402
from quanta.loaders.gguf.writer import write_gguf  # noqa: E402
from quanta.quant.errors import ConfigError, UnsupportedError  # noqa: E402
from quanta.quant.kinds.gguf import Gguf  # noqa: E402
from tiny_models import build_tiny_hf  # noqa: E402

TEXT = "Hello world, <|im_start|>user\nquanta's GGUF writer: ünïcode 🦙 3.14\n<|im_end|>"


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return isinstance(b, Gguf) and a.ggml_type == b.ggml_type and torch.equal(a.data, b.data)


@pytest.fixture(scope="module")
def smollm2(default_model_path, tmp_path_factory):
    """The default model written back unchanged (every tensor as stored)."""
    out = tmp_path_factory.mktemp("gguf_write") / "smollm2.gguf"
    write_gguf(out, load_gguf(default_model_path, tokenizer=False))
    return out


def test_round_trip_is_exact(default_model_path, smollm2):
    a, b = load_gguf(default_model_path), load_gguf(smollm2)
    assert a.config == b.config
    assert list(a.tensors) == list(b.tensors)
    assert all(_same(a.tensors[n], b.tensors[n]) for n in a.tensors)
    assert a.chat_template == b.chat_template and b.chat_template
    ids = a.tokenizer.encode(TEXT)
    assert b.tokenizer.encode(TEXT) == ids and b.tokenizer.decode(ids) == a.tokenizer.decode(ids)


def test_gguf_package_reads_it(default_model_path, smollm2):
    src, ours = gguf.GGUFReader(default_model_path), gguf.GGUFReader(smollm2)
    assert [t.name for t in ours.tensors] == [t.name for t in src.tensors]
    assert bytes(ours.fields["general.architecture"].parts[-1]) == b"llama"
    for s, t in zip(src.tensors[:12], ours.tensors[:12]):
        assert (t.tensor_type, list(t.shape)) == (s.tensor_type, list(s.shape))
        assert np.array_equal(np.asarray(t.data), np.asarray(s.data))
    ck = load_gguf(smollm2, tokenizer=False)
    t = next(t for t in ours.tensors if t.name == "blk.0.ffn_down.weight")
    want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    assert np.array_equal(ck.tensors["model.layers.0.mlp.down_proj.weight"].dequantize().numpy(), want)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from quanta.loaders.hf import load_hf
    path, _ = build_tiny_hf("llama", tmp_path_factory.mktemp("tiny") / "m", hidden_size=256, intermediate_size=512,
                            head_dim=64)
    return load_hf(path)


def test_hf_checkpoint_to_q8_0(tiny_hf, tmp_path):
    out = write_gguf(tmp_path / "m.gguf", tiny_hf, ggml_type="Q8_0")
    back = load_gguf(out)
    ids = tiny_hf.tokenizer.encode(TEXT)
    assert back.tokenizer.encode(TEXT) == ids and back.tokenizer.decode(ids) == tiny_hf.tokenizer.decode(ids)
    assert back.config.num_key_value_heads == tiny_hf.config.num_key_value_heads


def test_hf_weights_match_gguf_py_q8_0(tiny_hf, tmp_path):
    # A 512-row vocabulary, without the 49152-token tokenizer, so that the file agrees with itself.
    slim = dataclasses.replace(tiny_hf, config=dataclasses.replace(tiny_hf.config, vocab_size=512), tokenizer=None,
                               chat_template=None)
    out = write_gguf(tmp_path / "m.gguf", slim, _slim(tiny_hf), ggml_type="Q8_0")
    back = load_gguf(out, tokenizer=False)   # q/k rows come back un-permuted: blocks are per row
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].parts[-1][0] == 7
    for name, w in _slim(tiny_hf):
        got = back.tensors[name]
        if w.dim() == 1:
            assert torch.equal(got, w.float())                 # norms: F32, exact
            continue
        want = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
        assert got.type.name == "q8_0" and np.array_equal(got.data.numpy(), want), name


def _slim(ckpt):
    """The checkpoint's tensors with the 49152-row embedding and lm_head cut to 512 rows: the types a
    mix assigns do not depend on rows, and K-quantizing 25M values would dominate the suite."""
    return [(n, t[:512] if "embed" in n or "lm_head" in n else t) for n, t in ckpt.tensors.items()]


def test_q4_k_m_mix_types(tiny_hf, tmp_path):
    out = write_gguf(tmp_path / "m.gguf", tiny_hf, _slim(tiny_hf), ggml_type="Q4_K_M")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    # 2 layers: use_more_bits(i, 2) is i >= 7*2//8 = 1, so layer 1's attn_v and ffn_down get Q6_K
    want = assign("Q4_K_M", tiny_hf.config)
    for (role, layer), t in want.types.items():
        name = f"{role}.weight" if layer is None else f"blk.{layer}.{role}.weight"
        if name in types:
            assert types[name].lower() == t.lower(), name
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.1.attn_v.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert gguf.GGUFReader(out).fields["general.file_type"].parts[-1][0] == 15


def test_mix_falls_back_where_blocks_do_not_tile(default_model_path):
    config = load_gguf(default_model_path, tokenizer=False).config      # hidden 576 = 2.25 * 256
    t = assign("Q4_K_M", config)
    assert t.of("attn_q", 0) == "q5_0" and t.of("ffn_down", 4) == "q4_K" and t.of("ffn_down", 0) == "q6_K"
    assert t.of("attn_v", 0) == "q8_0" and t.of_tensor("output.weight") == "q8_0"
    assert t.of_tensor("token_embd.weight") == "q8_0" and t.of_tensor("blk.0.attn_norm.weight") is None


def test_imatrix_moves_the_first_ffn_down_layers_of_q4_0_and_q5_0(default_model_path):
    # llama-quantize (llama_tensor_get_type): with an imatrix, Q4_0 / Q5_0 take ffn_down of layers < n_layer / 8
    # in Q4_1 / Q5_1; 30 layers -> layers 0, 1 and 2. Without one, and for the other types, nothing moves.
    config = load_gguf(default_model_path, tokenizer=False).config
    for base, moved in (("Q4_0", "q4_1"), ("Q5_0", "q5_1")):
        t = assign(base, config, imatrix=True)
        assert [t.of("ffn_down", i) for i in range(4)] == [moved] * 3 + [base.lower()]
        assert t.of("ffn_up", 0) == base.lower() and assign(base, config).of("ffn_down", 0) == base.lower()
    assert assign("Q4_K_M", config, imatrix=True).types == assign("Q4_K_M", config).types


def test_refuses_existing_and_leaves_nothing_on_error(tiny_hf, tmp_path):
    dst = tmp_path / "x.gguf"
    dst.write_bytes(b"keep")
    with pytest.raises(ConfigError, match="already exists"):
        write_gguf(dst, tiny_hf)
    assert dst.read_bytes() == b"keep"
    bad = [("model.embed_tokens.weight", torch.zeros(4, 256)), ("model.vision.weight", torch.zeros(2))]
    with pytest.raises(UnsupportedError, match="model.vision.weight"):
        write_gguf(tmp_path / "y.gguf", tiny_hf, bad)
    assert sorted(os.listdir(tmp_path)) == ["x.gguf"]


def test_llama_cpp_generates_from_written_file(smollm2):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(smollm2), n_ctx=256, verbose=False, seed=0)
    out = llm("The capital of France is", max_tokens=8, temperature=0.0)["choices"][0]["text"]
    assert "Paris" in out
