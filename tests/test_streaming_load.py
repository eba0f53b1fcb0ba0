"""Streaming load: build_model reads the checkpoint one module (one merged q/k/v or gate/up group) at a
time and keeps no canonical tensor after its module's prepare, so the canonical tensors alive at once
never exceed the largest group, however many layers the checkpoint has."""
from __future__ import annotations

import json
import weakref
from collections.abc import Mapping

import pytest
import torch
from safetensors.torch import save_file

from quanta.engine.model_loader import build_model
from quanta.loaders import load
from quanta.quant.qtensor import QTensor

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 64, 256, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS


def write_checkpoint(path, layers: int) -> dict[str, torch.Tensor]:
    """A plain fp16 llama checkpoint of `layers` layers in `path` (config.json + model.safetensors); its tensors."""
    gen = torch.Generator().manual_seed(layers)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
                   p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, q),
                   p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTER), p + "input_layernorm.weight": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,)}
    tensors = {n: torch.randn(s, generator=gen).half() for n, s in shapes.items()}
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=HIDDEN,
                  intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=256,
                  rms_norm_eps=1e-5, torch_dtype="float16", tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def nbytes(x) -> int:
    return x.nbytes if isinstance(x, QTensor) else x.numel() * x.element_size()


class LiveBytes(Mapping):
    """The checkpoint's tensors, counting the bytes of those handed out and not yet collected."""

    def __init__(self, tensors: Mapping):
        self.tensors, self.live, self.peak, self.read = tensors, 0, 0, 0

    def __getitem__(self, name):
        t = self.tensors[name]
        size = nbytes(t)
        self.live += size
        self.read += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._freed, size)
        return t

    def _freed(self, size: int) -> None:
        self.live -= size

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)


def load_counting(path):
    ckpt = load(path)
    ckpt.tensors = counter = LiveBytes(ckpt.tensors)
    model = build_model(ckpt, torch.device("cpu"), torch.float32, quiet=True)   # fp16 -> fp32: prepare copies
    return model, counter


@pytest.mark.parametrize("layers", [8, 32])
def test_live_canonical_tensors_stay_under_the_largest_group(tmp_path, layers):
    stored = write_checkpoint(tmp_path / "m", layers)
    model, counter = load_counting(tmp_path / "m")
    total = sum(t.numel() * 2 for t in stored.values())
    largest_group = 2 * INTER * HIDDEN * 2            # gate + up, fp16: larger than q+k+v, o, down, embedding
    table = VOCAB * HIDDEN * 2                        # the embedding, kept in its 16 bits (rows widen on lookup)
    assert counter.read == total                      # every tensor was read once
    assert total >= 10 * largest_group * (layers // 8)
    assert counter.peak <= table + largest_group, (counter.peak, largest_group)
    assert counter.peak == table + largest_group      # and the group itself was alive at once (merged)
    assert counter.live == table                      # nothing else of the checkpoint is held after the load
    assert model.model.embed_tokens.table.dtype == torch.float16
    down = model.model.layers[layers - 1].mlp.down_proj.state
    torch.testing.assert_close(down, stored[f"model.layers.{layers - 1}.mlp.down_proj.weight"].float())


def test_peak_does_not_grow_with_the_number_of_layers(tmp_path):
    peaks = []
    for layers in (8, 32):
        write_checkpoint(tmp_path / str(layers), layers)
        peaks.append(load_counting(tmp_path / str(layers))[1].peak)
    assert peaks[0] == peaks[1]


@pytest.mark.parametrize("spec", ["synthetic:tiny:w4g32", "synthetic:tiny:fp16"])
def test_lazy_mappings_do_not_keep_what_they_return(spec, tmp_path, default_model_path):
    """Each read is a new object the mapping does not hold: once dropped it is collected (synthetic,
    plain safetensors, GGUF)."""
    from quanta.loaders.synthetic import load_synthetic
    from quanta.loaders.gguf.reader import load_gguf
    write_checkpoint(tmp_path / "m", 2)
    for tensors in (load_synthetic(spec, "cpu").tensors, load(tmp_path / "m").tensors,
                    load_gguf(default_model_path, tokenizer=False).tensors):
        name = "model.layers.1.mlp.up_proj.weight"
        first = tensors[name]
        gone = weakref.ref(next(iter(first.tensors().values())) if isinstance(first, QTensor) else first)
        del first
        assert gone() is None


def test_act_order_sorted_copies_die_with_their_mlp(monkeypatch):
    """An act-order checkpoint's MLP is renumbered whole before its modules load (quant/group_sort.py); those
    sorted copies of gate, up and down die once their MLP has loaded: none is held while the lm_head's table is
    read, the load's largest moment under tensor parallelism."""
    from quanta.engine import model_loader
    from quanta.engine.layers import QuantLinear
    from quanta.loaders.synthetic import load_synthetic
    copies, sort_mlp, load = [], model_loader.sort_mlp, QuantLinear.load

    def tracked(*args):
        out = sort_mlp(*args)
        copies.extend(weakref.ref(w) for w in out[:3])
        return out

    alive_at_lm_head = []

    def load_checked(self, weight, bias, device, dtype, name="", **kw):
        if name == "lm_head.weight":
            alive_at_lm_head.append(sum(ref() is not None for ref in copies))
        return load(self, weight, bias, device, dtype, name=name, **kw)
    monkeypatch.setattr(model_loader, "sort_mlp", tracked)
    monkeypatch.setattr(QuantLinear, "load", load_checked)
    build_model(load_synthetic("synthetic:tiny:w4g32act", "cpu"), torch.device("cpu"), torch.float32, quiet=True)
    assert len(copies) == 6 and alive_at_lm_head == [0]
