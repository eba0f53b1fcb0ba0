"""The engine's start-up check (check_fits: quanta plan's verdict for the engine's own configuration on a
GPU of a given total) and the max_gpu_memory cap (validation, the KV budget, weights over the cap)."""
from __future__ import annotations

import argparse

import pytest

from quanta.engine import LLM
from quanta.engine.config import EngineConfig
from quanta.loaders.formats import Source
from quanta.planner.fit_check import check_fits
from quanta.planner.memory_plan import format_verdict
from quanta.planner.model_shapes import resolve
from quanta.planner.request import GPU_BATCHED_TOKENS
from quanta.loaders.synthetic import load_synthetic
from quanta.quant.errors import ConfigError
from quanta.cli import plan as plan_cmd

MIB, GIB = 2**20, 2**30
H100 = 81559 * MIB                  # what an 80 GB H100's driver reports as total
MARGINS = 512 * MIB + 512 * MIB     # CUDA graphs' margin + runtime overhead, the plan's stated constants


def config(model: str, **kw) -> EngineConfig:
    """An EngineConfig on the CPU standing in for a GPU: the GPU's step budget, which `quanta plan` assumes."""
    kw.setdefault("max_num_batched_tokens", GPU_BATCHED_TOKENS)
    return EngineConfig(model=model, device="cpu", **kw)


def cli_verdict(argv: list[str], capsys) -> str:
    """The last verdict line `quanta plan ARGV` prints."""
    parser = argparse.ArgumentParser()
    plan_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    args.func(args)
    lines = capsys.readouterr().out.splitlines()
    return next(line for line in lines if line.startswith(("fits:", "does not fit:")))


@pytest.mark.parametrize("value, expected", [("15GiB", 15 * GIB), ("16GB", 16 * 10**9), ("512 MiB", 512 * MIB),
                                             ("t4", 15360 * MIB), (" 1.5GiB ", 3 * GIB // 2), (4096, 4096)])
def test_max_gpu_memory_is_held_in_bytes(value, expected):
    assert config("synthetic:tiny", max_gpu_memory=value).max_gpu_memory == expected


@pytest.mark.parametrize("value", ["15 GiBs", "lots", "", "0GiB", "-1GiB", 0, -5, 1.5, True, [1]])
def test_bad_max_gpu_memory_is_a_config_error(value):
    with pytest.raises(ConfigError, match="max_gpu_memory"):
        config("synthetic:tiny", max_gpu_memory=value)


def test_llm_refuses_a_bad_cap_before_loading():
    with pytest.raises(ConfigError, match="max_gpu_memory 'fifteen'"):
        LLM(model="/nonexistent/model", max_gpu_memory="fifteen")


def test_kv_budget_is_the_smaller_of_utilization_and_the_cap():
    assert config("synthetic:tiny").budget(80 * GIB) == 72 * GIB
    assert config("synthetic:tiny", max_gpu_memory="15GiB").budget(80 * GIB) == 15 * GIB
    assert config("synthetic:tiny", max_gpu_memory="100GiB").budget(80 * GIB) == 72 * GIB


def test_weights_over_the_cap_are_refused():
    config("synthetic:tiny", max_gpu_memory="1GiB").check_weights_under_cap(GIB)
    with pytest.raises(ConfigError, match="weights take 1.50 GiB, more than max_gpu_memory=1.00 GiB"):
        config("synthetic:tiny", max_gpu_memory="1GiB").check_weights_under_cap(3 * GIB // 2)


def check(model: str, total: int, **kw):
    cfg, ckpt = config(model, **kw), load_synthetic(model, "cpu")
    return check_fits(cfg, cfg.tensor_parallel_size, ckpt.config, Source.of(ckpt), total, model)


def test_the_engine_refuses_with_quanta_plans_words(capsys):
    """70B in fp16 (~131 GiB) on one H100: the same sentence as `quanta plan MODEL --gpus h100`."""
    model = "synthetic:llama3-70b:fp16"
    with pytest.raises(ConfigError) as e:
        check(model, H100)
    words = cli_verdict([model, "--gpus", "h100"], capsys)
    assert str(e.value) == words
    assert words.startswith(f"does not fit: {model} (fp16) on 1xh100") and "would fit with" in words


def test_capped_budget_and_kv_capacity_by_hand(capsys):
    """Llama-3-8B W4 g128 capped at 15 GiB on an H100, fp8 KV: the budget is the cap itself, and the
    cache gets what the weights, activations and the two stated margins leave; `quanta plan --gpus h100
    --max-gpu-memory 15GiB` says the same."""
    p = check("synthetic:llama3-8b:w4g128", H100, max_gpu_memory="15GiB", kv_cache_dtype="fp8",
              max_model_len=8192)
    assert p.fits and p.budget == 15 * GIB and p.capped and p.gpu_memory == H100 and p.gpus == "1xh100"
    assert format_verdict(p) == cli_verdict(["synthetic:llama3-8b:w4g128", "--gpus", "h100", "--max-gpu-memory",
                                             "15GiB", "--kv-cache-dtype", "fp8", "--max-model-len", "8192"], capsys)
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 1           # K and V, layers, KV heads, head_dim, 1 byte
    assert p.kv_cache_bytes == 15 * GIB - p.weights.total - p.activation_peak - MARGINS
    assert p.kv_capacity_tokens == p.kv_cache_bytes // (65536 * 16) * 16
    assert p.quantization.startswith("gptq (4-bit, groups of 128")        # the synthetic format, not fp16
    uncapped = check("synthetic:llama3-8b:w4g128", H100, kv_cache_dtype="fp8", max_model_len=8192)
    assert uncapped.budget == int(H100 * 0.9) and uncapped.gpus == "1xh100"


def test_weights_alone_over_the_cap_are_refused_before_loading():
    """70B W4 g128 holds ~35 GiB of weights: a 24 GiB cap leaves nothing for the cache."""
    with pytest.raises(ConfigError, match=r"does not fit: synthetic:llama3-70b:w4g128 .* on 1xh100 capped at 24 GiB "
                                          r"each at tensor-parallel size 1: \d+\.\d\d GiB of weights .* leave "
                                          r"nothing for the KV cache in the 24\.00 GiB budget \(max_gpu_memory\)"):
        check("synthetic:llama3-70b:w4g128", H100, max_gpu_memory="24GiB", max_model_len=4096)


def test_context_longer_than_the_cache_is_refused_with_a_shorter_one_suggested():
    with pytest.raises(ConfigError, match="fewer than max_model_len=8,192; it would fit with .*max_model_len"):
        check("synthetic:llama3-8b:w4g128", H100, max_gpu_memory="8GiB", max_model_len=8192)


def test_formats_the_plan_does_not_model_are_not_checked(tmp_path):
    cfg, _ = resolve("llama-3-8b")
    source = Source("bnb", {"load_in_8bit": True}, tmp_path)
    assert check_fits(config("x"), 1, cfg, source, H100, "x") is None
