"""Start-up faults on the CPU: a real CUDA out-of-memory error while loading or allocating becomes a
ConfigError carrying the memory plan's verdict (the allocation is monkeypatched to raise it; the verdict
is `quanta plan`'s words for the same configuration); a KV pool too small for max_model_len is refused
before any weight is built; pickle weights load only with the explicit opt-in (--allow-pickle,
allow_pickle=True) and are refused by default with a typed error naming it."""
from __future__ import annotations

import argparse

import pytest
import torch

from quanta.engine import LLM, SamplingParams
from quanta.engine import core as core_module
from quanta.quant.errors import ConfigError, UnsupportedError
from quanta.cli import plan as plan_cmd
from quanta.cli.main import main
from quanta.planner.request import GPU_BATCHED_TOKENS

GIB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_hf
    path = tmp_path_factory.mktemp("startup") / "llama"
    make_tiny_hf("llama", path)
    return str(path)


def plan_words(model: str, capsys) -> str:
    """`quanta plan MODEL --gpus 1x16GiB` verdict line, as the user would run it."""
    parser = argparse.ArgumentParser()
    plan_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", model, "--gpus", "1x16GiB", "--max-model-len", "128", "--dtype", "float32"])
    args.func(args)
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith(("fits:", "does not")))


def oom(*_a, **_kw):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.7 GiB total)")


@pytest.mark.parametrize("where, what", [("build_model", "loading the weights"),
                                         ("PagedKVCache", "allocating the KV cache (64 blocks)"),
                                         ("ModelRunner", "building the runner")])
def test_a_real_out_of_memory_error_carries_the_plans_verdict(tiny, monkeypatch, capsys, where, what):
    # A 16 GiB card as the engine sees it, so that it makes its plan; the allocation then fails anyway.
    monkeypatch.setattr(core_module, "device_total", lambda device: 16 * GIB)
    monkeypatch.setattr(core_module, where, oom)
    with pytest.raises(ConfigError) as e:
        LLM(tiny, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64, quiet=True,
            max_num_batched_tokens=GPU_BATCHED_TOKENS)   # the GPU's step budget, as `quanta plan` assumes
    message = str(e.value)
    assert message.startswith(f"out of GPU memory while {what} (CUDA out of memory. Tried to allocate 2.00 GiB")
    verdict = plan_words(tiny, capsys)
    assert verdict.startswith("fits:") and f"the memory plan for this configuration: {verdict}" in message
    assert "lower gpu_memory_utilization" in message
    assert e.value.__cause__ is None and e.value.__suppress_context__      # no traceback pinning tensors


def test_a_kv_pool_too_small_for_max_model_len_is_refused_before_loading(tiny, monkeypatch):
    def never(*_a, **_kw):
        raise AssertionError("weights were built for a configuration refused by its size alone")
    monkeypatch.setattr(core_module, "build_model", never)
    with pytest.raises(ConfigError, match=r"holds 16 tokens \(1 blocks of 16\), less than max_model_len=64"):
        LLM(tiny, device="cpu", num_kv_blocks=1, max_model_len=64, quiet=True)
    with pytest.raises(ConfigError, match=r"holds 0 tokens .* less than max_model_len=128"):
        LLM(tiny, device="cpu", kv_cache_memory=1000, max_model_len=128, quiet=True)


def test_max_gpu_memory_is_checked_for_form_and_unused_on_the_cpu(tiny):
    """A malformed cap is refused on any device; on the CPU a well-formed one caps nothing (no GPU memory
    is used), so even an absurdly small one starts."""
    for bad in ("lots", "999PiB", 0, -5):
        with pytest.raises(ConfigError, match="max_gpu_memory"):
            LLM(tiny, device="cpu", max_gpu_memory=bad, quiet=True)
    llm = LLM(tiny, device="cpu", max_gpu_memory="1KiB", max_model_len=64, num_kv_blocks=8, quiet=True)
    assert llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)


# --- pickle weights ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pickled(tiny, tmp_path_factory):
    """The tiny model with its weights as pytorch_model.bin instead of safetensors."""
    import shutil

    from safetensors.torch import load_file
    path = tmp_path_factory.mktemp("pickled") / "llama"
    shutil.copytree(tiny, path)
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    return str(path)


def forbid_torch_load(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("torch.load was called without the pickle opt-in")
    monkeypatch.setattr(torch, "load", refuse)


def test_engine_and_cli_refuse_pickles_by_default(pickled, monkeypatch, capsys):
    forbid_torch_load(monkeypatch)
    with pytest.raises(UnsupportedError, match=r"pytorch_model\.bin.*can run code.*--allow-pickle"):
        LLM(pickled, device="cpu", quiet=True)
    assert main(["generate", "--model", pickled, "--device", "cpu", "--max-tokens", "2", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "quanta: error:" in err and "pytorch_model.bin" in err and "--allow-pickle" in err


def test_the_opt_in_loads_the_same_model(tiny, pickled, capsys):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 17, 300, 9]}]
    kw = dict(device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8, quiet=True)
    want = LLM(tiny, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    got = LLM(pickled, allow_pickle=True, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    assert main(["-q", "generate", "--model", pickled, "--device", "cpu", "--allow-pickle", "--max-tokens", "3",
                 "--max-model-len", "64", "--num-kv-blocks", "8", "Hello"]) == 0
