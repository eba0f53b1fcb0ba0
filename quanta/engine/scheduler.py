"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step is one flat batch under two budgets, `max_num_batched_tokens` and `max_num_seqs`. Running
sequences go first, oldest first: a decode takes one token; a prompt being prefilled takes the next chunk
that fits, leaving a token for each running sequence after it and at most half the budget while others
wait, so a long prefill runs beside decodes and a new request starts in the next step. Waiting sequences
are then admitted in arrival order while the budgets, the block pool (room kept for the running ones' growth:
growth_blocks) and max_loras allow. A running sequence that needs a block when none is free preempts the
newest running one, which goes back to the queue's front to be recomputed later.

Async scheduling has its whole rule in schedule_ahead: which decode step may launch while the previous
step's tokens are on their way to the host, so the host's bookkeeping overlaps the device.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from quanta.engine.block_pool import BlockPool
from quanta.engine.sampler import is_plain
from quanta.engine.sequence import Sequence


# Admission keeps blocks free for what the running sequences will still write (SGLang's new-token ratio), so that
# a batch does not outgrow the pool: each preemption recomputes a prompt. A sample that only its length limit can
# end will write all its remaining tokens; any other is expected to write growth_ratio of them (at most GROWTH_CAP):
# the ratio falls by GROWTH_DECAY a step while nothing is preempted (samples end early, on EOS or a stop) down to
# GROWTH_MIN, and is back at GROWTH_INIT after a preemption. schedule_conservativeness scales the room kept (0: a
# sequence is admitted whenever its prompt fits now).
GROWTH_INIT, GROWTH_MIN, GROWTH_DECAY, GROWTH_CAP = 0.7, 0.1, 0.001, 4096


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int                     # tokens of this sequence computed in this step

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


def samples_on_device(seq: Sequence) -> bool:
    """Whether the next token of `seq` is drawn with nothing from the host: no penalties (they read the
    token history), no own seed and no logprobs."""
    return is_plain(seq.params) and seq.generator is None and seq.logprobs is None


class Scheduler:
    """`async_scheduling`: schedule_ahead may launch decode steps ahead (see there). `max_loras`: the most
    adapters the running sequences may use at once (None: LoRA off)."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 async_scheduling: bool = False, max_loras: int | None = None, conservativeness: float = 1.0):
        self.pool, self.async_scheduling, self.max_loras = pool, async_scheduling, max_loras
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.conservativeness = conservativeness
        self.growth_ratio = GROWTH_INIT
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FCFS)."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        """The next step: running sequences first, then waiting ones in order, under the budgets (module docstring)."""
        budget, batch, preempted = self.max_num_batched_tokens, [], False
        chunk = max(1, budget // 2) if self.waiting else budget
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
                n = min(seq.num_tokens - seq.num_computed_tokens, budget, chunk)
                if n > 1:                       # a prefill chunk leaves a token for each later running sequence
                    n = max(1, min(n, budget - (len(self.running) - i - 1)))
                batch.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        passed: list[Sequence] = []                 # waiting on an adapter slot, kept in their order
        growth = sum(map(self.growth_blocks, self.running)) if self.waiting and not preempted else 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if not self._adapter_fits(seq):
                passed.append(self.waiting.popleft())
                continue
            own = self.growth_blocks(seq)
            if not self.pool.can_allocate(seq, reserve=bool(self.running), extra=growth + own):
                break
            self.pool.allocate(seq)
            self.running.append(self.waiting.popleft())
            growth += own
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(passed))
        self.growth_ratio = GROWTH_INIT if preempted else max(GROWTH_MIN, self.growth_ratio - GROWTH_DECAY)
        assert budget >= 0 and len(batch) <= self.max_num_seqs
        return batch

    def growth_blocks(self, seq: Sequence) -> int:
        """The blocks `seq` is expected to need beyond those its tokens fill now (module note on admission),
        scaled by the conservativeness."""
        if self.conservativeness <= 0:
            return 0
        tokens = seq.tokens_to_come()
        if not seq.runs_to_length:
            tokens = min(tokens, GROWTH_CAP) * self.growth_ratio
        tokens = math.ceil(tokens * self.conservativeness)
        return self.pool.blocks_needed(seq.num_tokens + tokens) - self.pool.blocks_needed(seq.num_tokens)

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether `seq` may join the running ones without their adapters exceeding max_loras."""
        if self.max_loras is None or seq.lora_id is None:
            return True
        adapters = {s.lora_id for s in self.running} - {None}
        return seq.lora_id in adapters or len(adapters) < self.max_loras

    def schedule_ahead(self, batch: list[ScheduledSeq]) -> list[ScheduledSeq] | None:
        """The async-scheduling rule, whole. `batch` was launched and advanced by update(); its sampled
        tokens are not yet known to the host. Returns the next decode step, in which each running sequence
        computes its pending token (read on the device from `batch`'s samples), or None, meaning: wait for
        the tokens and schedule() as usual. A step is returned only when
          - async scheduling is on;
          - it is certainly the step schedule() would pick: `batch` decoded one token of every running
            sequence (each had sampled before, so no n > 1 fork is pending), nothing waits, and the pool
            has the new blocks without preempting;
          - every sequence samples on the device alone (samples_on_device);
          - some sequence is not ended by length by its pending token (those are left out).
        A sequence that its pending token ends otherwise (EOS, a stop) computes one token too many; the
        engine drops it when the step lands, so outputs are those of the synchronous loop."""
        if not self.async_scheduling or self.waiting or [it.seq for it in batch] != self.running:
            return None
        if not all(it.num_tokens == 1 and it.seq.num_computed_tokens == it.seq.num_tokens and it.seq.output_ids
                   and samples_on_device(it.seq) for it in batch):
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
        """Drop a finished running sequence and free its blocks."""
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
