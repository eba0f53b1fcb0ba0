"""The fused all-reduce + residual + RMSNorm kernel (kernels/all_reduce_norm.py) on the CPU interpreter.

One process cannot run two ranks' kernels at once (each spins until its peers' flags arrive), so the
two-rank tests run rank 0's kernel after doing by hand what rank 1's kernel does before it waits (its row
in its buffer, its flag raised in both flag arrays), then rank 1's real kernel, which finds rank 0's flag
raised by rank 0's real kernel. The sums, the data slots each call uses and the flags each kernel leaves
are checked against torch; the cross-GPU part (peer memory, system-scope ordering) runs in the GPU tests
of tensor parallelism."""
import pytest
import torch

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001
from quanta.kernels import all_reduce_norm, fused_norm


class Rank:
    """One rank's buffer as engine/one_shot_all_reduce.py lays it out: flags [rows, world] int32, then data
    [2 slots, rows, d], in one allocation; epochs [rows] beside it."""

    def __init__(self, rows: int, world: int, d: int, dtype: torch.dtype):
        flag_bytes = -(-rows * world * 4 // 256) * 256
        self.buffer = torch.zeros(flag_bytes + 2 * rows * d * dtype.itemsize, dtype=torch.uint8, device=DEVICE)
        self.flags = self.buffer[:rows * world * 4].view(torch.int32).view(rows, world)
        self.data = self.buffer[flag_bytes:].view(dtype).view(2, rows, d)
        self.epochs = torch.zeros(rows, dtype=torch.int32, device=DEVICE)


def run(ranks: list[Rank], rank: int, x, residual, w):
    me = ranks[rank]
    deltas = torch.tensor([r.buffer.data_ptr() - me.buffer.data_ptr() for r in ranks], dtype=torch.int64,
                          device=DEVICE)
    return all_reduce_norm.all_reduce_norm(x, residual, w, 1e-5, rank=rank, flags=me.flags, data=me.data,
                                           deltas=deltas, epochs=me.epochs)


@pytest.mark.parametrize("rows,d", [(1, 64), (3, 213)])
@pytest.mark.parametrize("residual", [False, True])
def test_one_rank_is_the_norm(rows, d, residual):
    """World 1: the sum is x itself, so (y, h) are fused_norm's (x + residual, its norm)."""
    x = torch.randn(rows, d).to(DEVICE, torch.float16)
    r = torch.randn(rows, d).to(DEVICE, torch.float16) if residual else None
    w = (torch.rand(d) + 0.5).to(DEVICE, torch.float16)
    me = Rank(rows, 1, d, torch.float16)
    for epoch in (1, 2, 3):
        y, h = run([me], 0, x, r, w)
        want_h = x if r is None else x + r
        assert torch.equal(h, want_h)
        assert rel_err(y, fused_norm.reference(want_h, w, 1e-5)) < TOL[torch.float16] / 2
        assert me.epochs.tolist() == [epoch] * rows and me.flags.flatten().tolist() == [epoch] * rows
        assert torch.equal(me.data[epoch % 2], x)                # the slot of this epoch holds the row


def peer_arrives(ranks: list[Rank], peer: int, x: torch.Tensor, epoch: int) -> None:
    """What `peer`'s kernel does before it waits: its rows into slot epoch % 2 of its buffer, its flag
    raised to `epoch` in every rank's flag array."""
    ranks[peer].data[epoch % 2, :x.shape[0]] = x
    for r in ranks:
        r.flags[:x.shape[0], peer] = epoch


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_two_ranks_sum_alternate_slots_and_agree(dtype):
    rows, d = 3, 213
    ranks = [Rank(rows, 2, d, dtype), Rank(rows, 2, d, dtype)]
    w = (torch.rand(d) + 0.5).to(DEVICE, dtype)
    g = torch.Generator().manual_seed(0)
    previous = None
    for epoch in (1, 2, 3):
        x0, x1, r = (torch.randn(rows, d, generator=g).to(DEVICE, dtype) for _ in range(3))
        peer_arrives(ranks, 1, x1, epoch)
        y0, h0 = run(ranks, 0, x0, r, w)
        # rank 0 left its rows in this epoch's slot, its flag raised in rank 1's array, the other slot as it was
        assert torch.equal(ranks[0].data[epoch % 2], x0)
        if previous is not None:
            assert torch.equal(ranks[0].data[(epoch + 1) % 2], previous)
        assert ranks[1].flags[:, 0].tolist() == [epoch] * rows and ranks[0].epochs.tolist() == [epoch] * rows
        y1, h1 = run(ranks, 1, x1, r, w)
        assert torch.equal(y0, y1) and torch.equal(h0, h1)      # every rank holds the same residual stream
        s = (x0.float() + x1.float()).to(dtype)
        want_y, want_h = fused_norm.reference(s, w, 1e-5, r)
        assert torch.equal(h0, want_h) or dtype == torch.bfloat16 and rel_err(h0, want_h) < TOL[dtype] / 2
        assert rel_err(y0, want_y) < TOL[dtype] / 2
        previous = x0


def test_fewer_rows_than_the_buffer_and_three_ranks():
    """A call over fewer rows than the buffer holds touches only those rows' epochs; a world that is not a
    power of two sums all of its ranks."""
    rows, d = 4, 64
    ranks = [Rank(rows, 3, d, torch.float16) for _ in range(3)]
    w = torch.ones(d, dtype=torch.float16, device=DEVICE)
    xs = [torch.randn(2, d).to(DEVICE, torch.float16) for _ in range(3)]
    peer_arrives(ranks, 1, xs[1], 1)
    peer_arrives(ranks, 2, xs[2], 1)
    y, h = run(ranks, 0, xs[0], None, w)
    assert ranks[0].epochs.tolist() == [1, 1, 0, 0]
    assert torch.equal(h, torch.stack([x.float() for x in xs]).sum(0).to(torch.float16))
    want_y, want_h = all_reduce_norm.reference(xs, w, 1e-5)
    assert torch.equal(h, want_h) and rel_err(y, want_y) < TOL[torch.float16] / 2
