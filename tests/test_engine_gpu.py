"""The paged engine on a CUDA GPU: Triton paged attention + fp8 KV inside the model, CUDA graphs
against eager, memory sizing, and transformers agreement. Run with `pytest -m gpu`."""
from __future__ import annotations

import pytest
import torch

from quanta.engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LOGIT_TOL = 5e-2            # |our fp16 logits - transformers' fp16 logits|, asserted on the prompt
TIE_MARGIN = 2 * LOGIT_TOL  # a reference lead below this may flip under that error; a larger one may not


@pytest.fixture(autouse=True)
def release_memory():
    """Each LLM sizes its KV cache from gpu_memory_utilization; free the previous tests' engines."""
    yield
    import gc
    gc.collect()
    torch.cuda.empty_cache()


def prompts(lengths, vocab=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in lengths]


def tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def agreement(a, b) -> float:
    """Share of generated tokens before the first divergence (greedy fp16 may split on near-ties)."""
    total = same = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        same, total = same + n, total + len(x)
    return same / total


def assert_greedy_agrees_except_near_ties(llm, ids: list[int], ref_tokens: list[int],
                                          ref_logits: list[torch.Tensor]) -> int:
    """Our greedy continuation of `ids` equals the reference's (`ref_tokens`, with its logits at each step) at
    every step where the reference's top-2 lead is at least TIE_MARGIN. At a near tie ours may take any
    token within TIE_MARGIN of the best; generation then resumes from the reference's prefix, so every
    later step is checked too. Returns the number of steps checked exactly."""
    start, exact = 0, 0
    while start < len(ref_tokens):
        prompt = {"prompt_token_ids": ids + ref_tokens[:start]}
        params = SamplingParams(max_tokens=len(ref_tokens) - start, temperature=0.0, ignore_eos=True)
        ours = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        for step, (mine, theirs) in enumerate(zip(ours, ref_tokens[start:]), start):
            logits = ref_logits[step]
            best, second = logits.topk(2).values.tolist()
            if best - second >= TIE_MARGIN:
                exact += 1
            if mine != theirs:
                assert best - second < TIE_MARGIN, f"step {step}: ours {mine}, reference {theirs} by {best - second:.4f}"
                assert logits[mine] >= best - TIE_MARGIN, f"step {step}: ours {mine} is not near the reference's best"
                start = step + 1
                break
        else:
            break
    return exact


def assert_pool_empty(llm):
    assert llm.pool.num_free == llm.pool.num_blocks and not llm.has_unfinished()


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e5m2"])
def test_graphs_match_eager_and_batch_matches_alone(kv):
    model = "synthetic:tiny:fp16"
    graphs = LLM(model=model, kv_cache_dtype=kv, gpu_memory_utilization=0.2, max_num_seqs=16)
    eager = LLM(model=model, kv_cache_dtype=kv, gpu_memory_utilization=0.2, max_num_seqs=16, enforce_eager=True)
    assert graphs.runner.graphs and not eager.runner.graphs
    ps = prompts((1, 5, 16, 17, 63, 200, 31))
    a = tokens(graphs.generate(ps, GREEDY, use_tqdm=False))
    b = tokens(eager.generate(ps, GREEDY, use_tqdm=False))
    alone = [tokens(graphs.generate(p, GREEDY, use_tqdm=False))[0] for p in ps]
    assert agreement(a, b) >= 0.9 and agreement(a, alone) >= 0.9
    for llm in (graphs, eager):
        assert_pool_empty(llm)


def assert_engines_agree(make, ps) -> None:
    """Two engines from `make(first: bool)`: the longest prompt's logits within LOGIT_TOL, and greedy batch-1 tokens
    (prefill, then decode in CUDA graphs) the same but for near ties. The split-K GEMV adds its partial sums by
    float32 atomics, whose order varies from run to run, so two engines agree to that rounding, not bit for bit
    (the interpreter tests check the kernels bit for bit); a wiring mistake gives other logits altogether."""
    runs = []
    for first in (True, False):
        with make(first) as llm:
            runs.append(([tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in ps],
                         llm.prompt_logits(ps[-1]["prompt_token_ids"])))
    (a, logits_a), (b, logits_b) = runs
    torch.testing.assert_close(logits_a, logits_b, atol=LOGIT_TOL, rtol=0.01)
    assert agreement(a, b) >= 0.9


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_rope_in_the_qkv_gemv_decodes_as_the_rotary_kernel(kv, monkeypatch):
    """Batch-1 decode with rotary and the KV store in the q/k/v GEMV's epilogue decodes as the GEMV, then the
    rotary kernel (assert_engines_agree)."""
    from quanta.engine.layers import MergedQuantLinear
    from quanta.kernels.affine import plan
    fused_calls, matmul_rope = [], plan.matmul_rope

    def counted(*args):
        y = matmul_rope(*args)
        fused_calls.append(y is not None)
        return y

    def make(fused: bool):
        if fused:
            monkeypatch.setattr(plan, "matmul_rope", counted)
        else:
            monkeypatch.setattr(MergedQuantLinear, "forward_rope_store", lambda self, x, rope: None)
        return LLM("synthetic:tiny-tp:w4g64", kv_cache_dtype=kv, gpu_memory_utilization=0.2)
    assert_engines_agree(make, prompts((1, 7, 40)))
    assert any(fused_calls)


