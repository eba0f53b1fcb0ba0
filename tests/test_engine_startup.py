"""Engine start-up: a KV pool that cannot hold max_model_len is refused before any weight is built,
`quiet` silences the progress bars, and one Triton-or-torch decision reaches every elementwise op, the
KV store and attention."""
from __future__ import annotations

import re
from collections.abc import Mapping

import pytest
import torch

from quanta.engine import LLM, SamplingParams
from quanta.engine.config import EngineConfig
from quanta.engine.core import EngineCore
from quanta.engine.layers import MergedQuantLinear, RMSNorm, RotaryEmbedding
from quanta.loaders.synthetic import load_synthetic
from quanta.kernels.device_caps import PRESETS, use_triton
from quanta.quant.errors import ConfigError

LLAMA3_8B = "synthetic:llama3-8b:w4g128"


class Untouchable(Mapping):
    """A checkpoint's tensors that fail the test as soon as one is read (a weight being built)."""

    def __init__(self, tensors: Mapping):
        self.tensors = tensors

    def __getitem__(self, name):
        raise AssertionError(f"{name} was read: the engine started building weights")

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)


@pytest.mark.parametrize("pool, holds", [({}, "4096 tokens (256 blocks of 16)"),      # 1 GiB, the CPU default
                                         ({"num_kv_blocks": 100}, "1600 tokens (100 blocks of 16)")])
def test_impossible_kv_pool_is_refused_before_weights_are_built(pool, holds):
    """Llama-3-8B's shapes on the CPU (float32 KV: 4 MiB a block) with max_model_len 8192."""
    checkpoint = load_synthetic(LLAMA3_8B, "cpu")
    checkpoint.tensors = Untouchable(checkpoint.tensors)
    config = EngineConfig(model=LLAMA3_8B, device="cpu", **pool)
    with pytest.raises(ConfigError, match=re.escape(f"holds {holds}, less than max_model_len=8192")):
        EngineCore(config, checkpoint=checkpoint)


def test_quiet_silences_progress_bars(capsys):
    for quiet in (False, True):
        llm = LLM(model="synthetic:tiny:w4g32", device="cpu", dtype="float32", num_kv_blocks=16,
                  max_model_len=128, quiet=quiet)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        err = capsys.readouterr().err
        assert ("loading" in err, "generating" in err) == (not quiet, not quiet), err


@pytest.mark.parametrize("device, caps, dtype, triton", [
    ("cuda", "sm75", torch.bfloat16, False),    # a T4 has no bf16 arithmetic: torch everywhere
    ("cuda", "sm75", torch.float16, True),
    ("cuda", "sm80", torch.bfloat16, True),
    ("cuda", "sm90", torch.float32, True),
    ("cpu", "cpu", torch.float16, False)])
def test_one_triton_decision_reaches_every_elementwise_op_and_attention(device, caps, dtype, triton):
    """The rule answers for a chip given as a value; the core hands its one answer to every norm, the
    rotary embedding, the SiLU-and-mul of the merged GEMMs and the KV cache, whose flag attention reads."""
    decision = use_triton(torch.device(device), dtype, PRESETS[caps])
    assert decision is triton
    config = EngineConfig(model="synthetic:tiny:fp16", device="cpu", dtype="float32", num_kv_blocks=16,
                          max_model_len=64, quiet=True)
    core = EngineCore(config, triton_ops=decision)
    ops = [m for m in core.model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, MergedQuantLinear))]
    assert {type(m) for m in ops} == {RMSNorm, RotaryEmbedding, MergedQuantLinear}
    assert [m.triton for m in ops] + [core.kv_cache.triton] == [triton] * (len(ops) + 1)


def test_start_up_step_sizes_run_and_leave_generation_as_it_was():
    """compile_step_shapes (the GPU start-up's run over every eager step size, on the profile's scratch runner) runs
    each size's forward and logits here on the CPU's engine, over the plans' row classes and the powers of two, then
    mixed steps of each graph bucket's decodes over 1, 16 and 17 table blocks; the engine then generates what one
    that never ran them generates."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 9, 2, 41, 7, 3, 8]}]
    fresh = LLM("synthetic:tiny:fp16", device="cpu", max_num_batched_tokens=80, max_num_seqs=4)
    want = fresh.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM("synthetic:tiny:fp16", device="cpu", max_num_batched_tokens=80, max_num_seqs=4)
    runner, steps = llm.core.runner, []
    prepare = runner.prepare
    runner.prepare = lambda batch: steps.append(batch) or prepare(batch)
    sizes = runner.compile_step_shapes()
    assert sizes == runner.step_sizes() and {1, 2, 16, 17, 64, 65, 80} <= set(sizes) and max(sizes) == 80
    mixed = {(sum(it.num_tokens == 1 for it in b), max(len(it.seq.block_table) for it in b))
             for b in steps[len(sizes):]}
    assert mixed == {(d, w) for d in (1, 2, 4) for w in (1, 16, 17)}    # decodes of each graph bucket, table widths
    del runner.prepare
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
