"""A quantized lm_head in an HF-style checkpoint (GPTQModel's `lm_head=True`, read by vLLM as well): written by the
GPTQ writer with the config's `lm_head` true, read back as a QTensor, run by the engine, and counted by the plan.

The oracle for the logits is transformers' fp32 model on the decoder weights GPTQModel itself dequantized (the
fixture's reference.safetensors) and the lm_head's own dequantization.
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quanta.loaders import load
from quanta.loaders.formats import Source
from quanta.loaders.gptq_write import write_gptq
from quanta.planner.weight_bytes import shard, weight_bytes
from quanta.quant.errors import UnsupportedError
from quanta.quant.qtensor import QTensor
from quanta.quant.rtn import rtn_affine

FIXTURE = Path(__file__).parent / "fixtures" / "gptq" / "b4_g64_asym_v2"     # GPTQModel 7.7.0, untied lm_head


def lm_head_quantized(dst: Path) -> tuple[Path, torch.Tensor]:
    """The fixture rewritten by write_gptq with its lm_head RTN-quantized in the decoder's scheme (4-bit, groups
    of 64, zero points; scales fp16-exact); returns the checkpoint and that lm_head's values."""
    ckpt = load(FIXTURE)
    a = rtn_affine(ckpt.tensors["lm_head.weight"].float(), 4, 64, symmetric=False, convention="gptq")
    a = dataclasses.replace(a, scales=a.scales.half().float())
    stream = ((n, a if n == "lm_head.weight" else ckpt.tensors[n]) for n in ckpt.tensors)
    return write_gptq(dst, ckpt, stream, checkpoint_format="gptq_v2"), a.dequantize(torch.float32)


def transformers_logits(path: Path, lm_head: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """fp32 transformers logits with the fixture's float tensors, GPTQModel's dequantized decoder weights and
    `lm_head`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp), dtype=torch.float32).eval()
    params = model.state_dict()
    state = {k: v.float() for k, v in load_file(FIXTURE / "model.safetensors").items()
             if k in params and v.shape == params[k].shape}
    state |= {k: v.float() for k, v in load_file(FIXTURE / "reference.safetensors").items()}
    state["lm_head.weight"] = lm_head
    assert not [k for k in params if k not in state]
    model.load_state_dict(state)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def test_a_gptq_lm_head_is_written_read_and_run_quantized(tmp_path):
    from quanta.engine.llm import LLM
    path, lm_head = lm_head_quantized(tmp_path / "q")
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["lm_head"] is True
    ckpt = load(path)
    head = ckpt.tensors["lm_head.weight"]
    assert isinstance(head, QTensor) and torch.equal(head.dequantize(torch.float32), lm_head)
    tokens = load_file(FIXTURE / "reference_logits.safetensors")["tokens"].tolist()
    llm = LLM(model=str(path), dtype=torch.float32, device="cpu", kernel="dequantized")
    logits = llm.prompt_logits(tokens).float()
    expected = transformers_logits(path, lm_head, tokens)
    torch.testing.assert_close(logits, expected, atol=2e-2, rtol=1e-2)
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75
    head_gemm = [g for g in llm.kernels() if g["name"].startswith("lm_head")]
    assert head_gemm and "dense" not in head_gemm[0]["scheme"], head_gemm


def test_the_plan_counts_a_quantized_lm_head_at_its_bytes(tmp_path):
    path, _ = lm_head_quantized(tmp_path / "q")
    plain, quantized = (load(p) for p in (FIXTURE, path))
    formats = [Source.of(c).weight_format(c.config) for c in (plain, quantized)]
    assert [f.lm_head_quantized for f in formats] == [False, True]
    cfg = dataclasses.replace(plain.config, vocab_size=32000, hidden_size=4096)     # the plan at a real head's size
    heads = [weight_bytes(cfg, f, shard(cfg, 1), 2).lm_head for f in formats]
    assert heads[0] == 32000 * 4096 * 2
    # 4-bit codes (a quarter of fp16's bytes), an fp16 scale and a zero point per 64 values
    assert 0.25 < heads[1] / heads[0] < 0.3


def test_a_layout_that_cannot_declare_a_quantized_lm_head_refuses_it(tmp_path):
    from quanta.loaders.awq_write import write_awq
    ckpt = load(FIXTURE)
    a = rtn_affine(ckpt.tensors["lm_head.weight"].float(), 4, 64, symmetric=False)
    stream = ((n, a if n == "lm_head.weight" else ckpt.tensors[n]) for n in ckpt.tensors)
    with pytest.raises(UnsupportedError, match="keeps lm_head.weight in float"):
        write_awq(tmp_path / "awq", ckpt, stream)
    assert not (tmp_path / "awq").exists()


def test_a_synthetic_affine_format_with_head_holds_its_lm_head_in_that_format():
    """`w4g32-head`: the lm_head an Affine of the decoder's scheme, planned at its bytes and run as a GEMM of that
    format (a benchmark's W4 model with a quantized lm_head); other formats refuse the suffix."""
    from quanta.engine.llm import LLM
    from quanta.quant.errors import ConfigError
    plain, head = (load(f"synthetic:tiny-tp:w4g32{suffix}") for suffix in ("", "-head"))
    assert not isinstance(plain.tensors["lm_head.weight"], QTensor)
    assert isinstance(head.tensors["lm_head.weight"], QTensor) and head.tensors["lm_head.weight"].bits == 4
    cfg = plain.config
    bytes_ = [weight_bytes(cfg, Source.of(c).weight_format(cfg), shard(cfg, 1), 2).lm_head for c in (plain, head)]
    assert bytes_[1] < bytes_[0] / 2
    llm = LLM(model="synthetic:tiny-tp:w4g32-head", device="cpu", dtype=torch.float32)
    gemm = [g for g in llm.kernels() if g["name"].startswith("lm_head")][0]
    assert "dense" not in gemm["scheme"], gemm
    with pytest.raises(ConfigError, match="an affine format with -head"):
        load("synthetic:tiny-tp:nf4-head")
