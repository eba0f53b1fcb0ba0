"""The batched LoRA kernels (quanta.lora.kernels) against their torch reference, and the engine's GPU path
(stacked slots, Triton kernels; under the interpreter on the CPU) against peft."""
import pytest
import torch

from kernel_util import DEVICE  # noqa: I001
from quanta.lora import kernels as lora
from quanta.kernels.triton_support import cdiv


@pytest.mark.parametrize("sizes", [[40], [32, 16, 16], [24, 24]], ids=["one", "qkv", "gate_up"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("t, k, r", [(7, 96, 8), (5, 1100, 16), (80, 200, 4)],
                         ids=["few", "k-split-in-3", "many-rows"])
def test_add_lora_matches_reference(sizes, dtype, t, k, r):
    """Tiles of one slot's rows, K split over programs for few rows (1100 = 3 uneven pieces), ranks under the
    dot's 16 padded, and a token's rows scattered among the slots."""
    g = torch.Generator().manual_seed(0)
    slots_n = 3
    n, p = sum(sizes), len(sizes)
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    x = torch.randn(t, k, generator=g).to(DEVICE, dtype)
    y = torch.randn(t, n, generator=g).to(DEVICE, dtype)
    a = (0.1 * torch.randn(slots_n, p * r, k, generator=g)).to(DEVICE, dtype)
    b = (0.1 * torch.randn(slots_n, n, r, generator=g)).to(DEVICE, dtype)
    scale = torch.rand(slots_n, p, generator=g).to(DEVICE)
    pattern = torch.tensor([2, -1, 0, 0, 1, -1, 2], dtype=torch.int32)
    slots = pattern.repeat(cdiv(t, 7))[:t].to(DEVICE)
    want = lora.reference(x, y.clone(), slots, a, b, scale, bounds)
    got = lora.add_lora(x, y.clone(), slots, a, b, scale, bounds)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    none = slots.cpu() < 0
    assert torch.equal(got[none], y[none])                                  # rows without an adapter untouched
    assert not torch.allclose(got[0], y[0])


def test_sort_by_slot_groups_rows_and_counts_them():
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2], dtype=torch.int32)
    order, starts = lora.sort_by_slot(slots, 3)
    assert order.tolist() == [2, 3, 4, 0, 6, 1, 5] and starts.tolist() == [0, 2, 3, 5]


def test_engine_gpu_path_mixed_batch_equals_peft(tmp_path):
    """The engine's Triton path (stacked slots padded to the kernels' rank, every layer's products through
    add_lora) with two adapters and none in one batch gives peft's greedy tokens."""
    pytest.importorskip("peft")
    from quanta import LLM, LoRARequest, SamplingParams
    from quanta.engine.config import EngineConfig
    from quanta.engine.core import EngineCore
    from test_lora_engine import make_adapter, oracle, prompts
    from tiny_models import build_tiny_hf
    path, model = build_tiny_hf("llama", tmp_path / "base")
    peft_models = [make_adapter(model, tmp_path / f"a{i}", seed=i, r=4 + 4 * i) for i in range(2)]
    requests = [LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")) for i in range(2)]
    config = EngineConfig.from_kwargs(str(path), dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=32,
                                      enable_lora=True, max_loras=2, max_lora_rank=8, quiet=True)
    llm = LLM.from_core(EngineCore(config, triton_ops=True))
    ps = prompts(3, seed=5)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with llm:
        out = llm.generate([{"prompt_token_ids": p} for p in ps], params, lora_request=[requests[0], None, requests[1]])
        assert llm.memory()["lora_slots"] > 0
    want = [oracle(peft_models[0], ps[0], 4), oracle(model, ps[1], 4), oracle(peft_models[1], ps[2], 4)]
    assert [o.outputs[0].token_ids for o in out] == want
