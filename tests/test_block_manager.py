"""The KV block pool: reference counts, prefix caching, LRU eviction, invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.core.kv_batch import KVAllocation, KVBatch, KVCommit, KVResult

BS = 4
SYSTEM = list(range(100, 108))  # two full blocks shared by every chat


def admit(bm: BlockManager, rid: str, tokens: list[int], num_new: int | None = None) -> KVResult:
    num_new = len(tokens) if num_new is None else num_new
    return bm.apply(KVBatch(allocations=[KVAllocation(rid, 0, num_new, tokens)]))


def grow(bm: BlockManager, rid: str, computed: int, num_new: int) -> KVResult:
    return bm.apply(KVBatch(allocations=[KVAllocation(rid, computed, num_new)]))


def commit(bm: BlockManager, rid: str, tokens: list[int]) -> None:
    bm.apply(KVBatch(commits=[KVCommit(rid, tokens)]))


def free(bm: BlockManager, *rids: str) -> None:
    bm.apply(KVBatch(frees=rids))


def holders(bm: BlockManager, *rids: str) -> dict[str, tuple[int, ...]]:
    return {rid: bm.block_table(rid) for rid in rids}


def test_allocate_grow_and_free_keep_counts():
    bm = BlockManager(8, BS)
    a = admit(bm, "a", list(range(6)))  # 6 tokens: 2 blocks
    b = admit(bm, "b", list(range(50, 53)))
    assert len(a.block_tables[0]) == 2 and len(b.block_tables[0]) == 1
    assert not set(a.block_tables[0]) & set(b.block_tables[0])
    assert a.budget.num_free_blocks == 6 and b.budget.num_free_blocks == 5
    assert b.budget.usage == pytest.approx(3 / 8)
    bm.check_invariants(holders(bm, "a", "b"))

    grown = grow(bm, "a", 6, 3)  # up to 9 tokens: a third block
    assert grown.block_tables[0][:2] == a.block_tables[0] and len(grown.block_tables[0]) == 3
    assert grow(bm, "a", 9, 1).block_tables[0] == grown.block_tables[0]  # 10 tokens still fit in 3
    free(bm, "a")
    free(bm, "a")  # freeing again is a no-op, not a double free
    bm.check_invariants(holders(bm, "b"))
    assert bm.statistics().num_free_blocks == 7
    free(bm, "b")
    bm.check_invariants({})
    assert bm.statistics().num_free_blocks == 8 and bm.statistics().usage == 0.0


def test_allocation_that_does_not_fit_takes_nothing_and_closes_admissions():
    bm = BlockManager(4, BS)
    admit(bm, "a", list(range(8)))
    result = bm.apply(
        KVBatch(
            allocations=[
                KVAllocation("a", 8, 1),  # a third block: fits
                KVAllocation("big", 0, 12, list(range(200, 212))),  # 3 blocks: does not fit
                KVAllocation("small", 0, 1, [7]),  # would fit, but may not overtake "big"
            ]
        )
    )
    assert result.block_tables[0] is not None and len(result.block_tables[0]) == 3
    assert result.block_tables[1:] == (None, None)
    assert result.budget.num_free_blocks == 1
    bm.check_invariants(holders(bm, "a"))


def test_shared_system_prompt_hits_the_cache_and_shares_blocks():
    bm = BlockManager(16, BS)
    chat_a = SYSTEM + [1, 2, 3]
    table_a = admit(bm, "a", chat_a).block_tables[0]
    commit(bm, "a", chat_a[:8])  # the two full blocks are computed

    chat_b = SYSTEM + [9, 9]
    result = admit(bm, "b", chat_b)
    table_b = result.block_tables[0]
    assert result.num_cached_tokens == (8,)
    assert table_b[:2] == table_a[:2] and table_b[2] not in table_a
    bm.check_invariants(holders(bm, "a", "b"))  # shared blocks have ref count 2

    stats = bm.statistics()
    assert stats.prefix_cache_queries == len(chat_a) + len(chat_b)
    assert stats.prefix_cache_hits == 8
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 21)

    # Freed cached blocks stay reusable: a third chat after both ended.
    free(bm, "a", "b")
    third = admit(bm, "c", SYSTEM + [5])
    assert third.num_cached_tokens == (8,) and third.block_tables[0][:2] == table_a[:2]
    bm.check_invariants(holders(bm, "c"))


def test_hit_chains_over_the_previous_blocks():
    bm = BlockManager(16, BS)
    admit(bm, "a", SYSTEM + [1])
    commit(bm, "a", SYSTEM)
    # Same second block, different first block: no hit at all.
    other = [0, 0, 0, 0] + SYSTEM[4:] + [1]
    assert admit(bm, "b", other).num_cached_tokens == (0,)


def test_full_prompt_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(16, BS)
    admit(bm, "a", SYSTEM)
    commit(bm, "a", SYSTEM)
    result = admit(bm, "b", SYSTEM)  # both blocks cached, but only one may be used
    assert result.num_cached_tokens == (4,)
    assert len(result.block_tables[0]) == 2
    assert result.block_tables[0][1] != bm.block_table("a")[1]


def test_hit_moves_the_chunk_start_and_keeps_its_size():
    bm = BlockManager(16, BS)
    admit(bm, "a", SYSTEM + [1])
    commit(bm, "a", SYSTEM)
    prompt = SYSTEM + list(range(20))
    result = admit(bm, "b", prompt, num_new=8)  # 8 tokens planned, from position 8 after the hit
    assert result.num_cached_tokens == (8,)
    assert len(result.block_tables[0]) == 4


def test_eviction_is_lru_and_reuses_uncached_blocks_first():
    bm = BlockManager(7, BS)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 0], [11, 12, 13, 14, 15, 16, 17, 18, 0]
    admit(bm, "a", a)  # 3 blocks, 2 of them full
    admit(bm, "b", b)
    commit(bm, "a", a[:8])
    commit(bm, "b", b[:8])
    free(bm, "a")  # a's partial blocks hold nothing worth keeping: reused first
    free(bm, "b")
    assert bm.statistics().num_cached_blocks == 4

    admit(bm, "x", list(range(50, 59)))  # 3 blocks: both partial ones and the never-used one
    assert bm.statistics().num_evictions == 0
    assert (bm.cached_prefix_len(a), bm.cached_prefix_len(b)) == (8, 8)
    admit(bm, "y", [60])  # evicts the least recently freed: a's tail block
    assert bm.statistics().num_evictions == 1
    assert (bm.cached_prefix_len(a), bm.cached_prefix_len(b)) == (4, 8)
    admit(bm, "z", [70])  # then a's head
    assert (bm.cached_prefix_len(a), bm.cached_prefix_len(b)) == (0, 8)
    admit(bm, "w", [80])  # then b's tail: its head survives longest
    assert (bm.cached_prefix_len(a), bm.cached_prefix_len(b)) == (0, 4)
    assert bm.statistics().num_evictions == 3
    bm.check_invariants(holders(bm, "x", "y", "z", "w"))


def test_a_hit_refreshes_a_block_in_the_lru_order():
    bm = BlockManager(4, BS)
    admit(bm, "a", [1, 2, 3, 4, 0], num_new=4)
    admit(bm, "b", [5, 6, 7, 8, 0], num_new=4)
    commit(bm, "a", [1, 2, 3, 4])
    commit(bm, "b", [5, 6, 7, 8])
    free(bm, "a", "b")  # a is now the older
    assert admit(bm, "a2", [1, 2, 3, 4, 9], num_new=1).num_cached_tokens == (4,)
    free(bm, "a2")  # a's block is released again: now the newer
    admit(bm, "z", list(range(20, 32)))  # 3 blocks: 2 uncached, then one eviction
    assert bm.statistics().num_evictions == 1
    assert bm.cached_prefix_len([1, 2, 3, 4, 9]) == 4
    assert bm.cached_prefix_len([5, 6, 7, 8, 9]) == 0


def test_a_block_in_use_is_never_evicted():
    bm = BlockManager(4, BS)
    admit(bm, "a", SYSTEM)
    commit(bm, "a", SYSTEM)
    assert admit(bm, "big", list(range(200, 212))).block_tables == (None,)  # 3 blocks, 2 free
    assert admit(bm, "small", list(range(200, 208))).block_tables[0] is not None
    assert bm.statistics().num_free_blocks == 0
    assert bm.statistics().num_evictions == 0
    assert bm.cached_prefix_len(SYSTEM + [1]) == 8
    bm.check_invariants(holders(bm, "a", "small"))


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    admit(bm, "a", SYSTEM + [1])
    commit(bm, "a", SYSTEM)
    free(bm, "a")
    assert admit(bm, "b", SYSTEM + [1]).num_cached_tokens == (0,)
    stats = bm.statistics()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_cached_blocks) == (0, 0, 0)


def test_protocol_errors_are_precise():
    bm = BlockManager(8, BS)
    with pytest.raises(ValueError, match="holds no blocks"):
        commit(bm, "ghost", [1, 2, 3, 4])
    admit(bm, "a", [1, 2, 3])
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        commit(bm, "a", [1, 2, 3])
    with pytest.raises(ValueError, match="holds 1"):
        commit(bm, "a", list(range(8)))
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.apply(KVBatch(allocations=[KVAllocation("new", 3, 1, [1, 2, 3, 4])]))


def test_check_invariants_names_the_fault():
    bm = BlockManager(8, BS)
    table = admit(bm, "a", list(range(6))).block_tables[0]
    with pytest.raises(AssertionError, match="request 'a'"):
        bm.check_invariants({})
    with pytest.raises(AssertionError, match="request 'b'"):
        bm.check_invariants({"a": table, "b": (7,)})
    # Corrupt the pool itself: a leaked block, then a double free.
    block = bm._blocks[table[0]]
    block.ref_count = 2
    with pytest.raises(AssertionError, match=rf"block {table[0]} has ref_count 2 but 1 holder"):
        bm.check_invariants({"a": table})
    block.ref_count = 1
    del bm._free[7]
    with pytest.raises(AssertionError, match="block 7 is leaked"):
        bm.check_invariants({"a": table})
    bm._free[7] = None
    bm._free[table[1]] = None
    with pytest.raises(AssertionError, match=rf"block {table[1]} is in the free queue but held"):
        bm.check_invariants({"a": table})


class PoolMachine(RuleBasedStateMachine):
    """Random admissions, growth, commits and frees against a model of the
    holders; the pool's invariants hold after every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(6, 2)
        self.tokens: dict[str, list[int]] = {}  # request -> tokens it has slots for
        self.committed: dict[str, int] = {}
        self.next_id = 0

    @rule(prefix=st.sampled_from([[], [1, 2], [1, 2, 3, 4]]), tail=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def admit(self, prefix, tail):
        rid = f"r{self.next_id}"
        self.next_id += 1
        tokens = prefix + tail
        result = admit(self.bm, rid, tokens)
        table, cached = result.block_tables[0], result.num_cached_tokens[0]
        if table is not None:
            assert cached < len(tokens) and cached % 2 == 0
            assert len(table) == (len(tokens) + 1) // 2
            self.tokens[rid] = tokens
            self.committed[rid] = cached

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit_and_grow(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[rid]
        full = len(tokens) // 2 * 2
        commit(self.bm, rid, tokens[self.committed[rid] : full])
        self.committed[rid] = full
        result = grow(self.bm, rid, len(tokens), 1)
        if result.block_tables[0] is not None:
            tokens.append(data.draw(st.integers(0, 3)))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        free(self.bm, rid)
        del self.tokens[rid], self.committed[rid]

    @invariant()
    def consistent(self):
        self.bm.check_invariants(holders(self.bm, *self.tokens))

    def teardown(self):
        free(self.bm, *self.tokens)
        self.bm.check_invariants({})
        assert self.bm.statistics().num_free_blocks == 6


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
