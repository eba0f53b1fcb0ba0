"""Incremental detokenization (quanta/engine/detokenizer.py) against whole decodes of the real tokenizer."""
from __future__ import annotations

import pytest

from quanta.engine.detokenizer import IncrementalDetokenizer
from quanta.engine.sampling_params import SamplingParams
from quanta.engine.sequence import Sequence

TEXTS = ["Hello, world! The café serves crème brûlée.", "日本語のテキストと絵文字 🚀🎉 mixed in",
         "  leading spaces,\ttabs\nand newlines  ", "def f(x):\n    return x ** 2  # ünïcödé"]


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from quanta.engine.config import EngineConfig
    from quanta.engine.model_loader import open_checkpoint
    tok = open_checkpoint(EngineConfig.from_kwargs(str(default_model_path), device="cpu")).tokenizer
    if tok is None:
        pytest.skip("the default model has no tokenizer")
    return tok


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_whole_decode(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)            # never half a UTF-8 character
    if any(ord(c) > 0xFFF for c in text):                    # emoji/CJK span tokens: some push emits nothing
        assert "" in pieces


def test_cost_per_token_does_not_grow(tokenizer):
    ids = tokenizer(" ".join(TEXTS) * 40)["input_ids"]
    counting = CountingTokenizer(tokenizer)
    IncrementalDetokenizer(counting).extend(ids)
    assert len(ids) > 500
    assert max(counting.sizes) <= 8                          # a short window, however long the output


def test_stop_string_across_tokens_and_multibyte(tokenizer):
    text = "The rocket 🚀 launched at dawn and the crowd cheered loudly."
    ids = tokenizer(text)["input_ids"]
    for stop, include in (("launched at", False), ("🚀 la", True), ("cheered", False)):
        pieces = [tokenizer.decode([t]) for t in ids]
        assert stop not in pieces                            # the stop string spans token boundaries
        seq = Sequence("r", 0, [1], SamplingParams(stop=[stop], max_tokens=100, include_stop_str_in_output=include))
        for t in ids:
            seq.append(t, tokenizer, eos_ids=[])
            if seq.finished:
                break
        cut = text.index(stop) + (len(stop) if include else 0)
        assert seq.finish_reason == "stop" and seq.stop_reason == stop
        assert seq.text == text[:cut]
