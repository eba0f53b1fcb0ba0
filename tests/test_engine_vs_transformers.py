"""The engine's logits and greedy continuations equal transformers' on the same checkpoints:
the real SmolLM2 GGUF (transformers dequantizes it on load) and tiny random models of every
supported architecture written by transformers' save_pretrained."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from quanta.engine import LLM, SamplingParams  # noqa: E402
from kernel_util import cpu_4bit_kernel  # noqa: E402
from tiny_models import hf_greedy  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def default_pair():
    from quanta.cli.default_model import default_model_path
    path = default_model_path()
    ours = LLM(model=str(path), dtype="float32", device="cpu", kernel="dequantized")    # the exact path
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return ours, theirs


def test_default_model_logits_match_transformers(default_pair):
    ours, theirs = default_pair
    for prompt in PROMPTS:
        ids = ours.tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            ref = theirs(torch.tensor([ids])).logits[0].float()
        got = ours.prompt_logits(ids)
        diff = (got - ref).abs().max().item()
        assert diff < 2e-3, f"{prompt!r}: max abs logit difference {diff}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_default_model_greedy_continuation_matches_transformers(default_pair):
    ours, theirs = default_pair
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        out = ours.generate(prompt, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(theirs, out.prompt_token_ids, 32), prompt


ARCHS = ["llama", "llama3_rope", "mistral", "qwen2", "qwen3", "llama_tied"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_hf_models_match_transformers(arch, tmp_path):
    from tiny_models import make_tiny_hf
    path = make_tiny_hf(arch, tmp_path / arch)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = LLM(model=str(path), dtype="float32", device="cpu")
    torch.manual_seed(0)
    for length in (1, 7, 33):
        ids = torch.randint(3, theirs.config.vocab_size, (length,)).tolist()
        with torch.no_grad():
            ref = theirs(torch.tensor([ids])).logits[0]
        diff = (ours.prompt_logits(ids) - ref).abs().max().item()
        assert diff < 1e-4, f"{arch} len {length}: max abs logit difference {diff}"
    ids = torch.randint(3, theirs.config.vocab_size, (5,)).tolist()
    out = ours.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=32, ignore_eos=True, temperature=0),
                        use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(theirs, ids, 32)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_default_model_int4_path_agrees_with_exact(default_pair, dtype):
    """The CPU fast path (cpu_vnni's 8-bit activation blocks, or torch's int4 kernel at bf16 input; float32
    elsewhere by default) keeps weights 4-bit and stays close to the exact float32 model."""
    ours32, _ = default_pair
    from quanta.cli.default_model import default_model_path
    fast = LLM(model=str(default_model_path()), dtype=dtype, device="cpu")
    assert {k["kernel"] for k in fast.kernels() if "q4_1" in k["scheme"]} == {cpu_4bit_kernel()[0]}
    ids = ours32.tokenizer(" ".join(PROMPTS))["input_ids"]
    ref, got = ours32.prompt_logits(ids), fast.prompt_logits(ids)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"top-1 agreement {agree:.2f}"
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    assert kl < 0.05, f"KL(fp32 || bf16-int4) = {kl}"