def test_norms_written_in_the_act_order_weights_order_decode_as_the_gathering_gemv(monkeypatch):
    """An act-order model: the norms write q/k/v's and gate/up's inputs in their weights' sorted column order
    (LlamaDecoderLayer.feed_in_weight_order) and the GEMMs read them in order; prefill and decode agree with the
    GEMMs gathering their inputs themselves (assert_engines_agree)."""
    from quanta.engine.models.llama import LlamaDecoderLayer

    def make(ordered: bool):
        if not ordered:
            monkeypatch.setattr(LlamaDecoderLayer, "feed_in_weight_order", lambda self: None)
        llm = LLM("synthetic:tiny-tp:w4g64act", gpu_memory_utilization=0.2)
        layers = llm.runner.model.model.layers
        assert all((n.order is not None) == ordered for layer in layers
                   for n in (layer.input_layernorm, layer.post_attention_layernorm))
        assert all((layer.self_attn.qkv_proj.fused.state.perm is None) == ordered for layer in layers)
        return llm
    assert_engines_agree(make, prompts((1, 7, 40)))


def test_memory_sizing_and_fp8_capacity():
    auto = LLM(model="synthetic:tiny:fp16", gpu_memory_utilization=0.2, enforce_eager=True)
    fp8 = LLM(model="synthetic:tiny:fp16", gpu_memory_utilization=0.2, enforce_eager=True, kv_cache_dtype="fp8")
    assert auto.num_kv_blocks > 0
    assert fp8.num_kv_blocks >= 1.9 * auto.num_kv_blocks


def test_tiny_hf_model_matches_transformers_on_gpu(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tiny_models import make_tiny_hf
    make_tiny_hf("mistral", tmp_path / "m")                 # GQA + sliding window 16
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float16).cuda()
    ours = LLM(model=str(tmp_path / "m"), dtype="float16", gpu_memory_utilization=0.2, max_model_len=512)
    ids = prompts([45], vocab=theirs.config.vocab_size)[0]["prompt_token_ids"]
    with torch.no_grad():
        ref = theirs(torch.tensor([ids], device="cuda")).logits[0].float()
    got = ours.prompt_logits(ids)
    assert (got - ref).abs().max().item() < LOGIT_TOL
    for prompt in [ids] + [p["prompt_token_ids"] for p in prompts([20, 70], vocab=theirs.config.vocab_size, seed=1)]:
        hf = theirs.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        hf_tokens, hf_logits = hf.sequences[0, len(prompt):].tolist(), [step[0].float() for step in hf.logits]
        assert len(hf_tokens) == len(hf_logits) == 24
        assert_greedy_agrees_except_near_ties(ours, prompt, hf_tokens, hf_logits) > 0


def test_preemption_and_prefix_cache_on_gpu():
    llm = LLM(model="synthetic:tiny:fp16", num_kv_blocks=12, max_model_len=128, max_num_seqs=8,
              schedule_conservativeness=0)
    ps = prompts((40, 41, 42, 43, 44, 45))
    a = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    assert llm.scheduler.num_preemptions > 0
    big = LLM(model="synthetic:tiny:fp16", gpu_memory_utilization=0.2, max_num_seqs=8, enable_prefix_caching=False)
    assert agreement(a, tokens(big.generate(ps, GREEDY, use_tqdm=False))) >= 0.9
    assert_pool_empty(llm)
    assert_pool_empty(big)


@pytest.mark.parametrize("model", ["synthetic:tiny-tp:w4g64", "synthetic:tiny-tp:gguf-q4_K_M"])
def test_no_kernel_compiles_while_serving(model, tmp_path, monkeypatch):
    """Start-up compiles every kernel config an eager step can meet (ModelRunner.compile_step_shapes): a workload of
    varied prompt lengths, chunked and mixed with decodes, then finds each of its kernels compiled (a kernel
    compiled in this process before the engine started, for another test, is compiled already either way)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))

    def compiled():
        return {f.name for f in tmp_path.rglob("*.json") if not f.name.startswith("__grp__")}

    llm = LLM(model, gpu_memory_utilization=0.2, max_num_batched_tokens=700, max_num_seqs=48)
    started = compiled()
    outs = llm.generate(prompts([3, 17, 100, 250, 511, 64, 1000, 5, 40, 129, 2, 300] * 4, seed=1),
                        SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert compiled() - started == set()
    assert_pool_empty(llm)
