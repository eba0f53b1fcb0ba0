"""ModelRunner: turns a scheduled step into flat tensors, runs the model and samples; decode steps replay
CUDA graphs, and a step's tokens are collected after the next step may have been launched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quanta.engine.parallel import step as tp_step
from quanta.engine.forward_batch import ForwardBatch
from quanta.engine.kv_cache import PagedKVCache
from quanta.engine.sampler import sample_batch
from quanta.engine.sampling_params import SamplingParams
from quanta.engine.scheduler import ScheduledSeq
from quanta.engine.sequence import Sequence
from quanta.kernels.paged_attention import default_num_splits
from quanta.kernels.path_table import row_classes


@dataclass(eq=False)
class LaunchedStep:
    """A step on its way: the scheduled batch, the sequences that sample (in token-row order), their
    token ids on the device and on their way to the host, the raw logits rows when logprobs need them,
    and {row: exception} of the rows whose own sampling failed (sample_batch's `errors`)."""
    batch: list[ScheduledSeq]
    seqs: list[Sequence]
    tokens: torch.Tensor | None = None
    host_tokens: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    raw: torch.Tensor | None = None
    errors: dict[int, Exception] = field(default_factory=dict)


def dummy_batch(num_tokens: int, max_model_len: int, block_size: int) -> list[ScheduledSeq]:
    """The start-up dry run's batch: prompts of at most max_model_len tokens, num_tokens in all, on
    consecutive blocks from block 0 (a scratch cache of `blocks_spanned` blocks holds them)."""
    batch, block = [], 0
    while num_tokens > 0:
        n = min(num_tokens, max_model_len)
        seq = Sequence("profile", 0, [0] * n, SamplingParams(temperature=1.0))
        blocks = -(-n // block_size)
        seq.block_table = list(range(block, block + blocks))
        batch.append(ScheduledSeq(seq, n))
        block, num_tokens = block + blocks, num_tokens - n
    return batch


def dummy_mixed_batch(decodes: int, width: int, block_size: int) -> list[ScheduledSeq]:
    """A start-up step of `decodes` decode rows, each over a context of `width` blocks (all on blocks 0 ..
    width - 1, whose contents do not matter), and a 5-token prompt on block `width`."""
    context = width * block_size
    batch = []
    for _ in range(decodes):
        seq = Sequence("profile", 0, [0] * context, SamplingParams(temperature=1.0))
        seq.block_table, seq.num_computed_tokens = list(range(width)), context - 1
        batch.append(ScheduledSeq(seq, 1))
    prompt = Sequence("profile", 0, [0] * 5, SamplingParams(temperature=1.0))
    prompt.block_table = [width]
    return batch + [ScheduledSeq(prompt, 5)]


def blocks_spanned(batch: list[ScheduledSeq]) -> int:
    """KV blocks the sequences of `batch` hold."""
    return sum(len(it.seq.block_table) for it in batch)


class ModelRunner:
    """Runs `model` over `kv_cache` one scheduled step at a time. `cuda_graphs`: capture the decode
    graphs now (CUDA only); `generator`: the engine's default sampling generator.

    A step's sequences are ordered decodes first; their tokens are laid out back to back as
    input_ids / positions / slot_mapping [T], with block_tables [B, W], seq_lens [B] and
    query_start_loc [B + 1]. Step tensors are built on the host and moved with pinned memory and
    non_blocking copies. Decode-only steps replay a CUDA graph captured per batch-size bucket
    [1, 2, 4, 8, 16, ...] (static buffers, one shared memory pool), unless enforce_eager.

    A step is launched (launch) and its tokens collected later (collect): the sampled ids are copied to
    pinned host memory behind an event, so the host can launch the next decode step, whose input ids are
    read on the device from this step's tokens (`after`), before it waits for them. When that may happen
    is the scheduler's rule (Scheduler.schedule_ahead); the runner only provides the mechanism.

    The runner is built with its KV cache and never given another. The start-up memory profile runs on a
    runner of its own over a scratch cache (EngineCore builds both and drops them). `lora`: the engine's adapter
    slots (quanta.lora.slots.LoRASlots), told each step which adapter each token row uses."""

    def __init__(self, model, kv_cache: PagedKVCache, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, generator: torch.Generator | None = None, cuda_graphs: bool = False,
                 lora=None):
        self.model, self.kv_cache, self.lora = model, kv_cache, lora
        self.device = kv_cache.kv.device
        cfg = model.config
        self.num_kv_heads, self.sliding_window = cfg.num_key_value_heads, cfg.sliding_window
        self.max_model_len, self.block_size = max_model_len, kv_cache.block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.generator = generator
        self.tp = getattr(model, "tp", None)        # tensor parallelism: rank 0 sends each step, workers serve()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, ForwardBatch]] = {}
        self.pin = self.device.type == "cuda"
        if cuda_graphs:
            self.capture_graphs()

    # --- step tensors ---------------------------------------------------------------------------
    def _tensor(self, data, dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, pin_memory=self.pin).to(self.device, non_blocking=True)

    def prepare(self, batch: list[ScheduledSeq], after: LaunchedStep | None = None):
        """-> (ForwardBatch, input_ids, positions, the items in step order, last-token row of each).
        With `after`, every item is a decode whose input token is `after`'s sampled token for it. The
        first step with a prefill part after an fp8 cache is made computes its scales (claim_calibration)."""
        items = sorted(batch, key=lambda it: it.num_tokens != 1)
        num_decodes = sum(it.num_tokens == 1 for it in items)
        bs = self.block_size
        ids, positions, slots, tables, lens, starts, last = [], [], [], [], [], [0], []
        for it in items:
            seq, start = it.seq, it.seq.num_computed_tokens
            end = start + it.num_tokens
            n_prompt = len(seq.prompt_ids)
            ids += [0] if after else (seq.prompt_ids[start:end]
                                      + seq.output_ids[max(0, start - n_prompt):max(0, end - n_prompt)])
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            tables.append(table)
            lens.append(end)
            starts.append(starts[-1] + it.num_tokens)
            last.append(starts[-1] - 1)
        width = max(len(t) for t in tables)
        prefill = starts[num_decodes:]
        if self.lora is not None:
            self.lora.set_step([(it.seq.lora_request, it.num_tokens) for it in items])
        fb = ForwardBatch(
            kv_cache=self.kv_cache, slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
            seq_lens=self._tensor(lens, torch.int32), query_start_loc=self._tensor(starts, torch.int32),
            prefill_start_loc=self._tensor([s - prefill[0] for s in prefill], torch.int32)
            if len(prefill) > 1 else None,
            num_decodes=num_decodes, max_query_len=max((it.num_tokens for it in items[num_decodes:]), default=1),
            num_splits=self._num_splits(num_decodes),
            sliding_window=self.sliding_window,
            calibrate=len(prefill) > 1 and self.kv_cache.claim_calibration())
        input_ids = self._tensor(ids, torch.long)
        if after:
            input_ids.copy_(self._pending_ids(items, after))
        return fb, input_ids, self._tensor(positions, torch.long), items, last

    def _pending_ids(self, items: list[ScheduledSeq], after: LaunchedStep) -> torch.Tensor:
        """The device token ids `after` sampled for items' sequences, in items' order."""
        rows = {id(seq): r for r, seq in enumerate(after.seqs)}
        src = [rows[id(it.seq)] for it in items]
        if src == list(range(len(src))):
            return after.tokens[:len(src)]
        return after.tokens.index_select(0, self._tensor(src, torch.long))

    def _num_splits(self, num_decodes: int) -> int:
        """The decode kernel's splits for a batch, as for its CUDA-graph bucket (few kernel variants)."""
        bucket = 1 << max(0, num_decodes - 1).bit_length()
        return default_num_splits(min(bucket, self.max_num_seqs), self.num_kv_heads, self.max_model_len)

    # --- running --------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: list[ScheduledSeq], after: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step on the device (model, logits, sampling) without waiting for its tokens. `after`:
        a launched, uncollected step whose tokens are this decode-only step's input ids."""
        bucket = self._graph_bucket(batch)
        if bucket:
            items, last = batch, list(range(len(batch)))
        else:
            fb, input_ids, positions, items, last = self.prepare(batch, after=after)
        sampling = items if after else [it for it in items if it.samples]
        rows = list(last) if after else [r for it, r in zip(items, last) if it.samples]
        if bucket:
            hidden = self._replay(batch, bucket, after, rows)
        else:
            if self.tp is not None:
                tp_step.send_eager(self.tp, fb, input_ids, positions, rows)
            hidden = self.model(input_ids, positions, fb)
        step = LaunchedStep(batch, [it.seq for it in sampling])
        if not sampling:
            return step
        logits = self._logits(hidden, rows)
        seqs = step.seqs
        step.raw = logits.clone() if any(s.params.logprobs is not None for s in seqs) else None
        step.tokens = sample_batch(logits, [s.params for s in seqs], [s.generator for s in seqs],
                                   [(s.prompt_ids, s.output_ids) for s in seqs], self.generator, step.errors)
        if self.pin:
            step.host_tokens = torch.empty(step.tokens.shape, dtype=step.tokens.dtype, pin_memory=True)
            step.host_tokens.copy_(step.tokens, non_blocking=True)
            step.ready = torch.cuda.Event()
            step.ready.record()
        else:
            step.host_tokens = step.tokens
        return step

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Float32 logits of `rows` of the step's hidden states (every rank computes them together)."""
        if rows != list(range(hidden.shape[0])):
            hidden = hidden[self._tensor(rows, torch.long)]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def prompt_logits(self, seq: Sequence) -> torch.Tensor:
        """Float32 next-token logits [T, V] at every position of `seq` (its blocks allocated, none computed)."""
        fb, input_ids, positions, _, _ = self.prepare([ScheduledSeq(seq, seq.num_tokens)])
        if self.tp is not None:
            tp_step.send_eager(self.tp, fb, input_ids, positions, list(range(seq.num_tokens)))
        return self.model.compute_logits(self.model(input_ids, positions, fb))

    @torch.inference_mode()
    def serve(self) -> None:
        """A tensor-parallel worker's loop: run each step rank 0 sends, on this rank's shard and cache,
        computing logits where rank 0 samples (their gather needs every rank); return at rank 0's stop."""
        static = (self.static_i64, self.static_i32) if self.graphs else None
        while (step := tp_step.receive(self.tp, self.kv_cache, self.sliding_window, self.device, static)) is not None:
            if step.bucket:
                self.graphs[step.bucket][0].replay()
                hidden = self.static_out[:step.n]
            else:
                hidden = self.model(step.input_ids, step.positions, step.fb)
            if step.rows:
                self._logits(hidden, step.rows)

    @staticmethod
    def collect(step: LaunchedStep):
        """Wait for a launched step's tokens; -> (sequences that sample, their tokens as ints, raw logits,
        {row: exception} of the rows whose sampling failed)."""
        if not step.seqs:
            return [], [], None, {}
        if step.ready is not None:
            step.ready.synchronize()
        return step.seqs, step.host_tokens.tolist(), step.raw, step.errors

    def _graph_bucket(self, batch: list[ScheduledSeq]) -> int | None:
        """The captured graph a decode-only step of this size replays, if any."""
        if not self.graphs or len(batch) > max(self.graphs) or any(it.num_tokens != 1 for it in batch):
            return None
        return min(b for b in self.graphs if b >= len(batch))

    def _replay(self, batch: list[ScheduledSeq], bucket: int, after: LaunchedStep | None = None,
                rows: list[int] | None = None) -> torch.Tensor:
        """A decode-only step through its CUDA graph. The step's integers are written straight into two
        pinned host buffers laid out as the graph's static inputs and moved with two copies, instead of a
        tensor per field and a device copy per static buffer (the host time of a small step)."""
        n = len(batch)
        top, width, bs = self.static_ids.numel(), self.graph_width, self.block_size
        self._inputs_copied.synchronize()          # the previous step's copies have left the host buffers
        i64, i32 = self.host_i64_np, self.host_i32_np
        for j, it in enumerate(batch):
            seq = it.seq
            pos = seq.num_computed_tokens
            n_prompt = len(seq.prompt_ids)
            table = seq.block_table
            i64[j] = 0 if after else seq.prompt_ids[pos] if pos < n_prompt else seq.output_ids[pos - n_prompt]
            i64[top + j] = pos
            i64[2 * top + j] = table[pos // bs] * bs + pos % bs
            i32[j] = pos + 1
            i32[top + j * width: top + j * width + len(table)] = table
        i64[2 * top + n: 2 * top + bucket] = -1     # padding rows: no KV store, no attention
        i32[n:bucket] = 0
        if self.lora is not None:                   # padding rows: no adapter
            self.lora.set_step([(it.seq.lora_request, 1) for it in batch] + [(None, bucket - n)])
        self.static_i64.copy_(self.host_i64, non_blocking=True)
        used = top + n * width
        self.static_i32[:used].copy_(self.host_i32[:used], non_blocking=True)
        self._inputs_copied.record()
        if after:
            self.static_ids[:n].copy_(self._pending_ids(batch, after))
        if self.tp is not None:
            tp_step.send_graph(self.tp, bucket, n, used, rows, self.static_i64, self.static_i32)
        self.graphs[bucket][0].replay()
        return self.static_out[:n]

    # --- start-up: memory profile, CUDA graphs ----------------------------------------------------
    @torch.inference_mode()
    def profile_peak_memory(self) -> int:
        """Peak activation bytes of a forward over max_num_batched_tokens tokens plus sampling
        max_num_seqs rows (the cache, allocated before, is not counted). Run on a runner whose cache
        holds dummy_batch(max_num_batched_tokens, ...)."""
        tokens = self.max_num_batched_tokens
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logits = self._prompt_step(tokens)
        rows = logits.shape[0]
        sample_batch(logits, [SamplingParams(temperature=1.0)] * rows, [None] * rows, [([], [])] * rows)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def _prompt_step(self, num_tokens: int) -> torch.Tensor:
        """The logits of a start-up step of num_tokens prompt tokens (dummy_batch), for as many of its last rows as
        a step samples at most (min(num_tokens, max_num_seqs))."""
        fb, input_ids, positions, items, last = self.prepare(dummy_batch(num_tokens, self.max_model_len,
                                                                         self.block_size))
        return self.model.compute_logits(self.model(input_ids, positions, fb)[-min(num_tokens, self.max_num_seqs):])

    def step_sizes(self) -> list[int]:
        """Token counts that stand for every eager step's: path_table.row_classes up to max_num_batched_tokens (a
        kernel's config follows its plan's bucket of rows), and each power of two with the count after it for the
        kernels no plan covers (norms, attention), whose compiles differ only by Triton's specializations."""
        limit, sizes, p = self.max_num_batched_tokens, set(row_classes(self.max_num_batched_tokens)), 1
        while p <= limit:
            sizes.update(n for n in (p, p + 1) if n <= limit)
            p *= 2
        return sorted(sizes)

    @torch.inference_mode()
    def compile_step_shapes(self) -> list[int]:
        """A forward and the logits of a step of each of step_sizes() tokens, so that Triton compiles now the kernel
        configs that eager steps (prefills, mixed batches) will meet, not inside the first requests that meet them;
        then mixed steps of each graph bucket's count of decodes (the decode kernel's splits follow it) over block
        tables 1, 16 and 17 wide (Triton specializes their stride so). Run on the start-up profile's runner, whose
        cache holds the largest step; returns the sizes."""
        sizes = self.step_sizes()
        for n in sizes:
            self._prompt_step(n)
        widths = [w for w in (1, 16, 17) if w * self.block_size <= self.max_model_len and w < self.kv_cache.num_blocks]
        for b in self.graph_buckets():
            for w in widths if b + 5 <= self.max_num_batched_tokens else ():
                fb, input_ids, positions, items, last = self.prepare(dummy_mixed_batch(b, w, self.block_size))
                self._logits(self.model(input_ids, positions, fb), last)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return sizes

    def graph_buckets(self) -> list[int]:
        """Decode batch sizes that get a CUDA graph: powers of two below max_num_seqs, then max_num_seqs."""
        sizes, b = [], 1
        while b < self.max_num_seqs:
            sizes.append(b)
            b *= 2
        return sizes + [self.max_num_seqs]

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """One CUDA graph per decode bucket, largest first, sharing one memory pool."""
        buckets = self.graph_buckets()
        top, hidden = buckets[-1], self.model.config.hidden_size
        width = self.graph_width = -(-self.max_model_len // self.block_size)
        # static inputs: int64 [ids | positions | slots] and int32 [seq_lens | block tables], each filled
        # from a pinned host twin by one copy per step (_replay)
        self.static_i64 = torch.zeros(3 * top, dtype=torch.int64, device=self.device)
        self.static_i32 = torch.zeros(top * (1 + width), dtype=torch.int32, device=self.device)
        self.host_i64 = torch.zeros(3 * top, dtype=torch.int64, pin_memory=self.pin)
        self.host_i32 = torch.zeros(top * (1 + width), dtype=torch.int32, pin_memory=self.pin)
        self.host_i64_np, self.host_i32_np = self.host_i64.numpy(), self.host_i32.numpy()
        self._inputs_copied = torch.cuda.Event()
        self.static_ids, self.static_pos, slots = self.static_i64.view(3, top)
        slots.fill_(-1)
        lens, tables = self.static_i32[:top], self.static_i32[top:].view(top, width)
        starts = torch.arange(top + 1, dtype=torch.int32, device=self.device)
        self.static_out = torch.empty(top, hidden, dtype=self.model.model.norm.weight.dtype, device=self.device)
        pool = None
        if self.lora is not None:                   # the graphs read the rows' slots in place (LoRAStep)
            self.lora.set_step([(None, top)], capture=True)
        for b in reversed(buckets):
            fb = ForwardBatch(self.kv_cache, slots[:b], tables[:b], lens[:b], starts[:b + 1], None, b, 1,
                              self._num_splits(b), self.sliding_window)
            self.static_out[:b] = self.model(self.static_ids[:b], self.static_pos[:b], fb)   # warm-up / JIT
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.static_out[:b] = self.model(self.static_ids[:b], self.static_pos[:b], fb)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = (graph, fb)
        torch.cuda.synchronize()
