"""LoRA adapters in the engine: greedy outputs against peft + transformers (the oracle) over a float32 base and
over AWQ, GPTQ, NF4 and GGUF bases on the exact float32 path; mixed batches against each request alone; slots
under max_loras; the prefix cache kept apart per adapter; the errors a user meets."""
from __future__ import annotations

import copy

import pytest
import torch

from quanta import LLM, LoRARequest, SamplingParams
from quanta.quant.errors import ConfigError

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
EXACT = {"kernel": "dequantized", "dtype": "float32", "device": "cpu", "max_model_len": 128, "num_kv_blocks": 64,
         "quiet": True}


def make_adapter(model, path, seed: int, r: int = 8, alpha: int = 16, targets=TARGETS, **kw):
    """A peft LoRA over a copy of `model` with random A and B (peft starts B at zero), saved at `path`."""
    from peft import LoraConfig, get_peft_model
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                           lora_dropout=0.0, **kw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    lora.save_pretrained(path)
    return lora.eval()


def oracle(model, ids: list[int], n: int = GREEDY.max_tokens) -> list[int]:
    from tiny_models import hf_greedy
    return hf_greedy(model, ids, n)


def prompts(count: int = 4, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (count,), generator=g)]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(checkpoint dir, transformers model, three adapters as (LoRARequest, peft model))."""
    from tiny_models import build_tiny_hf
    root = tmp_path_factory.mktemp("lora")
    path, model = build_tiny_hf("llama", root / "base")
    adapters = []
    for i, kw in enumerate([{}, {"r": 4, "alpha": 8}, {"r": 16, "alpha": 16, "targets": ["q_proj", "v_proj"]}]):
        peft_model = make_adapter(model, root / f"adapter{i}", seed=10 + i, **kw)
        adapters.append((LoRARequest(f"a{i}", i + 1, str(root / f"adapter{i}")), peft_model))
    return path, model, adapters


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_alone_equals_peft(base):
    path, model, adapters = base
    ps = prompts()
    with LLM(str(path), enable_lora=True, max_loras=3, **EXACT) as llm:
        plain = token_ids(llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY))
        for request, peft_model in adapters:
            got = token_ids(llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, lora_request=request))
            assert got == [oracle(peft_model, p) for p in ps], request.lora_name
            assert got != plain                          # the adapter changes what the model says
        assert plain == [oracle(model, p) for p in ps]
        assert llm.memory()["lora_slots"] == 0          # the CPU path reads the adapters at their own ranks


def test_a_mixed_batch_equals_each_request_alone(base):
    """Three adapters and none in one batch, under max_loras=2 (slots evicted and reloaded as requests end):
    each output equals the request run alone and peft's."""
    path, model, adapters = base
    ps = prompts(8, seed=1)
    choice = [adapters[i % 4][0] if i % 4 < 3 else None for i in range(len(ps))]
    with LLM(str(path), enable_lora=True, max_loras=2, max_num_seqs=8, **EXACT) as llm:
        mixed = token_ids(llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, lora_request=choice))
        alone = [token_ids(llm.generate([{"prompt_token_ids": p}], GREEDY, lora_request=c))[0]
                 for p, c in zip(ps, choice)]
    assert mixed == alone
    models = {a.lora_int_id: m for a, m in adapters}
    assert mixed == [oracle(models[c.lora_int_id] if c else model, p) for p, c in zip(ps, choice)]


def test_adapters_keep_their_own_prefix_cache(base):
    """The same long prompt with an adapter, then without, then with another: each gets its own KV, not a
    prefix-cache hit on another adapter's blocks."""
    path, model, adapters = base
    p = prompts(1, seed=2)[0] * 3
    runs = [adapters[0][0], None, adapters[1][0], adapters[0][0]]
    with LLM(str(path), enable_lora=True, max_loras=2, block_size=8, **EXACT) as llm:
        got = [token_ids(llm.generate([{"prompt_token_ids": p}], GREEDY, lora_request=r))[0] for r in runs]
        hits = llm.pool.prefix_hits
    models = {a.lora_int_id: m for a, m in adapters}
    assert got == [oracle(models[r.lora_int_id] if r else model, p) for r in runs]
    assert hits > 0                                     # the last run reused its own adapter's blocks


@pytest.mark.parametrize("target", ["hf:float16", "awq", "gptq", "nf4", "fp8", "gguf:Q4_0"])
def test_quantized_bases_equal_peft_over_the_dequantized_base(base, target, tmp_path):
    """A float16 or quantized base (converted from the tiny model) with an adapter on the exact float32 path
    equals peft over transformers loading the same base widened to float32 (a lossless conversion)."""
    import quanta
    from transformers import AutoModelForCausalLM
    path, _, adapters = base
    out = tmp_path / ("base.gguf" if target.startswith("gguf") else "base")
    to, _, dtype = target.partition(":") if target.startswith("hf") else (target, "", None)
    quanta.convert(path, to, out, validate=False, quiet=True, dtype=dtype or None)
    quanta.convert(out, "hf", tmp_path / "dequantized", dtype="float32", validate=False, quiet=True)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", dtype=torch.float32).eval()
    request, _ = adapters[0]
    peft_model = peft.PeftModel.from_pretrained(reference, request.lora_path).eval()
    ps = prompts(3, seed=3)
    with LLM(str(out), enable_lora=True, **EXACT) as llm:
        got = token_ids(llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, lora_request=request))
    assert got == [oracle(peft_model, p) for p in ps]


