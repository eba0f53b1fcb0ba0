"""The fused all-reduce + residual + RMSNorm kernel (kernels/all_reduce_norm.py) on the CPU interpreter.

One process cannot run two ranks' kernels at once (each reads its buffer until its peers' rows land), so the
multi-rank tests run rank 0's kernel after doing by hand what each peer's kernel does before it reads (its
row stored into its slot of the round in every rank's buffer), then each peer's real kernel, which finds
rank 0's rows stored by rank 0's real kernel. The sums, the slots each call fills and the slots each call
empties are checked against torch; the cross-GPU part (peer memory over NVLink) runs in the GPU tests of
tensor parallelism."""
import pytest
import torch

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001
from quanta.kernels import all_reduce_norm, fused_norm

ROUNDS = all_reduce_norm.ROUNDS


class Rank:
    """One rank's buffer as engine/one_shot_all_reduce.py lays it out: [rounds, world, rows, d] slots, all
    empty (-0.0) at first; its round counters [rows] beside it."""

    def __init__(self, rows: int, world: int, d: int, dtype: torch.dtype):
        self.data = all_reduce_norm.empty_buffer(torch.empty(ROUNDS, world, rows, d, dtype=dtype, device=DEVICE))
        self.rounds = torch.zeros(rows, dtype=torch.int32, device=DEVICE)


def empty(t: torch.Tensor) -> bool:
    """Whether every element of t is the sentinel -0.0 (by bit pattern: +0.0 is data)."""
    itype = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return bool((t.view(itype) == all_reduce_norm.sentinel_bits(t.dtype)).all())


def run(ranks: list[Rank], rank: int, x, residual, w, order=None):
    me = ranks[rank]
    deltas = torch.tensor([r.data.data_ptr() - me.data.data_ptr() for r in ranks], dtype=torch.int64,
                          device=DEVICE)
    return all_reduce_norm.all_reduce_norm(x, residual, w, 1e-5, rank=rank, data=me.data, deltas=deltas,
                                           rounds=me.rounds, order=order)


@pytest.mark.parametrize("rows,d", [(1, 64), (3, 213)])
@pytest.mark.parametrize("residual", [False, True])
def test_one_rank_is_the_norm(rows, d, residual):
    """World 1: the sum is x itself, so (y, h) are fused_norm's (x + residual, its norm)."""
    x = torch.randn(rows, d).to(DEVICE, torch.float16)
    r = torch.randn(rows, d).to(DEVICE, torch.float16) if residual else None
    w = (torch.rand(d) + 0.5).to(DEVICE, torch.float16)
    me = Rank(rows, 1, d, torch.float16)
    for call in range(1, 5):
        y, h = run([me], 0, x, r, w)
        want_h = x if r is None else x + r
        assert torch.equal(h, want_h)
        assert rel_err(y, fused_norm.reference(want_h, w, 1e-5)) < TOL[torch.float16] / 2
        assert me.rounds.tolist() == [call % ROUNDS] * rows
        assert torch.equal(me.data[call % ROUNDS, 0], x)            # this call's round holds the row
        assert empty(me.data[(call - 1) % ROUNDS])                   # the previous round is emptied


def peer_arrives(ranks: list[Rank], peer: int, x: torch.Tensor, call: int) -> None:
    """What `peer`'s kernel does before it reads: its rows into its slot of the call's round in every rank's
    buffer, -0.0 sent as +0.0."""
    for r in ranks:
        r.data[call % ROUNDS, peer, :x.shape[0]] = torch.where(x == 0, torch.zeros_like(x), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_two_ranks_sum_cycle_rounds_and_agree(dtype):
    rows, d = 3, 213
    ranks = [Rank(rows, 2, d, dtype), Rank(rows, 2, d, dtype)]
    w = (torch.rand(d) + 0.5).to(DEVICE, dtype)
    g = torch.Generator().manual_seed(0)
    for call in range(1, 6):                     # every round more than once
        x0, x1, r = (torch.randn(rows, d, generator=g).to(DEVICE, dtype) for _ in range(3))
        x0[0, :5] = -0.0                         # a partial sum's -0.0 must not read as an empty slot
        peer_arrives(ranks, 1, x1, call)
        y0, h0 = run(ranks, 0, x0, r, w)
        # rank 0 stored its rows in its slot of this round in both buffers and emptied its previous round
        for rank in ranks:
            assert torch.equal(rank.data[call % ROUNDS, 0], x0)
        assert empty(ranks[0].data[(call - 1) % ROUNDS]) and ranks[0].rounds.tolist() == [call % ROUNDS] * rows
        assert not (ranks[1].data[call % ROUNDS, 0].view(torch.int16) == -32768).any()    # -0.0 went as +0.0
        y1, h1 = run(ranks, 1, x1, r, w)
        assert empty(ranks[1].data[(call - 1) % ROUNDS])
        assert torch.equal(y0, y1) and torch.equal(h0, h1)      # every rank holds the same residual stream
        s = (x0.float() + x1.float()).to(dtype)
        want_y, want_h = fused_norm.reference(s, w, 1e-5, r)
        assert torch.equal(h0, want_h) or dtype == torch.bfloat16 and rel_err(h0, want_h) < TOL[dtype] / 2
        assert rel_err(y0, want_y) < TOL[dtype] / 2


def test_fewer_rows_than_the_buffer_and_three_ranks():
    """A call over fewer rows than the buffer holds touches only those rows' slots and counters; a world that
    is not a power of two sums all of its ranks."""
    rows, d = 4, 64
    ranks = [Rank(rows, 3, d, torch.float16) for _ in range(3)]
    w = torch.ones(d, dtype=torch.float16, device=DEVICE)
    xs = [torch.randn(2, d).to(DEVICE, torch.float16) for _ in range(3)]
    peer_arrives(ranks, 1, xs[1], 1)
    peer_arrives(ranks, 2, xs[2], 1)
    y, h = run(ranks, 0, xs[0], None, w)
    assert ranks[0].rounds.tolist() == [1, 1, 0, 0]
    assert empty(ranks[1].data[1, 0, 2:]) and torch.equal(ranks[1].data[1, 0, :2], xs[0])
    assert torch.equal(h, torch.stack([x.float() for x in xs]).sum(0).to(torch.float16))
    want_y, want_h = all_reduce_norm.reference(xs, w, 1e-5)
    assert torch.equal(h, want_h) and rel_err(y, want_y) < TOL[torch.float16] / 2


def test_order_permutes_the_norm_not_the_residual_stream():
    """With `order`, each rank's y is the plain kernel's y with column k holding feature order[k], bit for bit;
    h, the residual stream, stays in the model's order."""
    rows, d = 2, 213
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(rows, d, generator=g).to(DEVICE, torch.float16) for _ in range(2)]
    r = torch.randn(rows, d, generator=g).to(DEVICE, torch.float16)
    w = (torch.rand(d, generator=g) + 0.5).to(DEVICE, torch.float16)
    order = torch.randperm(d, generator=g).to(DEVICE, torch.int32)
    outs = []
    for permuted in (None, order):
        ranks = [Rank(rows, 2, d, torch.float16), Rank(rows, 2, d, torch.float16)]
        peer_arrives(ranks, 1, xs[1], 1)
        outs.append(run(ranks, 0, xs[0], r, w, permuted))
    (y, h), (y_ordered, h_ordered) = outs
    assert torch.equal(h_ordered, h) and torch.equal(y_ordered, y[:, order.long()])
    want_y, _ = all_reduce_norm.reference(xs, w, 1e-5, r, order)
    assert rel_err(y_ordered, want_y) < TOL[torch.float16] / 2
