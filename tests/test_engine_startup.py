"""Engine start-up: a KV pool that cannot hold max_model_len is refused before any weight is built, and
`quiet` silences the progress bars."""
from __future__ import annotations

import re
from collections.abc import Mapping

import pytest

from quanta.engine import LLM, SamplingParams
from quanta.engine.config import EngineConfig
from quanta.engine.core import EngineCore
from quanta.engine.synthetic import load_synthetic
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
