"""The README's first command must not hinge on a near tie.

A 135M model's greedy answer can flip when any kernel rounds activations differently (a bf16 GEMM input,
another torch build), and then it rarely recovers. So the README's question is one whose every greedy
step, on the exact path (weights dequantized once, float32 throughout), leads the runner-up by a clear
margin, and the default path (4-bit GEMMs at bf16 input, bf16 lm_head) gives the same text.
"""
from __future__ import annotations

import pytest

from quanta.engine import LLM, SamplingParams

README_QUESTION = "What is the capital of France? Answer with the city name."
CONVERSATIONS = [
    ([{"role": "user", "content": README_QUESTION}], "The capital of France is Paris."),
    ([{"role": "user", "content": README_QUESTION},
      {"role": "assistant", "content": "The capital of France is Paris."},
      {"role": "user", "content": "And of Japan?"}], "The capital of Japan is Tokyo."),
]
# Logit lead of the greedy token over the runner-up, at every step. The default path's logits differ
# from the exact path's by a few tenths at most on this model; a lead of a whole logit cannot flip.
MIN_MARGIN = 1.0


@pytest.fixture(scope="module")
def exact(default_model_path):
    return LLM(model=str(default_model_path), dtype="float32", kernel="dequantized", quiet=True)


@pytest.fixture(scope="module")
def default(default_model_path):
    return LLM(model=str(default_model_path), quiet=True)


def _answer(llm: LLM, messages) -> tuple[list[int], list[int], str]:
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=32),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    return prompt, list(out.token_ids), out.text


@pytest.mark.parametrize("messages, expected", CONVERSATIONS)
def test_every_greedy_step_leads_clearly_on_the_exact_path(exact, messages, expected):
    prompt, answer, text = _answer(exact, messages)
    assert text == expected
    logits = exact.prompt_logits(prompt + answer)[len(prompt) - 1:]   # the step choosing each answer token
    top2 = logits.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    assert logits.argmax(-1).tolist()[:len(answer)] == answer
    assert min(margins) >= MIN_MARGIN, [round(m, 3) for m in margins]


@pytest.mark.parametrize("messages, expected", CONVERSATIONS)
def test_default_path_gives_the_same_text(default, messages, expected):
    assert _answer(default, messages)[2] == expected
