"""LoRA on a CUDA GPU: the Triton slot kernels inside CUDA graphs. A mixed batch (three adapters and none) with
graphs equals the same engine eager, and in float32 equals peft's greedy tokens. Run with `pytest -m gpu`."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    pytest.importorskip("peft")
    from quanta import LoRARequest
    from test_lora_engine import make_adapter
    from tiny_models import build_tiny_hf
    root = tmp_path_factory.mktemp("lora-gpu")
    path, model = build_tiny_hf("llama", root / "base")
    peft_models, requests = [], []
    for i in range(3):
        peft_models.append(make_adapter(model, root / f"a{i}", seed=30 + i, r=4 * (i + 1)))
        requests.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    return path, model, peft_models, requests


def run(path, requests, dtype: str, eager: bool, ps):
    from quanta import LLM, SamplingParams
    choice = [requests[i % 4] if i % 4 < 3 else None for i in range(len(ps))]
    with LLM(str(path), dtype=dtype, device="cuda", max_model_len=128, enforce_eager=eager, enable_lora=True,
             max_loras=2, max_num_seqs=8, gpu_memory_utilization=0.3, quiet=True) as llm:
        out = llm.generate([{"prompt_token_ids": p} for p in ps],
                           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), lora_request=choice)
    return [o.outputs[0].token_ids for o in out], choice


def test_graphs_equal_eager_and_peft(adapters):
    from test_lora_engine import oracle, prompts
    path, model, peft_models, requests = adapters
    ps = prompts(8, seed=7)
    graphs, choice = run(path, requests, "float16", False, ps)
    eager, _ = run(path, requests, "float16", True, ps)
    assert graphs == eager
    exact, _ = run(path, requests, "float32", False, ps)
    by_id = {r.lora_int_id: m for r, m in zip(requests, peft_models)}
    assert exact == [oracle(by_id[c.lora_int_id] if c else model, p, 12) for p, c in zip(ps, choice)]


def test_w4_base_epilogue_equals_the_unfused_path(adapters, tmp_path, monkeypatch):
    """Over an AWQ base in fp16 a decode step's GEMVs add the adapters' products in their epilogues (SwiGLU and
    rotary + KV store kept fused): with graphs, the same greedy tokens as the GEMVs followed by the slot kernels."""
    import quanta
    from quanta.kernels import affine
    from test_lora_engine import prompts
    path, _, _, requests = adapters
    base = tmp_path / "awq"
    quanta.convert(path, "awq", base, validate=False, quiet=True)
    ps = prompts(8, seed=11)
    fused, _ = run(base, requests, "float16", False, ps)
    monkeypatch.setattr(affine, "lora_fuses", lambda state, m: False)
    unfused, _ = run(base, requests, "float16", False, ps)
    assert fused == unfused
