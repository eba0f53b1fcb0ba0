"""`quanta serve --lora-modules`: four adapters served at once, each picked by the request's model field, through
the real `openai` client; outputs equal the offline engine's with the same adapter; /v1/models lists them; an
unknown name is a 404; a bad adapter on the command line fails before the model loads."""
from __future__ import annotations

import subprocess
import sys

import pytest

from quanta import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, base dir, {name: LoRARequest}) of a server with four adapters."""
    from test_lora_engine import make_adapter
    from test_server import _serving
    from tiny_models import build_tiny_hf
    root = tmp_path_factory.mktemp("serve-lora")
    path, model = build_tiny_hf("llama", root / "base")
    loras = {}
    for i in range(4):
        make_adapter(model, root / f"lora{i}", seed=20 + i, r=4 * (i + 1))
        loras[f"lora{i}"] = LoRARequest(f"lora{i}", i + 1, str(root / f"lora{i}"))
    flags = ["--dtype", "float32", "--max-model-len", "128", "--served-model-name", "base", "--max-lora-rank", "16",
             "--lora-modules", *[f"{n}={r.lora_path}" for n, r in loras.items()]]
    with _serving(path, *flags) as url:
        yield url, path, loras


def test_four_adapters_are_served_at_once_by_model_name(served):
    import concurrent.futures
    url, path, loras = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    names = ["base", *loras]

    def complete(name):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        return out.model, out.choices[0].token_ids
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:      # concurrent: one batch, four adapters
        results = list(pool.map(complete, names))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=128, enable_lora=True, max_loras=4,
             quiet=True) as llm:
        want = [llm.generate([{"prompt_token_ids": PROMPT}], params, lora_request=loras.get(n))[0].outputs[0].token_ids
                for n in names]
    assert [m for m, _ in results] == names
    assert [list(t) for _, t in results] == want
    assert len({tuple(t) for t in want}) == len(names)           # every adapter changes the output


def test_models_lists_the_adapters_and_an_unknown_one_is_404(served):
    url, _, loras = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    cards = client.models.list().data
    assert [c.id for c in cards] == ["base", *loras]
    assert all(getattr(c, "parent") == "base" for c in cards[1:])
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    chat = client.chat.completions.create(model="lora2", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "lora2"


@pytest.mark.parametrize("spec,message", [("no-equals-sign", "is not NAME=PATH"),
                                          ("x=/does/not/exist", "/does/not/exist")])
def test_a_bad_lora_module_fails_before_loading(tmp_path, spec, message):
    from tiny_models import build_tiny_hf
    path, _ = build_tiny_hf("llama", tmp_path / "base")
    out = subprocess.run([sys.executable, "-m", "quanta.cli.main", "serve", str(path), "--device", "cpu",
                          "--lora-modules", spec], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr
