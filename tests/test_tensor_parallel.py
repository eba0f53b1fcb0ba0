"""Tensor parallelism on the CPU: real gloo process groups (ranks 1.. spawned by the engine), each rank
holding its shard. The oracle is the same engine at TP = 1: greedy tokens equal, logits within float32
reordering of the all-reduce (the dequantized kernel computes in float32). Models: synthetic ones in
every canonical kind (affine with and without act-order, NF4, FP8 block scales, GGUF K-quant and legacy
blocks) and checkpoints written by AutoAWQ and GPTQModel (tests/fixtures). Unshardable configurations
are refused with ConfigError before any rank loads, or, where only the load can tell, by every rank."""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from quanta.engine import LLM, SamplingParams
from quanta.quant.errors import ConfigError
from quanta.quant.shard import ShardError

FIXTURES = Path(__file__).parent / "fixtures"
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
BASE = dict(dtype="float32", device="cpu", kernel="dequantized", max_model_len=128, num_kv_blocks=24, quiet=True)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 3, 12)]


def run(model: str, **kw):
    """(greedy tokens of every prompt, logits of the first prompt, rank 0's first decoder layer) of one engine."""
    with LLM(model, **BASE, **kw) as llm:
        ps = prompts(llm.model.config.vocab_size)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs], llm.prompt_logits(ps[0]), llm.model.model.layers[0])


def assert_same_as_tp1(model: str, tp: int):
    """Greedy tokens equal and logits close at TP = tp and at TP = 1; rank 0's first decoder layer."""
    tokens, logits, layer = run(model)
    tokens_tp, logits_tp, layer_tp = run(model, tensor_parallel_size=tp)
    assert layer_tp.self_attn.num_heads * tp == layer.self_attn.num_heads     # rank 0 holds its share of the heads
    torch.testing.assert_close(logits_tp, logits, atol=5e-4, rtol=1e-4)      # float32 sums in another order
    assert tokens_tp == tokens
    return layer_tp


def test_a_cut_found_at_load_stops_every_rank():
    # fp8 block scales are not in the plan's format model: rows of 256 a rank cut the 512-row blocks of q_proj,
    # which each rank finds as it loads; rank 0 raises, the spawned rank exits, and the group is gone (so a new
    # one can start, as the next tests do)
    with pytest.raises(ShardError, match="512-wide"):
        LLM("synthetic:tiny-tp:fp8b512", **BASE, tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()


def test_a_rank_that_dies_before_joining_is_reported_at_once(monkeypatch):
    """A spawned rank whose process exits before it joins the group (its interpreter here is `false`) makes rank
    0 raise within seconds, naming the rank and its exit status, instead of waiting out the group's timeout."""
    monkeypatch.setattr(sys, "executable", shutil.which("false"))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with status 1 before joining"):
        LLM("synthetic:tiny-tp:fp16", **BASE, tensor_parallel_size=2)
    assert time.monotonic() - start < 60
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("model", [
    "synthetic:tiny-tp:nf4", "synthetic:tiny-tp:fp8b64", "synthetic:tiny-tp:gguf-q4_K",
    str(FIXTURES / "awq/gemm_g32"), str(FIXTURES / "gptq/b4_g32_asym_descact"),
], ids=lambda m: m.rsplit("/", 2)[-1] if "/" in m else m.split(":")[-1])
def test_tp2_equals_tp1(model):
    assert_same_as_tp1(model, 2)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["w4g64act", "fp8", "gguf-q8_0"])
def test_tp4_equals_tp1(fmt):
    # 8 heads over 2 KV heads: at 4 ranks each KV head is replicated on two of them; 510 tokens padded to 512
    assert_same_as_tp1(f"synthetic:tiny-tp:{fmt}", 4)


@pytest.mark.parametrize("fmt, tp", [("gguf-q4_K", 2), ("gguf-q6_K", 4), ("w4g128", 4),
                                     pytest.param("gguf-q3_K", 4, marks=pytest.mark.slow)])
