"""Tensor parallelism on GPUs (NCCL, rank r on cuda:r, CUDA graphs with the all-reduce captured): the
synthetic Llama-3-8B at TP = 2 gives TP = 1's greedy tokens, with the small all-reduces on the one-shot
kernel and with NCCL for all, and in a GPTQ act-order layout; the fused one-shot all-reduce + norm kernel
across two GPUs and across all of the host's against the float32 sum. Run on a machine with two GPUs or
more: -m gpu."""
from __future__ import annotations

import pytest
import torch

from quanta.engine import LLM, SamplingParams
from test_engine_gpu import agreement  # noqa: I001  (tests/ is on the path, as for kernel_util)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
MODEL = "synthetic:llama3-8b:w4g128"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def greedy(tp: int, model: str = MODEL, **kw) -> tuple[list[list[int]], torch.Tensor, bool]:
    prompts = [[(7 * i + 3 * j) % 1000 + 10 for i in range(n)] for j, n in enumerate((5, 40, 130))]
    with LLM(model, tensor_parallel_size=tp, gpu_memory_utilization=0.5, max_model_len=512, max_num_seqs=8,
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


def test_tp2_act_order_greedy_equals_tp1():
    """GPTQ act-order at TP = 2: each rank's o_proj piece is held dequantized, its MLP's groups sorted, and the
    one-shot kernel writes q/k/v's and gate/up's inputs in their weights' column order; logits as at TP = 1 to
    the compute dtype's precision, greedy tokens the same (o_proj rounds differently from TP = 1's packed GEMV,
    so a near tie may split: most of each continuation must agree)."""
    model = MODEL + "act"
    tokens, logits, one_shot = greedy(2, model)
    want_tokens, want_logits, _ = greedy(1, model)
    assert one_shot
    torch.testing.assert_close(logits, want_logits, atol=0.25, rtol=0.05)
    assert (logits.argmax(-1) == want_logits.argmax(-1)).float().mean() > 0.95
    assert agreement(tokens, want_tokens) >= 0.9, (tokens, want_tokens)


def _one_shot_rank(rank: int, world: int, port: int, failures) -> None:
    import torch.distributed as dist

    from quanta.engine.parallel.one_shot import OneShotAllReduceNorm
    from quanta.kernels import fused_norm
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    try:
        hidden = 4096
        reducer = OneShotAllReduceNorm(dist.group.WORLD, device, torch.float16, hidden)
        w = (torch.rand(hidden, generator=torch.Generator().manual_seed(1)) + 0.5).to(device, torch.float16)

        def parts(rows: int, call: int) -> list[torch.Tensor]:
            return [torch.randn(rows, hidden, generator=torch.Generator().manual_seed(100 * call + r))
                    .to(device, torch.float16) for r in range(world)]

        for call, (rows, residual) in enumerate([(1, True), (3, False), (reducer.rows, True), (1, True)] * 3):
            xs = parts(rows, call)
            r = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(call)).to(device, torch.float16)
            r = r if residual else None
            y, h = reducer(xs[rank], r, w, 1e-5)
            total = torch.stack([x.float() for x in xs]).sum(0).half()
            want_h = total if r is None else total + r
            assert torch.equal(h, want_h), f"call {call}: sum differs"
            torch.testing.assert_close(y, fused_norm.reference(want_h, w, 1e-5), atol=2e-3, rtol=2e-3)
        # captured in a CUDA graph and replayed: each replay is the next call, every round in turn
        xs = parts(2, 99)
        x_in, r_in = xs[rank].clone(), torch.ones(2, hidden, dtype=torch.float16, device=device)
        reducer(x_in, r_in, w, 1e-5)                # warm-up: every rank, so the epochs stay together
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, h_graph = reducer(x_in, r_in, w, 1e-5)
        for replay in range(5):
            x_in.copy_(xs[rank] * (replay + 1))
            graph.replay()
            want = torch.stack([(x * (replay + 1)).float() for x in xs]).sum(0).half() + r_in
            assert torch.equal(h_graph, want), f"replay {replay}: sum differs"
        torch.cuda.synchronize()
    except Exception as e:                          # noqa: BLE001 -- reported to the test
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", sorted({2, min(torch.cuda.device_count(), 8)} - {0, 1}))
def test_one_shot_all_reduce_norm_sums_exactly(world):
    """The fused kernel across two GPUs and across every GPU of the host: each rank's different block, rows from
    1 to the buffer's, with and without residual, eager and replayed from a CUDA graph: the sum equals the float32
    sum rounded once."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    procs = [ctx.Process(target=_one_shot_rank, args=(r, world, port, failures)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert failures.empty(), failures.get()