def test_lora_requests_need_enable_lora_and_a_fitting_rank(base):
    path, _, adapters = base
    with LLM(str(path), **EXACT) as llm:
        with pytest.raises(ConfigError, match="enable_lora"):
            llm.generate([[5, 6, 7]], GREEDY, lora_request=adapters[0][0])
    with LLM(str(path), enable_lora=True, max_lora_rank=8, **EXACT) as llm:
        with pytest.raises(ConfigError, match="max_lora_rank=8"):
            llm.generate([[5, 6, 7]], GREEDY, lora_request=adapters[2][0])      # rank 16
        with pytest.raises(ConfigError, match="already 'a0'"):
            llm.generate([[5, 6, 7]], GREEDY, lora_request=[adapters[0][0]])
            llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("other", 1, adapters[1][0].lora_path))
        with pytest.raises(ConfigError, match="2 LoRA requests for 1 prompts"):
            llm.generate([[5, 6, 7]], GREEDY, lora_request=[None, None])
    with pytest.raises(ConfigError, match="lora_int_id"):
        LoRARequest("x", 0, "somewhere")


def test_the_memory_plan_counts_adapter_slots():
    from quanta.planner.memory_plan import plan
    without = plan("llama-3-8b", quantization="awq", gpus="1x24GiB", max_model_len=4096)
    with_slots = plan("llama-3-8b", quantization="awq", gpus="1x24GiB", max_model_len=4096, enable_lora=True,
                      max_loras=8, max_lora_rank=16)
    # per slot and layer: A (3*16*4096 + 16*4096 + 2*16*4096 + 16*14336) and B ((4096+2*1024)*16 + 4096*16
    # + 2*14336*16 + 4096*16) in float16, plus 7 float32 scales
    a = 3 * 16 * 4096 + 16 * 4096 + 2 * 16 * 4096 + 16 * 14336
    b = (4096 + 2 * 1024) * 16 + 4096 * 16 + 2 * 14336 * 16 + 4096 * 16
    expected = 8 * 32 * ((a + b) * 2 + 7 * 4)
    assert with_slots.lora_slots == expected and without.lora_slots == 0
    assert without.kv_cache_bytes - with_slots.kv_cache_bytes == expected


def test_generate_cli_runs_with_an_adapter(base):
    """`quanta generate --lora ADAPTER` prints what the offline engine gives with that adapter."""
    import subprocess
    import sys
    from pathlib import Path
    path, _, adapters = base
    request = adapters[1][0]
    out = subprocess.run([sys.executable, "-m", "quanta.cli.main", "-q", "generate", "--model", str(path),
                          "--lora", request.lora_path, "--prompt-token-ids", "5,6,7,8", "--max-tokens", "6",
                          "--ignore-eos", "--dtype", "float32", "--device", "cpu", "--max-model-len", "64"],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    with LLM(str(path), enable_lora=True, **EXACT) as llm:
        want = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=6, temperature=0.0,
                            ignore_eos=True), lora_request=LoRARequest("lora", 1, request.lora_path))[0]
        base_out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=6, temperature=0.0,
                                ignore_eos=True))[0]
    assert out.stdout.strip() == want.outputs[0].text.strip() != base_out.outputs[0].text.strip()


def test_a_gguf_adapter_over_a_gguf_base_equals_llama_cpp(base, tmp_path):
    """llama.cpp's own GGUF LoRA path (llama-cpp-python, where installed) is the oracle: a GGUF base with a GGUF
    adapter, as convert_lora_to_gguf writes it, gives llama.cpp's greedy tokens, and the same as the peft
    adapter it was written from."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import quanta
    from test_lora_adapter import write_gguf_lora
    path, _, adapters = base
    request, peft_model = adapters[0]
    quanta.convert(path, "gguf:F32", tmp_path / "base.gguf", validate=False, quiet=True)
    write_gguf_lora(tmp_path / "lora.gguf", peft_model, alpha=16.0)          # r=8, alpha 16, as the peft one
    ids = [5, 17, 42, 99, 7, 3]
    llm = llama_cpp.Llama(model_path=str(tmp_path / "base.gguf"), lora_path=str(tmp_path / "lora.gguf"), n_ctx=128,
                          verbose=False)
    want = []
    for token in llm.generate(ids, temp=0.0, top_k=1):
        want.append(token)
        if len(want) == GREEDY.max_tokens:
            break
    with LLM(str(tmp_path / "base.gguf"), enable_lora=True, max_loras=2, **EXACT) as ours:
        got = [token_ids(ours.generate([{"prompt_token_ids": ids}], GREEDY, lora_request=r))[0]
               for r in (LoRARequest("gguf", 9, str(tmp_path / "lora.gguf")), request)]
    assert got == [want, want]
