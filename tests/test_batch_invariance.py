"""Batch invariance of the CPU path: a request's greedy tokens and logits are those of the request run
alone, bit for bit, whatever runs beside it (a mixed batch with prefill chunks and more than 32 rows of
logits), after its sequence is preempted and recomputed, and over blocks from the prefix cache.

The kernels first: every row of cpu_matmul's F.linear, of torch's packed int4 / int8 GEMMs and of
cpu_attention equals that row computed alone (and each agrees with its float oracle: a float64 matmul,
torch's SDPA over the gathered cache); then the engine, on a small synthetic model (float32 layers, a
bfloat16 lm_head) and on the default model (SmolLM2-135M Q4_1: int4 layers), whose near ties flipped greedy
tokens before. Each engine test failed before the CPU path was made batch-invariant."""
from __future__ import annotations

import pytest
import torch

from quanta.engine import LLM, SamplingParams
from quanta.kernels import paged_attention
from quanta.cpu import attention as cpu_attention, int4 as cpu_int4, int8 as cpu_int8, matmul as cpu_matmul
from test_affine_gemm import make_affine
from test_paged_attention import build

CPU = torch.device("cpu")


def _rows_alone(f, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([f(x[i:i + 1]) for i in range(x.shape[0])])


# --- kernels -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("n,k", [(64, 48), (73, 423), (576, 576), (3072, 576)])
def test_cpu_matmul_rows_do_not_depend_on_the_batch(dtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(70, k, generator=g).to(dtype)
    alone = _rows_alone(lambda r: cpu_matmul.linear(r, w, bias), x)
    for m in (2, 3, 16, 17, 33, 70):
        assert torch.equal(cpu_matmul.linear(x[:m], w, bias), alone[:m]), m
    assert torch.equal(cpu_matmul.linear(x.view(7, 10, k), w, bias), alone.view(7, 10, n))
    exact = x.double() @ w.double().T + bias.double()
    assert (alone.double() - exact).abs().max() <= {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 0.02}[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_refine_top_gives_float32_logits_at_the_top(dtype):
    """A 16-bit lm_head's logits with the candidates for each row's maximum recomputed from float32 inputs:
    the row's argmax is that of the float64 product of the same weights, no candidate is missed (every
    entry within the 16-bit error of the top is recomputed), and a row's result does not depend on the
    others. 64 rows close to one direction that the inputs follow crowd the top: 16-bit ties."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 576, generator=g) * 0.02
    base = torch.randn(576, generator=g) * 0.05
    w[:64] = base + 0.002 * torch.randn(64, 576, generator=g)
    w = w.to(dtype)
    x = base * 40 + torch.randn(40, 576, generator=g)
    colmax = cpu_matmul.column_max(w)

    def refined(rows):
        return cpu_matmul.refine_top(cpu_matmul.linear(rows.to(dtype), w).float(), rows, w, colmax)

    exact = x.double() @ w.double().T
    narrow = cpu_matmul.linear(x.to(dtype), w).float()
    got = refined(x)
    assert (narrow.topk(2).values.diff(dim=-1) == 0).any()             # ties at the top in 16 bits
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    top = exact.argmax(-1, keepdim=True)
    assert ((got.gather(1, top) - exact.gather(1, top)).abs() < 1e-4).all()
    assert torch.equal(_rows_alone(refined, x), got)


@pytest.mark.parametrize("kernel,bits,group", [(cpu_int4, 4, 32), (cpu_int8, 8, -1), (cpu_int8, 8, 32)],
                         ids=["int4", "int8", "int8-g32"])
def test_cpu_integer_gemms_rows_do_not_depend_on_the_batch(kernel, bits, group):
    """torch's packed int4 / int8 CPU GEMMs, which the engine relies on as they stand."""
    w = make_affine(96, 576, bits, group, "sym", device="cpu")
    state = kernel.prepare(w, CPU, torch.float32)
    x = torch.randn(300, 576)
    alone = _rows_alone(lambda r: kernel.apply(r, state), x)
    for m in (2, 5, 33, 300):
        assert torch.equal(kernel.apply(x[:m], state), alone[:m]), m


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
def test_cpu_attention_matches_sdpa_over_the_cache(fmt):
    """Decodes and prefill chunks, GQA and MQA, a sliding window: against paged_attention.reference (torch's
    SDPA over each sequence's gathered K/V); never-written slots past a sequence's tokens hold NaN."""
    for lens, qlens, hq, hk, d, bs, window in [([1, 17, 40], [1, 9, 40], 4, 2, 24, 16, None),
                                               ([16, 33, 32], [16, 1, 5], 4, 1, 32, 16, None),
                                               ([50, 7], [13, 7], 6, 2, 16, 8, 5)]:
        q, kc, vc, bt, sl, qsl, kw = build(lens, qlens, hq, hk, d, bs, torch.float32, fmt)
        for b, n in enumerate(lens):                       # garbage past each sequence's last token
            last = bt[b, (n - 1) // bs]
            kc[last, (n - 1) % bs + 1:] = 255 if fmt else float("nan")
            vc[last, (n - 1) % bs + 1:] = 255 if fmt else float("nan")
        want = paged_attention.reference(q, kc, vc, bt, sl, qsl, d ** -0.5, sliding_window=window, **kw)
        got = cpu_attention.attend(q, kc, vc, cpu_attention.plan(bt, sl, qsl, bs, window), d ** -0.5,
                                   kw["k_scale"], kw["v_scale"], kw["fmt"])
        assert not got.isnan().any()
        assert (got - want).abs().max() < 1e-5


def test_cpu_attention_rows_do_not_depend_on_the_step():
    """One sequence's 600 rows computed as 600 decodes, as one prefill (calls split by rows x keys), in chunks
    of 1..300 rows, and beside another sequence's prefill: bit for bit the same, though each way a row's
    call holds other rows and another count of masked keys after it (past torch's 512-key KV split)."""
    bs, hq, hk, d, n = 16, 6, 2, 32, 600
    q, kc, vc, bt, _, _, _ = build([n, 40], [n, 40], hq, hk, d, bs, torch.float32)

    def rows(first: int, count: int, other: bool = False) -> torch.Tensor:
        lens, starts = [first + count], [0, count]
        tables, queries = bt[:1], q[first:first + count]
        if other:                                           # the other sequence's prefill first
            lens, starts, tables = [40] + lens, [0, 40, 40 + count], bt[[1, 0]]
            queries = torch.cat([q[n:n + 40], queries])
        sl, qsl = torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)
        out = cpu_attention.attend(queries, kc, vc, cpu_attention.plan(tables, sl, qsl, bs), d ** -0.5)
        return out[-count:]

    decodes = torch.cat([rows(t, 1) for t in range(n)])
    assert torch.equal(rows(0, n), decodes)
    assert torch.equal(rows(0, n, other=True), decodes)
    for chunk in (5, 33, 300):
        assert torch.equal(torch.cat([rows(s, min(chunk, n - s)) for s in range(0, n, chunk)]), decodes), chunk


# --- the engine ----------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
TINY = "synthetic:tiny-tp:fp16"     # float32 layers through cpu_matmul, a bfloat16 lm_head (dtype auto)
FLAGS = dict(device="cpu", max_model_len=128, block_size=16, quiet=True)


def _result(out) -> tuple[list[int], list[float]]:
    """(greedy token ids, the logprob of each), compared bit for bit."""
    c = out.outputs[0]
    return list(c.token_ids), [next(iter(step.values())).logprob for step in c.logprobs]


def _prompts() -> list[dict]:
    """8 token-id prompts of 20-70 tokens, four of them on two shared 40-token stems (prefix-cache hits)."""
    g = torch.Generator().manual_seed(0)
    stems = [torch.randint(3, 500, (40,), generator=g).tolist() for _ in range(2)]
    out = []
    for i in range(8):
        tail = torch.randint(3, 500, (int(torch.randint(20, 31, (1,), generator=g)),), generator=g).tolist()
        out.append({"prompt_token_ids": stems[i % 2] + tail if i < 4 else tail})
    return out


def _staggered(llm: LLM, prompts: list[dict], per_step: int = 3) -> list[tuple]:
    """Requests joining a running batch a few per step; results in prompt order."""
    core, rids, outs = llm.core, [], {}
    for i, prompt in enumerate(prompts):
        rids.append(core.add_request(prompt["prompt_token_ids"], GREEDY))
        if i % per_step == per_step - 1:
            outs.update((o.request_id, o) for o in core.step(stream=False))
    while core.has_unfinished():
        outs.update((o.request_id, o) for o in core.step(stream=False))
    return [_result(outs[r]) for r in rids]


@pytest.fixture(scope="module")
def alone() -> list[tuple]:
    """Each prompt's result run alone, without prefix caching (the oracle of the tests below)."""
    with LLM(TINY, enable_prefix_caching=False, **FLAGS) as llm:
        return [_result(llm.generate(p, GREEDY, use_tqdm=False)[0]) for p in _prompts()]


def test_greedy_request_in_a_mixed_batch_equals_it_alone(alone):
    """40 requests (the 8 prompts five times) joining a running batch three per step, prompts prefilled in
    chunks of a 24-token budget beside the others' decodes, up to 40 rows of logits in a step."""
    with LLM(TINY, enable_prefix_caching=False, max_num_batched_tokens=24, **FLAGS) as llm:
        assert _staggered(llm, _prompts() * 5) == alone * 5


def test_greedy_request_after_preemption_equals_it_alone():
    """Four requests on a pool of 4 blocks: the newest running one is preempted after its first tokens, when
    the oldest needs a block, and recomputed by one prefill of its prompt and tokens so far."""
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (29, 30, 31, 27)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    flags = FLAGS | dict(max_model_len=64, enable_prefix_caching=False)
    with LLM(TINY, **flags) as llm:
        alone = [_result(llm.generate(p, params, use_tqdm=False)[0]) for p in prompts]
    with LLM(TINY, num_kv_blocks=4, schedule_conservativeness=0, **flags) as llm:
        assert [_result(o) for o in llm.generate(prompts, params, use_tqdm=False)] == alone
        assert llm.scheduler.num_preemptions > 0


def test_greedy_request_with_prefix_caching_equals_it_alone(alone):
    """Prompts sharing 40-token stems one after another, then all at once: cached blocks reused."""
    with LLM(TINY, enable_prefix_caching=True, max_num_batched_tokens=32, **FLAGS) as llm:
        assert [_result(llm.generate(p, GREEDY, use_tqdm=False)[0]) for p in _prompts()] == alone
        assert _staggered(llm, _prompts()) == alone
        assert llm.pool.prefix_hits > 0


# Chat prompts whose greedy tokens flipped under chunked prefill before the CPU path was batch-invariant.
CHATS = ["Once upon a time", "Water boils at", "The quick brown fox", "The capital of France is"]


def test_default_model_greedy_equals_alone_chunked_preempted_and_cached(default_model_path):
    """The default model's chat prompts (a shared system prompt: prefix-cache hits), prefilled in chunks of
    8 tokens on a pool of 6 blocks (preemptions): tokens and logprobs equal each prompt run alone."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    flags = dict(device="cpu", max_model_len=64, quiet=True)
    with LLM(str(default_model_path), enable_prefix_caching=False, **flags) as llm:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=False) for text in CHATS]
        alone = [_result(llm.generate(p, params, use_tqdm=False)[0]) for p in prompts]
    with LLM(str(default_model_path), enable_prefix_caching=True, max_num_batched_tokens=8, num_kv_blocks=6,
             schedule_conservativeness=0,
             **flags) as llm:
        assert [_result(o) for o in llm.generate(prompts, params, use_tqdm=False)] == alone
        assert llm.scheduler.num_preemptions > 0 and llm.pool.prefix_hits > 0
