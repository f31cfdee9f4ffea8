"""The KV block pool: reference-counted blocks with automatic prefix caching.

A full block is identified by a hash chained over the previous block's hash
and its own token ids, so equal hashes mean equal prefixes. A new request
reuses every cached full block at the start of its tokens. A block no request
holds stays in the cache until it is needed for other content (evicted).

The free queue orders the blocks no request holds: blocks without cached
content first (reusing them loses nothing), then cached ones from least to
most recently released (LRU). A block in use is never in the queue, so never
evicted. The blocks never handed out are in id order, behind those freed
without content: taken lowest id first, so the blocks ever used are always
ids ``0 .. num_written_blocks - 1``.

Where the pool's memory is committed as a block is first written (a CPU
pool: engine/layers/kv_cache.py), ``reuse_written_first`` takes a written block,
evicting the least recently used cached one, before a block never written:
the pool's resident memory then grows only with the most blocks requests
held at once, and the prefix cache keeps what that memory leaves free.
Without it (a CUDA pool, allocated whole), a never-written block is taken
before any cached content is evicted, and the cache may fill the pool.

``apply(batch)`` is the only way to change the pool; see ``kv_batch`` for
the order it applies a batch in.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence

import attrs

from trioserve.engine.core.kv_batch import KVAllocation, KVBatch, KVBudget, KVCommit, KVResult
from trioserve.engine.validators import positive

# The parent hash of a request's first block. Python's hash of a tuple of
# ints is 64 bits and does not depend on PYTHONHASHSEED; two different
# prefixes sharing a chain hash is a 2**-64 event per pair.
_ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The chained hash of a full block of ``token_ids`` after ``parent_hash``."""
    return hash((parent_hash, tuple(token_ids)))


@attrs.define
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block's content is in the cache


@attrs.define
class _Holding:
    """What the pool knows of one request."""

    block_ids: list[int]
    num_hashed_blocks: int  # leading blocks whose hashes are known
    last_hash: int  # hash of the last of those, or _ROOT_HASH


