"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step is one flat batch under two budgets, `max_num_batched_tokens` and `max_num_seqs`.
Running sequences go first, oldest first: a decode takes one token, a prompt still being prefilled
takes the next chunk that fits (chunked prefill). Then waiting sequences are admitted in arrival
order (FCFS) while the budgets and the block pool allow. When a running sequence needs a block and
none is free, the newest running sequence is preempted: its blocks are freed and it goes back to
the front of the queue to be recomputed (prompt + tokens generated so far) later.

schedule_lookahead picks the decode step that follows a step whose tokens are still on the device
(async scheduling), when it is certainly the step schedule() would pick then.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from quanta.engine.block_pool import BlockPool
from quanta.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int                     # tokens of this sequence computed in this step

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget, batch, preempted = self.max_num_batched_tokens, [], False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            while not self.pool.can_append(seq):
                preempted = True
                self._preempt(self.running.pop())
                if seq not in self.running:
                    break
            else:
                self.pool.append_slot(seq)
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                batch.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if not self.pool.can_allocate(seq, reserve=bool(self.running)):
                break
            self.pool.allocate(seq)
            self.running.append(self.waiting.popleft())
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        assert budget >= 0 and len(batch) <= self.max_num_seqs
        return batch

    def schedule_lookahead(self, batch: list[ScheduledSeq]) -> list[ScheduledSeq] | None:
        """The decode step after `batch` (launched and advanced by update(), its sampled tokens not yet
        known): each running sequence computes its pending token, except those the pending token ends by
        length. None unless schedule() would pick the same step: `batch` is a decode of every running
        sequence, nothing waits, and the pool has the new blocks without preempting. Sequences that the
        pending token ends otherwise (EOS, stop) are dropped from the step's results when it lands."""
        if self.waiting or [it.seq for it in batch] != self.running or any(it.num_tokens != 1 for it in batch):
            return None
        ahead = [seq for seq in self.running if not seq.ends_by_length(pending=1)]
        new_blocks = sum(len(seq.block_table) < self.pool.blocks_needed(seq.num_tokens + 1) for seq in ahead)
        if not ahead or new_blocks > self.pool.num_free:
            return None
        for seq in ahead:
            self.pool.append_slot(seq, pending=1)
        return [ScheduledSeq(seq, 1) for seq in ahead]

    def update(self, batch: list[ScheduledSeq]) -> None:
        """After the step ran: advance each sequence and register its newly full blocks."""
        for item in batch:
            item.seq.num_computed_tokens += item.num_tokens
            self.pool.hash_full_blocks(item.seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start sample `child` of `parent`'s request on parent's computed blocks when it fits now,
        else queue it first in line (it is then prefilled like any prompt, prefix cache permitting)."""
        tail = self.pool.blocks_needed(child.num_tokens) - parent.num_computed_tokens // self.pool.block_size
        if len(self.running) < self.max_num_seqs and tail + 1 <= self.pool.num_free:
            self.pool.fork(parent, child)
            self.running.append(child)
        else:
            self.waiting.appendleft(child)

    def abort(self, request_id: str) -> list[Sequence]:
        """Drop every sequence of `request_id`, freeing its blocks; returns them (finish_reason abort)."""
        dropped = [s for s in list(self.running) + list(self.waiting) if s.request_id == request_id]
        for seq in dropped:
            if seq in self.running:
                self.finish(seq)
            else:
                self.waiting.remove(seq)
            seq.finish_reason = "abort"
        return dropped

    def _preempt(self, seq: Sequence) -> None:
        self.pool.free(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