def test_groups_and_blocks_that_straddle_the_ranks_are_held_whole_by_both(fmt, tp):
    """down_proj's 1280 columns cut into 640 / 320 a rank: a 256-wide ggml block or 128-column group lies across
    two ranks, and both hold it whole, their inputs zero on the columns the other rank owns (shard.widened_cols).
    At 4 ranks o_proj's 256-wide blocks straddle too."""
    down = assert_same_as_tp1(f"synthetic:tiny-tp-straddle:{fmt}", tp).mlp.down_proj
    assert down.pad != (0, 0) and down.in_features == 1280 // tp        # rank 0: its blocks widened to the right


@pytest.mark.parametrize("model, tp, match", [
    ("synthetic:tiny-tp:w4g64", 3, r"8 attention heads do not split over 3 ranks; sizes that would: 1, 2, 4, 8"),
    ("synthetic:tiny-tp:w4g64", 16, r"needs 1\.\.2 GPUs|8 attention heads do not split over 16 ranks"),
])
def test_unshardable_configurations_are_refused_before_loading(model, tp, match):
    with pytest.raises(ConfigError, match=match):
        LLM(model, **BASE, tensor_parallel_size=tp)


def test_start_up_plan_is_per_rank():
    # Llama-3-70B in 4-bit (~35 GiB of weights) cannot fit one 40 GiB card but fits two at TP = 2, each holding half
    from quanta.engine.config import EngineConfig
    from quanta.loaders.formats import Source
    from quanta.planner.fit_check import check_fits
    from quanta.loaders.synthetic import load_synthetic
    model = "synthetic:llama3-70b:w4g128"
    ckpt = load_synthetic(model, "cpu")
    mc, source = ckpt.config, Source.of(ckpt)
    with pytest.raises(ConfigError, match="does not fit"):
        check_fits(EngineConfig(model, device="cpu", max_model_len=4096), 1, mc, source, 40 * 2**30, model)
    p = check_fits(EngineConfig(model, device="cpu", max_model_len=4096), 2, mc, source, 40 * 2**30, model)
    assert p.fits and p.tensor_parallel_size == 2 and 15 * 2**30 < p.weights.total < 20 * 2**30


def test_rank_of_4_shape_is_one_rank_of_70b_at_tp4():
    # benchmarks time one rank's decode on one GPU with this shape: it must hold what TP = 4 gives a rank,
    # piece by piece
    from quanta.engine.config import EngineConfig
    from quanta.loaders.formats import Source
    from quanta.planner.fit_check import check_fits
    from quanta.loaders.synthetic import load_synthetic
    def weights(model, tp):
        ckpt = load_synthetic(model, "cpu")
        return check_fits(EngineConfig(model, device="cpu", max_model_len=4096), tp, ckpt.config, Source.of(ckpt),
                          80 * 2**30, model).weights
    assert weights("synthetic:llama3-70b-rank-of-4:w4g128", 1) == weights("synthetic:llama3-70b:w4g128", 4)


def test_kept_pieces_hold_only_their_own_memory():
    # the embedding and the dense lm_head keep their piece as cut: a view would pin the whole table on every rank
    with LLM("synthetic:tiny-tp:w4g64", **(BASE | dict(dtype="float16")), tensor_parallel_size=2) as llm:
        for t in (llm.model.model.embed_tokens.table, llm.model.lm_head.state):
            assert t.shape[0] == 255 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_async_scheduling_under_tp_equals_tp1():
    # rank 0 launches each decode step before the last one's tokens reach the host: the workers get them on the device
    tokens = run("synthetic:tiny-tp:w4g64")[0]
    with LLM("synthetic:tiny-tp:w4g64", **BASE, tensor_parallel_size=2, async_scheduling=True) as llm:
        assert llm.scheduler.async_scheduling
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts(llm.model.config.vocab_size)], GREEDY,
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tokens
