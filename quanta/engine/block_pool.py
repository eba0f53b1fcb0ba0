"""The KV block pool: fixed-size blocks, a free list, reference counts and prefix caching.

A sequence's KV lives in `seq.block_table`, a list of block ids. Prefix caching hashes every FULL
block of token ids, chained with its parent's hash, so that equal prefixes map to the same blocks;
such blocks are shared read-only (the engine never writes into a full block, so no copy-on-write).
A freed block keeps its hash and can be revived by a later hit until it is handed out again.

The scheduler uses only the verbs can_allocate / allocate / free / can_append / append_slot /
hash_full_blocks / fork.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def chain_hash(parent: int | tuple | None, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block given its parent block's hash (None for the first block)."""
    return hash((parent, token_ids))


def root_hash(seq) -> tuple | None:
    """The first block's parent: None, or the sequence's adapter, whose KV differs from the base's for the
    same tokens (so each adapter caches its own prefixes)."""
    lora_id = getattr(seq, "lora_id", None)
    return None if lora_id is None else ("lora", lora_id)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None                       # set once the block is full and registered
    token_ids: tuple[int, ...] = field(default=())


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark: float = 0.01):
        assert num_blocks > 0 and block_size > 0
        self.block_size, self.num_blocks = block_size, num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_hits = 0                        # blocks reused from the prefix cache (for tests/metrics)

    # --- accounting ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks on the free list (cached ones that no sequence holds included)."""
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> int:
        block_id = self.free_ids.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]          # its cached content is being overwritten
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_ids.remove(block_id)              # revived from the free list by a cache hit
        block.ref_count += 1

    def _cached_prefix(self, seq) -> list[int]:
        """Ids of cached blocks matching the leading full blocks of `seq`'s tokens under its adapter. The last
        token is never covered, so that a step always computes it (its logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        token_ids = seq.all_ids
        hits, parent = [], root_hash(seq)
        for i in range((len(token_ids) - 1) // self.block_size):
            chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = chain_hash(parent, chunk)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    # --- verbs --------------------------------------------------------------------------------
    def can_allocate(self, seq, reserve: bool = True, extra: int = 0) -> bool:
        """Room for all of `seq`'s current tokens (counting prefix-cache hits), keeping a small
        watermark of blocks and `extra` more free for the running sequences' growth when `reserve`."""
        hits = self._cached_prefix(seq)
        revived = sum(self.blocks[b].ref_count == 0 for b in hits)
        needed = self.blocks_needed(seq.num_tokens) - len(hits) + revived
        return needed + (self.watermark_blocks + extra if reserve else 0) <= self.num_free

    def allocate(self, seq, use_cache: bool = True) -> None:
        """Give `seq` blocks for all its tokens; leading cached blocks are shared, and
        seq.num_computed_tokens starts after them."""
        assert not seq.block_table
        hits = self._cached_prefix(seq) if use_cache else []
        for block_id in hits:
            self._ref(block_id)
        self.prefix_hits += len(hits)
        seq.block_table = hits + [self._take_free() for _ in range(self.blocks_needed(seq.num_tokens) - len(hits))]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)

    def fork(self, parent, child) -> None:
        """Share `parent`'s computed FULL blocks with `child` (n > 1 samples); the child gets fresh
        blocks for the rest and recomputes only the partial tail, so no shared block is written."""
        assert not child.block_table
        full = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        for block_id in parent.block_table[:full]:
            self._ref(block_id)
        child.block_table = parent.block_table[:full] + [
            self._take_free() for _ in range(self.blocks_needed(child.num_tokens) - full)]
        child.num_computed_tokens = child.num_cached_tokens = full * self.block_size
        child.num_hashed_blocks = min(full, parent.num_hashed_blocks)

    def free(self, seq) -> None:
        """Drop `seq`'s references. Freed blocks join the free list's tail newest first, so the
        blocks holding the start of a (cached) prefix are the last to be handed out again."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_hashed_blocks = 0

    def can_append(self, seq) -> bool:
        """Room for the slot of `seq`'s newest token."""
        return len(seq.block_table) >= self.blocks_needed(seq.num_tokens) or self.num_free > 0

    def append_slot(self, seq, pending: int = 0) -> None:
        """Grow `seq`'s table to hold its tokens and `pending` more (sampled, not yet known to the host)."""
        if len(seq.block_table) < self.blocks_needed(seq.num_tokens + pending):
            seq.block_table.append(self._take_free())
        assert len(seq.block_table) == self.blocks_needed(seq.num_tokens + pending)

    def hash_full_blocks(self, seq) -> None:
        """Register every full block whose tokens are all computed (after a step)."""
        if not self.enable_prefix_caching:
            return
        ids = seq.all_ids
        full = min(seq.num_computed_tokens, len(ids)) // self.block_size
        parent = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks \
            else root_hash(seq)
        for i in range(seq.num_hashed_blocks, full):
            chunk = tuple(ids[i * self.block_size:(i + 1) * self.block_size])
            parent = chain_hash(parent, chunk)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = parent, chunk
            self.hash_to_block.setdefault(parent, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)
