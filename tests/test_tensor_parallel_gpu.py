"""Tensor parallelism on GPUs (NCCL, rank r on cuda:r, CUDA graphs with the all-reduce captured): the
synthetic Llama-3-8B at TP = 2 gives TP = 1's greedy tokens, with the small all-reduces on the one-shot
kernel and with NCCL for all. Run on a machine with two GPUs: -m gpu."""
from __future__ import annotations

import pytest
import torch

from quanta.engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
MODEL = "synthetic:llama3-8b:w4g128"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def greedy(tp: int, **kw) -> tuple[list[list[int]], torch.Tensor, bool]:
    prompts = [[(7 * i + 3 * j) % 1000 + 10 for i in range(n)] for j, n in enumerate((5, 40, 130))]
    with LLM(MODEL, tensor_parallel_size=tp, gpu_memory_utilization=0.5, max_model_len=512, max_num_seqs=8,
             quiet=True, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        one_shot = llm.core.tp is not None and llm.core.tp.one_shot is not None
        return [o.outputs[0].token_ids for o in outs], llm.prompt_logits(prompts[1]).cpu(), one_shot


@pytest.fixture(scope="module")
def tp1():
    return greedy(1)


@pytest.mark.parametrize("enforce_eager,nccl", [(False, False), (True, False), (False, True)],
                         ids=["graphs", "eager", "graphs-nccl-only"])
def test_tp2_greedy_equals_tp1(tp1, enforce_eager, nccl):
    tokens, logits, one_shot = greedy(2, enforce_eager=enforce_eager, disable_custom_all_reduce=nccl)
    assert one_shot == (not nccl)
    # bf16 / fp16 partial sums reordered by the all-reduce: logits agree to the compute dtype's precision
    torch.testing.assert_close(logits, tp1[1], atol=0.25, rtol=0.05)
    assert (logits.argmax(-1) == tp1[1].argmax(-1)).float().mean() > 0.95
    assert tokens == tp1[0]