@attrs.define
class BlockManager:
    """A fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens each;
    ``reuse_written_first``: see the module's docstring."""

    num_blocks: int = attrs.field(validator=positive)
    block_size: int = attrs.field(validator=positive)
    enable_prefix_caching: bool = attrs.field(default=True, kw_only=True)
    reuse_written_first: bool = attrs.field(default=False, kw_only=True)
    _blocks: list[_Block] = attrs.field(init=False)
    # Insertion order is eviction order: the front is reused first.
    _free: collections.OrderedDict[int, None] = attrs.field(init=False)
    # The free queue's cached blocks, in the same (LRU) order.
    _evictable: collections.OrderedDict[int, None] = attrs.field(init=False, factory=collections.OrderedDict)
    _num_written: int = attrs.field(init=False, default=0)  # blocks 0 .. _num_written - 1 were handed out
    _cached: dict[int, int] = attrs.field(init=False, factory=dict)  # block hash -> block id
    _holdings: dict[str, _Holding] = attrs.field(init=False, factory=dict)
    _queries: int = attrs.field(init=False, default=0)
    _hits: int = attrs.field(init=False, default=0)
    _evictions: int = attrs.field(init=False, default=0)
    _num_forgotten: int = attrs.field(init=False, default=0)  # times the cache was forgotten (worker restarts)

    def __attrs_post_init__(self) -> None:
        self._blocks = [_Block(i) for i in range(self.num_blocks)]
        self._free = collections.OrderedDict.fromkeys(range(self.num_blocks))

    # -- the entry point ------------------------------------------------------

    def apply(self, batch: KVBatch) -> KVResult:
        """Apply a batch (commits, then frees, then allocations in order).

        Freeing a request that holds no blocks does nothing, so a free may be
        sent for a request whose admission never reached the pool.
        """
        for commit in batch.commits:
            self._commit(commit)
        for request_id in batch.frees:
            self._release(request_id)
        if batch.forget_cache:
            self._forget_cache()
        tables: list[tuple[int, ...] | None] = []
        cached: list[int] = []
        admissions_closed = False
        for allocation in batch.allocations:
            is_admission = allocation.request_id not in self._holdings
            if is_admission and admissions_closed:
                tables.append(None)
                cached.append(0)
                continue
            table, num_cached = self._allocate(allocation)
            if table is None and is_admission:
                admissions_closed = True
            tables.append(table)
            cached.append(num_cached)
        return KVResult(block_tables=tuple(tables), num_cached_tokens=tuple(cached), budget=self.statistics())

    def statistics(self) -> KVBudget:
        """The pool's state now: block counts and the prefix-cache counters.
        Each ``KVResult`` carries it as ``budget``, and the scheduler plans
        the next step from it."""
        return KVBudget(
            num_blocks=self.num_blocks,
            num_free_blocks=len(self._free),
            num_cached_blocks=len(self._cached),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            num_evictions=self._evictions,
        )

    @property
    def num_written_blocks(self) -> int:
        """Blocks ever handed out, ids ``0 .. num_written_blocks - 1``: those
        whose memory a CPU pool has committed."""
        return self._num_written

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The blocks a request holds, in position order (empty if none)."""
        holding = self._holdings.get(request_id)
        return () if holding is None else tuple(holding.block_ids)

    def cached_prefix_len(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` an admission would find
        in the cache now; changes nothing, counts nothing."""
        if not self.enable_prefix_caching:
            return 0
        return len(self._lookup(token_ids)[0]) * self.block_size

    # -- the three operations -------------------------------------------------

    def _commit(self, commit: KVCommit) -> None:
        holding = self._holdings.get(commit.request_id)
        if holding is None:
            raise ValueError(f"commit for request {commit.request_id!r}, which holds no blocks")
        if len(commit.token_ids) % self.block_size:
            raise ValueError(
                f"commit for request {commit.request_id!r} has {len(commit.token_ids)} tokens, "
                f"not a multiple of block_size ({self.block_size})"
            )
        num_full = len(commit.token_ids) // self.block_size
        if holding.num_hashed_blocks + num_full > len(holding.block_ids):
            raise ValueError(
                f"commit for request {commit.request_id!r} reaches block {holding.num_hashed_blocks + num_full} "
                f"but it holds {len(holding.block_ids)}"
            )
        for i in range(num_full):
            chunk = commit.token_ids[i * self.block_size : (i + 1) * self.block_size]
            holding.last_hash = hash_block(holding.last_hash, chunk)
            block = self._blocks[holding.block_ids[holding.num_hashed_blocks]]
            holding.num_hashed_blocks += 1
            # A second block with content already cached stays uncached: the
            # cache maps each hash to one block.
            if self.enable_prefix_caching and holding.last_hash not in self._cached:
                assert block.block_hash is None, f"block {block.block_id} committed twice"
                block.block_hash = holding.last_hash
                self._cached[holding.last_hash] = block.block_id

    def _release(self, request_id: str) -> None:
        holding = self._holdings.pop(request_id, None)
        if holding is None:
            return
        # Released tail first: the tail is the part least likely shared.
        for block_id in reversed(holding.block_ids):
            block = self._blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed with ref_count {block.ref_count}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._evictable[block_id] = None

    def _forget_cache(self) -> None:
        """Drop every block's cached content (its KV tensors are lost). A
        block still held keeps its holder but no longer serves a lookup."""
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        self._evictable.clear()
        # No free block has content now: the queue goes back to id order,
        # lowest first, as on a fresh pool (the tensors that were lost are
        # replaced by a fresh pool, none of its pages written).
        self._free = collections.OrderedDict.fromkeys(sorted(self._free))
        self._num_forgotten += 1

    def _allocate(self, allocation: KVAllocation) -> tuple[tuple[int, ...] | None, int]:
        holding = self._holdings.get(allocation.request_id)
        if holding is None:
            return self._admit(allocation)
        num_tokens = allocation.num_computed_tokens + allocation.num_new_tokens
        num_needed = max(0, math.ceil(num_tokens / self.block_size) - len(holding.block_ids))
        if num_needed > len(self._free):
            return None, 0
        holding.block_ids.extend(self._take_fresh() for _ in range(num_needed))
        return tuple(holding.block_ids), 0

    def _admit(self, allocation: KVAllocation) -> tuple[tuple[int, ...] | None, int]:
        if allocation.num_computed_tokens != 0:
            raise ValueError(
                f"allocation for request {allocation.request_id!r} says {allocation.num_computed_tokens} tokens "
                "are computed, but it holds no blocks"
            )
        token_ids = allocation.token_ids
        hit_blocks, last_hash = self._lookup(token_ids) if self.enable_prefix_caching else ([], _ROOT_HASH)
        num_cached = len(hit_blocks) * self.block_size
        num_new = allocation.num_new_tokens
        if token_ids:
            num_new = min(num_new, len(token_ids) - num_cached)
        num_fresh = math.ceil((num_cached + num_new) / self.block_size) - len(hit_blocks)
        # A hit block no one holds leaves the free queue, so it costs one too.
        cost = num_fresh + sum(1 for b in hit_blocks if self._blocks[b].ref_count == 0)
        if cost > len(self._free):
            return None, 0
        for block_id in hit_blocks:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                del self._evictable[block_id]
            block.ref_count += 1
        block_ids = hit_blocks + [self._take_fresh() for _ in range(num_fresh)]
        self._holdings[allocation.request_id] = _Holding(block_ids, len(hit_blocks), last_hash)
        if self.enable_prefix_caching:
            self._queries += len(token_ids)
            self._hits += num_cached
        return tuple(block_ids), num_cached

    def _lookup(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        # The last token is never served from the cache: computing it gives
        # the logits the next token is sampled from.
        num_full = max(0, len(token_ids) - 1) // self.block_size
        parent = _ROOT_HASH
        blocks: list[int] = []
        for i in range(num_full):
            block_hash = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
            parent = block_hash
        return blocks, parent

    def _take_fresh(self) -> int:
        block_id = next(iter(self._free))
        if self.reuse_written_first and block_id >= self._num_written and self._evictable:
            # The front is a block never written: evict instead.
            block_id = next(iter(self._evictable))
        del self._free[block_id]
        self._num_written = max(self._num_written, block_id + 1)
        block = self._blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref_count {block.ref_count}"
        if block.block_hash is not None:
            del self._evictable[block_id]
            del self._cached[block.block_hash]
            block.block_hash = None
            self._evictions += 1
        block.ref_count = 1
        return block_id

    # -- checks ---------------------------------------------------------------

    def check_invariants(self, holders: Mapping[str, Sequence[int]]) -> None:
        """Check the pool against ``holders`` (request id -> block table).

        Raise ``AssertionError`` naming the block or request at fault if a
        block is leaked (neither held nor free), freed twice, or its ref count
        differs from the number of holders, or the cache index is
        inconsistent.
        """
        mine = {rid: h.block_ids for rid, h in self._holdings.items()}
        for rid in sorted(set(mine) | set(holders)):
            theirs = list(holders.get(rid, ()))
            if mine.get(rid, []) != theirs:
                raise AssertionError(
                    f"request {rid!r}: the pool holds blocks {mine.get(rid, [])}, the caller says {theirs}"
                )
        counts = collections.Counter(b for table in mine.values() for b in table)
        for rid, table in mine.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {rid!r} holds a block twice: {table}")
        for block in self._blocks:
            held = counts.get(block.block_id, 0)
            if block.ref_count != held:
                raise AssertionError(f"block {block.block_id} has ref_count {block.ref_count} but {held} holder(s)")
            in_free = block.block_id in self._free
            if held == 0 and not in_free:
                raise AssertionError(f"block {block.block_id} is leaked: no holder and not in the free queue")
            if held > 0 and in_free:
                raise AssertionError(f"block {block.block_id} is in the free queue but held {held} time(s)")
            if block.block_hash is not None and self._cached.get(block.block_hash) != block.block_id:
                raise AssertionError(f"block {block.block_id} has a hash the cache index does not map to it")
        evictable = [b for b in self._free if self._blocks[b].block_hash is not None]
        if list(self._evictable) != evictable:
            raise AssertionError(f"the evictable blocks {list(self._evictable)} differ from the free queue's cached ones {evictable}")
        for block_hash, block_id in self._cached.items():
            if self._blocks[block_id].block_hash != block_hash:
                raise AssertionError(f"cache index maps a hash to block {block_id}, which holds other content")
        if len(self._free) + sum(1 for b in self._blocks if b.ref_count > 0) != self.num_blocks:
            raise AssertionError("free and held blocks do not add up to num_blocks")
