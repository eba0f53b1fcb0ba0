"""BlockPool on its own: allocation from the free list, reference counts, prefix caching by chained hashes
of full blocks, fork (shared full blocks, never written: no copy-on-write needed) and exhaustion."""
from __future__ import annotations

from quanta.engine.block_pool import BlockPool
from quanta.engine.sampling_params import SamplingParams
from quanta.engine.sequence import Sequence

BS = 4


def seq(ids) -> Sequence:
    return Sequence("r", 0, list(ids), SamplingParams())


def allocated(pool: BlockPool, ids) -> Sequence:
    s = seq(ids)
    pool.allocate(s)
    return s


def computed(pool: BlockPool, s: Sequence) -> Sequence:
    """As after a step that computed every token of `s`: advance it and register its full blocks."""
    s.num_computed_tokens = s.num_tokens
    pool.hash_full_blocks(s)
    return s


def refs(pool: BlockPool, ids) -> list[int]:
    return [pool.blocks[b].ref_count for b in ids]


def test_allocate_takes_distinct_free_blocks_for_every_token():
    pool = BlockPool(8, BS)
    s = seq(range(10))                              # 10 tokens: 3 blocks, the last partial
    assert pool.can_allocate(s)
    pool.allocate(s)
    assert s.block_table == [0, 1, 2] and refs(pool, s.block_table) == [1, 1, 1]
    assert pool.num_free == 5 and s.num_computed_tokens == 0


def test_free_drops_references_and_queues_blocks_newest_first_at_the_tail():
    pool = BlockPool(8, BS)
    a, b = seq(range(10)), seq(range(100, 105))
    pool.allocate(a)
    pool.allocate(b)
    pool.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert refs(pool, [0, 1, 2]) == [0, 0, 0] and pool.num_free == 6
    assert list(pool.free_ids) == [5, 6, 7, 2, 1, 0]    # a prefix's first block is handed out last
    c = seq(range(200, 203))
    pool.allocate(c)
    assert c.block_table == [5]


def test_prefix_cache_hits_the_full_blocks_of_an_equal_prefix():
    pool = BlockPool(16, BS)
    first = computed(pool, allocated(pool, range(10)))          # full blocks: tokens 0..7
    again = seq(list(range(8)) + [50, 51, 52])
    pool.allocate(again)
    assert again.block_table[:2] == first.block_table[:2] and again.block_table[2] not in first.block_table
    assert refs(pool, first.block_table[:2]) == [2, 2]
    assert again.num_computed_tokens == again.num_cached_tokens == 8 and pool.prefix_hits == 2


def test_the_last_token_is_never_a_cache_hit():
    """A prompt equal to two cached full blocks reuses only the first: its last token must be computed
    for its logits."""
    pool = BlockPool(16, BS)
    s = computed(pool, allocated(pool, range(12)))
    same = seq(range(8))
    pool.allocate(same)
    assert same.block_table[0] == s.block_table[0] and same.block_table[1] != s.block_table[1]
    assert same.num_computed_tokens == 4


def test_hashes_chain_so_an_equal_block_after_a_different_prefix_misses():
    pool = BlockPool(16, BS)
    s = computed(pool, allocated(pool, range(10)))
    other = seq([99, 1, 2, 3] + list(range(4, 10)))      # block 1 holds the same tokens, block 0 does not
    pool.allocate(other)
    assert not set(other.block_table) & set(s.block_table) and other.num_computed_tokens == 0


def test_prefix_caching_off_never_hits():
    pool = BlockPool(16, BS, enable_prefix_caching=False)
    s = computed(pool, allocated(pool, range(10)))
    again = seq(range(10))
    pool.allocate(again)
    assert not set(again.block_table) & set(s.block_table) and pool.prefix_hits == 0


def test_a_freed_cached_block_is_revived_until_it_is_handed_out_again():
    pool = BlockPool(4, BS)
    s = computed(pool, allocated(pool, range(9)))       # blocks 0, 1 full; 2 partial
    cached = s.block_table[:2]
    pool.free(s)
    assert pool.num_free == 4
    revived = seq(range(9))
    assert pool.can_allocate(revived, reserve=False)
    pool.allocate(revived)
    assert revived.block_table[:2] == cached and refs(pool, cached) == [1, 1]
    assert cached[0] not in pool.free_ids and pool.num_free == 1
    pool.free(revived)
    filler = seq(range(1000, 1016))                       # takes all 4 blocks: the cached content is overwritten
    pool.allocate(filler)
    pool.free(filler)
    late = seq(range(9))
    pool.allocate(late)
    assert late.num_computed_tokens == 0 and pool.prefix_hits == 2


def test_can_allocate_counts_revived_blocks_against_the_free_list():
    """Reviving a freed cached block takes it off the free list, so it is no saving in free blocks."""
    pool = BlockPool(3, BS)
    s = computed(pool, allocated(pool, range(9)))
    pool.free(s)
    assert pool.can_allocate(seq(range(9)), reserve=False)          # 2 revived + 1 fresh = 3 free blocks
    assert not pool.can_allocate(seq(range(13)), reserve=False)     # 2 revived + 2 fresh > 3


def test_fork_shares_the_parents_full_computed_blocks_and_never_writes_them():
    pool = BlockPool(16, BS)
    parent = computed(pool, allocated(pool, range(10)))
    child = Sequence("r", 1, list(range(10)), SamplingParams())
    pool.fork(parent, child)
    shared = parent.block_table[:2]
    assert child.block_table[:2] == shared and child.block_table[2] not in parent.block_table
    assert refs(pool, shared) == [2, 2] and child.num_computed_tokens == 8
    # every slot the child will still write (in its table; later blocks come from the free list) is unshared
    assert all(child.block_table[p // BS] not in shared
               for p in range(child.num_computed_tokens, len(child.block_table) * BS))
    pool.free(parent)
    assert refs(pool, shared) == [1, 1]
    pool.free(child)
    assert pool.num_free == 16


def test_fork_of_a_prompt_filling_whole_blocks_recomputes_the_last_token():
    pool = BlockPool(16, BS)
    parent = computed(pool, allocated(pool, range(8)))
    child = Sequence("r", 1, list(range(8)), SamplingParams())
    pool.fork(parent, child)
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert child.num_computed_tokens == 4


def test_exhaustion_and_the_watermark():
    pool = BlockPool(4, BS)
    assert not pool.can_allocate(seq(range(17)), reserve=False)     # 5 blocks
    full = seq(range(16))
    assert pool.can_allocate(full, reserve=False)
    pool.allocate(full)
    assert pool.num_free == 0
    full.output_ids.append(7)                           # a 17th token needs a 5th block
    assert not pool.can_append(full)
    big = BlockPool(200, BS)                            # watermark: 1% of the blocks kept for growth
    everything = seq(range(200 * BS))
    assert big.can_allocate(everything, reserve=False) and not big.can_allocate(everything, reserve=True)


def test_append_slot_grows_by_a_block_only_when_a_token_crosses_into_it():
    pool = BlockPool(8, BS)
    s = seq(range(7))
    pool.allocate(s)
    assert len(s.block_table) == 2
    s.output_ids.append(1)                              # 8 tokens: still 2 blocks
    assert pool.can_append(s)
    pool.append_slot(s)
    assert len(s.block_table) == 2
    pool.append_slot(s, pending=1)                      # a 9th token, sampled but not yet known to the host
    assert len(s.block_table) == 3 and pool.num_free == 5
