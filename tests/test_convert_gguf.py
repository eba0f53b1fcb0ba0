"""quanta convert with real models: the default GGUF (SmolLM2-135M Q4_1) to HF loads in transformers and
greedy-decodes as quanta does on the GGUF; HF / AWQ / NF4 to GGUF load in the `gguf` reader and generate in
llama-cpp-python (skipped where llama_cpp is not installed; tests/fixtures/convert/llama_cpp.json records a
run made with it, and the GGUF bytes converted here must hash-match the ones llama.cpp generated from)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import quanta
from quanta.engine import LLM, SamplingParams
from tiny_models import hf_greedy

pytestmark = pytest.mark.slow        # converts the 135M model several times

FIXTURES = Path(__file__).parent / "fixtures"
RECORD = FIXTURES / "convert" / "llama_cpp.json"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def default_hf(tmp_path_factory, default_model_path):
    out = tmp_path_factory.mktemp("conv") / "smollm2-hf"
    quanta.convert(default_model_path, "hf", out, dtype="float32", validate=False, quiet=True)
    return out


def test_default_gguf_to_hf_greedy_text_matches_quanta_on_the_gguf(default_hf, default_model_path):
    import transformers
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(default_hf), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(default_hf))
    ours = LLM(model=str(default_model_path), dtype="float32", device="cpu", kernel="dequantized", quiet=True)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        out = ours.generate(prompt, params, use_tqdm=False)[0]
        assert tok(prompt)["input_ids"] == out.prompt_token_ids
        got = hf_greedy(theirs, out.prompt_token_ids, 24)
        assert got == out.outputs[0].token_ids, prompt
        assert tok.decode(got) == out.outputs[0].text


def conversions(default_hf: Path, root: Path) -> dict[str, Path]:
    """The GGUF files the llama.cpp record covers, converted deterministically into `root`."""
    awq = FIXTURES / "awq" / "gemm_g32"
    nf4 = FIXTURES / "bnb" / "nf4"
    jobs = {"hf_q8_0": (default_hf, "gguf:Q8_0"), "hf_q4_k_m": (default_hf, "gguf:Q4_K_M"),
            "awq_q4_0": (awq, "gguf:Q4_0"), "nf4_q8_0": (nf4, "gguf:Q8_0")}
    out = {}
    for name, (src, to) in jobs.items():
        out[name] = root / f"{name}.gguf"
        if not out[name].exists():
            quanta.convert(src, to, out[name], validate=False, quiet=True)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def converted(default_hf, tmp_path_factory):
    return conversions(default_hf, tmp_path_factory.mktemp("gguf"))


def test_converted_gguf_files_read_in_the_gguf_package(converted):
    from gguf import GGUFReader
    want = {"hf_q8_0": {"Q8_0"}, "hf_q4_k_m": {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}, "awq_q4_0": {"Q4_0"},
            "nf4_q8_0": {"Q8_0"}}
    for name, path in converted.items():
        reader = GGUFReader(str(path))
        types = {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
        assert types and types <= want[name] | {"F32", "F16"}, (name, types)
        assert "tokenizer.ggml.tokens" in reader.fields and "tokenizer.chat_template" in reader.fields


def test_converted_gguf_bytes_match_the_llama_cpp_record(converted):
    """The committed record was made by running llama-cpp-python on files converted as here."""
    record = json.loads(RECORD.read_text())
    for name, path in converted.items():
        assert record["cases"][name]["sha256"] == sha256(path), name
        assert record["cases"][name]["generated_tokens"] > 0, name


def test_converted_gguf_generates_in_llama_cpp(converted):
    llama_cpp = pytest.importorskip("llama_cpp")
    for name, path in converted.items():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, verbose=False)
        out = llm("The capital of France is", max_tokens=8, temperature=0.0)
        assert out["usage"]["completion_tokens"] > 0, name
