"""Memory follows use (issue 39): the KV pool commits memory as tokens are
written, not at start.

A CPU pool is a mapping whose pages the kernel commits when first written
(engine/layers/kv_cache.py): the process's resident memory does not grow by the
pool's size when it is allocated, and grows by about the bytes of the
tokens written. The block manager hands out the lowest block ids first and
reuses written blocks before new ones, so with ``reuse_written_first`` (the
engine's choice on CPU) the blocks ever written are exactly the most blocks
held at once. What attention may read of a slot never written is zeros,
never garbage (which could be NaN). Resident memory is read from
/proc/self/status (``trioserve.bench.memory``) and the pool's own pages from ``mincore``.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import make_core
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.bench.memory import rss_bytes
from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.core.kv_batch import KVAllocation, KVBatch, KVCommit
from trioserve.engine.layers.kv_cache import KVCache, kv_bytes_per_block
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.testing.tiny_model import BLOCK_SIZE, tiny_model_config

MIB = 1 << 20
PAGE = 4096


# -- the pool's tensors ----------------------------------------------------------


def test_a_cpu_pool_commits_memory_as_blocks_are_written_not_at_allocation():
    config = tiny_model_config()
    per_block = kv_bytes_per_block(config, BLOCK_SIZE, torch.float32)
    num_blocks = (512 * MIB) // per_block
    gc.collect()
    before = rss_bytes()
    kv = KVCache.allocate(config, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=torch.float32, device="cpu")
    allocated = rss_bytes()
    assert kv.nbytes >= 500 * MIB
    # A zero fill would have committed all 512 MiB here.
    assert allocated - before < 32 * MIB, f"allocating a {kv.nbytes / MIB:.0f} MiB pool took {(allocated - before) / MIB:.0f} MiB"
    assert kv.resident_bytes() == 0

    # Write the first 64 MiB worth of blocks (every layer, keys and values).
    written_blocks = (64 * MIB) // per_block
    kv.key[:, :written_blocks] = 0.5
    kv.value[:, :written_blocks] = -0.5
    written = written_blocks * per_block
    pools = 2 * config.num_hidden_layers  # each layer's keys and values: one partial page at most each
    assert written <= kv.resident_bytes() <= written + pools * PAGE
    assert rss_bytes() - allocated >= 0.9 * written
    assert torch.count_nonzero(kv.key[:, written_blocks:]) == 0


def test_slots_never_written_read_as_zeros_where_the_heap_held_nan():
    config = tiny_model_config()
    shape = (config.num_hidden_layers, 8, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    # A small pool (below glibc's mmap threshold): torch.empty could hand
    # back these freed NaN bytes, which attention's mask would not hide (0 * NaN).
    junk = [torch.full(shape, float("nan")) for _ in range(4)]
    del junk
    kv = KVCache.allocate(config, num_blocks=8, block_size=BLOCK_SIZE, dtype=torch.float32, device="cpu")
    assert torch.count_nonzero(kv.key) == 0 and torch.count_nonzero(kv.value) == 0
    assert kv.key.is_contiguous() and kv.value.is_contiguous()


# -- the block manager's order -----------------------------------------------------


def admit(bm: BlockManager, rid: str, tokens: list[int]) -> tuple[int, ...]:
    table = bm.apply(KVBatch(allocations=[KVAllocation(rid, 0, len(tokens), tokens)])).block_tables[0]
    assert table is not None
    return table


def test_blocks_are_handed_out_lowest_id_first_and_written_ones_reused_first():
    bm = BlockManager(100, 4)
    assert admit(bm, "a", list(range(12))) == (0, 1, 2)
    assert admit(bm, "b", list(range(100, 108))) == (3, 4)
    bm.apply(KVBatch(frees=["a"]))
    # a's blocks hold nothing cached (never committed): reused before block 5.
    assert sorted(admit(bm, "c", list(range(200, 212)))) == [0, 1, 2]
    assert bm.num_written_blocks == 5
    bm.check_invariants({"b": (3, 4), "c": bm.block_table("c")})


@pytest.mark.parametrize(("reuse_written_first", "written", "evictions"), [(True, 3, 3), (False, 6, 0)])
def test_reuse_written_first_evicts_a_cached_block_before_writing_a_new_one(reuse_written_first, written, evictions):
    bm = BlockManager(100, 4, reuse_written_first=reuse_written_first)
    a = list(range(12))
    admit(bm, "a", a)
    bm.apply(KVBatch(commits=[KVCommit("a", a)], frees=["a"]))
    assert bm.statistics().num_cached_blocks == 3
    admit(bm, "b", list(range(100, 112)))
    assert bm.num_written_blocks == written
    assert bm.statistics().num_evictions == evictions
    assert bm.cached_prefix_len(a + [99]) == (0 if reuse_written_first else 12)
    bm.check_invariants({"b": bm.block_table("b")})


def test_forgetting_the_cache_puts_the_free_blocks_back_in_id_order():
    bm = BlockManager(16, 4, reuse_written_first=True)
    for rid, start in (("a", 0), ("b", 100), ("c", 200)):
        tokens = list(range(start, start + 8)) + [999]
        admit(bm, rid, tokens)
        bm.apply(KVBatch(commits=[KVCommit(rid, tokens[:8])]))
    bm.apply(KVBatch(frees=["b", "a", "c"], forget_cache=True))
    assert admit(bm, "d", list(range(500, 520))) == (0, 1, 2, 3, 4)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["admit", "grow", "commit", "free", "forget"]), st.integers(0, 5), st.integers(1, 9)),
        max_size=60,
    )
)
def test_blocks_written_are_the_most_held_at_once(ops):
    """With ``reuse_written_first``, whatever the admissions, growth, commits,
    frees and forgets: the blocks ever written are ids 0 .. n - 1, and n is
    the most blocks requests held at the same time."""
    bm = BlockManager(24, 2, reuse_written_first=True)
    tokens: dict[str, list[int]] = {}
    committed: dict[str, int] = {}
    most_held = 0
    for op, who, size in ops:
        rid = f"r{who}"
        if op == "admit" and rid not in tokens:
            # Prompts share prefixes (the low ids), so some admissions hit.
            prompt = [who % 2] * 2 + [who * 10 + i for i in range(size)]
            result = bm.apply(KVBatch(allocations=[KVAllocation(rid, 0, len(prompt), prompt)]))
            if result.block_tables[0] is not None:
                tokens[rid], committed[rid] = prompt, result.num_cached_tokens[0]
        elif op == "grow" and rid in tokens:
            new = [who * 10 + 100 + i for i in range(size)]
            if bm.apply(KVBatch(allocations=[KVAllocation(rid, len(tokens[rid]), len(new))])).block_tables[0]:
                tokens[rid] += new
        elif op == "commit" and rid in tokens:
            full = len(tokens[rid]) // 2 * 2
            bm.apply(KVBatch(commits=[KVCommit(rid, tokens[rid][committed[rid] : full])]))
            committed[rid] = full
        elif op == "free" and rid in tokens:
            bm.apply(KVBatch(frees=[rid]))
            del tokens[rid], committed[rid]
        elif op == "forget":
            bm.apply(KVBatch(forget_cache=True))
        held = {b for rid in tokens for b in bm.block_table(rid)}
        most_held = max(most_held, len(held))
        assert held <= set(range(bm.num_written_blocks))
        assert bm.num_written_blocks == most_held
        bm.check_invariants({rid: bm.block_table(rid) for rid in tokens})


# -- the engine on the default model -------------------------------------------------


@pytest.mark.slow
def test_the_default_models_engine_commits_its_pool_with_the_tokens_held(default_loaded):
    # An engine first, so that what any engine imports and builds once is not counted.
    make_core(default_loaded)
    gc.collect()
    before = rss_bytes()
    core = make_core(default_loaded, kv_cache_memory=1 << 30, max_num_seqs=32, max_model_len=2048, kv_cache_dtype="float32")
    assert core.kv_cache.nbytes > 1000 * MIB
    # Zero-filled, the pool alone would have added its gigabyte.
    assert rss_bytes() - before < 128 * MIB
    assert core.kv_cache.resident_bytes() == 0

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(8):
        core.add_request(f"r{i}", [1000 + 37 * i + j for j in range(300)], params)
    while core.has_unfinished():
        core.step()
    # 8 sequences of 303 written tokens (the 4th generated token is not fed
    # back), all in the pool at once: 19 blocks each.
    bm = core.block_manager
    per_block = core.kv_pool.bytes_per_block
    token = per_block // core.config.block_size
    assert bm.num_written_blocks <= 8 * 19
    resident = core.kv_cache.resident_bytes()
    pools = 2 * default_loaded.model_config.num_hidden_layers
    assert 8 * 303 * token <= resident <= bm.num_written_blocks * per_block + pools * PAGE
