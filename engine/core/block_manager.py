"""The KV block pool: reference-counted blocks with automatic prefix caching.

A full block is identified by a hash chained over the previous block's hash
and its own token ids, so equal hashes mean equal prefixes. A new request
reuses every cached full block at the start of its tokens. A block no request
holds stays in the cache until it is needed for other content (evicted).
How blocks are queued, reused and evicted: block_pool.py (with
``reuse_written_first`` for a CPU pool, whose memory is committed as a
block is first written; without it, a CUDA pool allocated whole, a
never-written block is taken before any cached content is evicted).

**Sliding-window layers** (``window``; Gemma 2/3, gpt-oss, Mistral v0.1)
are a second group with a pool of their own (``num_window_blocks``,
their own KV tensors) and a second block table per request, indexed like
the first. A query at position ``p`` of such a layer sees keys
``p - window + 1 .. p``; so when a request's next chunk starts at ``s``,
its window blocks wholly before ``s - window + 1`` are released (back to
the free queue, with their cached content) and their table entries become
``NULL_BLOCK``, a reserved block never written and always masked. The
first group (the layers that see the whole context) is what the scheduler
plans against; the window group is sized so every admitted sequence's
window fits (engine/runtime/build.py) and is checked along, atomically:
an allocation either fits both groups or takes nothing.

A prefix-cache hit for such a model is the longest block-aligned prefix
``h`` whose full-group blocks are all cached and whose window group still
caches the blocks covering ``h - window + 1 .. h - 1`` (earlier ones are
``NULL_BLOCK``): a hit the sliding layers cannot attend over is no hit.

``apply(batch)`` is the only way to change the pool; see ``kv_batch`` for
the order it applies a batch in.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence

import attrs

from trioserve.engine.core.block_pool import Block, BlockPool
from trioserve.engine.core.kv_batch import KVAllocation, KVBatch, KVBudget, KVCommit, KVResult
from trioserve.engine.validators import positive

# The parent hash of a request's first block. Python's hash of a tuple of
# ints is 64 bits and does not depend on PYTHONHASHSEED; two different
# prefixes sharing a chain hash is a 2**-64 event per pair.
_ROOT_HASH = 0
# The window group's placeholder for a block released out of the window.
NULL_BLOCK = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The chained hash of a full block of ``token_ids`` after ``parent_hash``."""
    return hash((parent_hash, tuple(token_ids)))


@attrs.define
class _Holding:
    """What the pool knows of one request."""

    block_ids: list[int]
    num_hashed_blocks: int  # leading blocks whose hashes are known
    last_hash: int  # hash of the last of those, or _ROOT_HASH
    # The window group's table, as long as ``block_ids`` (NULL_BLOCK where
    # released); None without a window group.
    window_ids: list[int] | None = None
    # Entries of window_ids below this are all NULL_BLOCK: a step releases
    # from here, not from the table's head (a long context has many).
    num_slid: int = 0


@attrs.define
class BlockManager:
    """A fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens each;
    ``reuse_written_first``: see block_pool.py. With ``window``, a second
    group of ``num_window_blocks`` (the null block included) for the
    sliding-window layers: see the module's docstring."""

    num_blocks: int = attrs.field(validator=positive)
    block_size: int = attrs.field(validator=positive)
    enable_prefix_caching: bool = attrs.field(default=True, kw_only=True)
    reuse_written_first: bool = attrs.field(default=False, kw_only=True)
    window: int | None = attrs.field(default=None, kw_only=True)
    num_window_blocks: int = attrs.field(default=0, kw_only=True)
    _pool: BlockPool = attrs.field(init=False)
    _window_pool: BlockPool | None = attrs.field(init=False, default=None)
    _holdings: dict[str, _Holding] = attrs.field(init=False, factory=dict)
    _queries: int = attrs.field(init=False, default=0)
    _hits: int = attrs.field(init=False, default=0)
    _num_forgotten: int = attrs.field(init=False, default=0)  # times the cache was forgotten (worker restarts)

    def __attrs_post_init__(self) -> None:
        self._pool = BlockPool(self.num_blocks, reuse_written_first=self.reuse_written_first)
        if self.window is not None:
            if self.window < 1:
                raise ValueError(f"window must be >= 1, got {self.window}")
            if self.num_window_blocks < 2:
                raise ValueError(f"num_window_blocks must be >= 2 (one is the null block), got {self.num_window_blocks}")
            # Never reuse_written_first: the group is sized for windows, not
            # contexts, so all of it may be written, and its blocks not yet
            # written are what keeps released windows cached for a prefix hit.
            self._window_pool = BlockPool(self.num_window_blocks, num_reserved=NULL_BLOCK + 1)

    # The full group's internals, under the names tests poke at.
    @property
    def _blocks(self) -> list[Block]:
        return self._pool.blocks

    @property
    def _free(self) -> collections.OrderedDict[int, None]:
        return self._pool.free

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
        window_tables: list[tuple[int, ...] | None] = []
        cached: list[int] = []
        admissions_closed = False
        for allocation in batch.allocations:
            is_admission = allocation.request_id not in self._holdings
            if is_admission and admissions_closed:
                tables.append(None)
                cached.append(0)
                if self._window_pool is not None:
                    window_tables.append(None)
                continue
            table, num_cached = self._allocate(allocation)
            if table is None and is_admission:
                admissions_closed = True
            tables.append(table)
            cached.append(num_cached)
            if self._window_pool is not None:
                window = None if table is None else self._holdings[allocation.request_id].window_ids
                window_tables.append(None if window is None else tuple(window))
        return KVResult(
            block_tables=tuple(tables),
            num_cached_tokens=tuple(cached),
            budget=self.statistics(),
            window_tables=tuple(window_tables),
        )

    def statistics(self) -> KVBudget:
        """The pool's state now: block counts and the prefix-cache counters.
        Each ``KVResult`` carries it as ``budget``, and the scheduler plans
        the next step from it (the full group; the window group's counts
        are reported beside, 0 without one)."""
        window = self._window_pool
        return KVBudget(
            num_blocks=self.num_blocks,
            num_free_blocks=len(self._pool.free),
            num_cached_blocks=len(self._pool.cached),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            num_evictions=self._pool.num_evictions,
            num_window_blocks=0 if window is None else window.num_usable,
            num_free_window_blocks=0 if window is None else len(window.free),
            num_cached_window_blocks=0 if window is None else len(window.cached),
        )

    @property
    def num_written_blocks(self) -> int:
        """Blocks ever handed out, ids ``0 .. num_written_blocks - 1``: those
        whose memory a CPU pool has committed."""
        return self._pool.num_written

    @property
    def num_written_window_blocks(self) -> int:
        """The same for the window group (its null block included; 0 without one)."""
        return 0 if self._window_pool is None else self._window_pool.num_written

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The blocks a request holds, in position order (empty if none)."""
        holding = self._holdings.get(request_id)
        return () if holding is None else tuple(holding.block_ids)

    def window_table(self, request_id: str) -> tuple[int, ...]:
        """A request's window-group table (``NULL_BLOCK`` where released;
        empty if it holds none, or without a window group)."""
        holding = self._holdings.get(request_id)
        return () if holding is None or holding.window_ids is None else tuple(holding.window_ids)

    def cached_prefix_len(self, token_ids: Sequence[int], root: int = _ROOT_HASH) -> int:
        """How many leading tokens of ``token_ids`` an admission (from
        ``root``: ``KVAllocation.root_hash``) would find in the cache now;
        changes nothing, counts nothing."""
        if not self.enable_prefix_caching:
            return 0
        return self._hit(token_ids, root)[0] * self.block_size

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
            index = holding.num_hashed_blocks
            holding.num_hashed_blocks += 1
            if not self.enable_prefix_caching:
                continue
            self._pool.cache(holding.block_ids[index], holding.last_hash)
            if holding.window_ids is not None and holding.window_ids[index] != NULL_BLOCK:
                # Commits come before releases in a batch, so a computed
                # block is hashed before it can fall out of the window.
                assert self._window_pool is not None
                self._window_pool.cache(holding.window_ids[index], holding.last_hash)

    def _release(self, request_id: str) -> None:
        holding = self._holdings.pop(request_id, None)
        if holding is None:
            return
        # Released tail first: the tail is the part least likely shared.
        for block_id in reversed(holding.block_ids):
            self._pool.release(block_id)
        if holding.window_ids is not None:
            assert self._window_pool is not None
            for block_id in reversed(holding.window_ids):
                if block_id != NULL_BLOCK:
                    self._window_pool.release(block_id)

    def _forget_cache(self) -> None:
        """Drop every block's cached content (its KV tensors are lost). A
        block still held keeps its holder but no longer serves a lookup."""
        self._pool.forget()
        if self._window_pool is not None:
            self._window_pool.forget()
        self._num_forgotten += 1

    def _allocate(self, allocation: KVAllocation) -> tuple[tuple[int, ...] | None, int]:
        holding = self._holdings.get(allocation.request_id)
        if holding is None:
            return self._admit(allocation)
        num_tokens = allocation.num_computed_tokens + allocation.num_new_tokens
        num_needed = max(0, math.ceil(num_tokens / self.block_size) - len(holding.block_ids))
        window = self._window_pool
        if window is not None:
            # Whatever this allocation gets, no query of this request will
            # again sit before num_computed_tokens.
            self._slide(holding, allocation.num_computed_tokens)
            if num_needed > len(window.free):
                return None, 0
        if num_needed > len(self._pool.free):
            return None, 0
        holding.block_ids.extend(self._pool.take() for _ in range(num_needed))
        if window is not None:
            assert holding.window_ids is not None
            holding.window_ids.extend(window.take() for _ in range(num_needed))
        return tuple(holding.block_ids), 0

    def _first_seen_block(self, position: int) -> int:
        """The first block a window layer's query at ``position`` reads."""
        assert self.window is not None
        return max(0, position - self.window + 1) // self.block_size

    def _slide(self, holding: _Holding, position: int) -> None:
        """Release the window blocks no query from ``position`` on reads."""
        assert holding.window_ids is not None and self._window_pool is not None
        first = min(self._first_seen_block(position), len(holding.window_ids))
        for i in range(holding.num_slid, first):
            assert holding.window_ids[i] != NULL_BLOCK, f"window block {i} released twice"
            self._window_pool.release(holding.window_ids[i])
            holding.window_ids[i] = NULL_BLOCK
        holding.num_slid = max(holding.num_slid, first)

    def _admit(self, allocation: KVAllocation) -> tuple[tuple[int, ...] | None, int]:
        if allocation.num_computed_tokens != 0:
            raise ValueError(
                f"allocation for request {allocation.request_id!r} says {allocation.num_computed_tokens} tokens "
                "are computed, but it holds no blocks"
            )
        token_ids = allocation.token_ids
        root = allocation.root_hash
        num_hit, hit_blocks, window_hits, last_hash = (
            self._hit(token_ids, root) if self.enable_prefix_caching else (0, [], [], root)
        )
        num_cached = num_hit * self.block_size
        num_new = allocation.num_new_tokens
        if token_ids:
            num_new = min(num_new, len(token_ids) - num_cached)
        num_fresh = math.ceil((num_cached + num_new) / self.block_size) - num_hit
        # A hit block no one holds leaves the free queue, so it costs one too.
        if num_fresh + sum(map(self._pool.hit_cost, hit_blocks)) > len(self._pool.free):
            return None, 0
        window = self._window_pool
        if window is not None and num_fresh + sum(map(window.hit_cost, window_hits)) > len(window.free):
            return None, 0
        for block_id in hit_blocks:
            self._pool.acquire(block_id)
        block_ids = hit_blocks + [self._pool.take() for _ in range(num_fresh)]
        window_ids = None
        if window is not None:
            for block_id in window_hits:
                window.acquire(block_id)
            window_ids = [NULL_BLOCK] * (num_hit - len(window_hits)) + window_hits
            window_ids += [window.take() for _ in range(num_fresh)]
        num_slid = 0 if window is None else num_hit - len(window_hits)
        self._holdings[allocation.request_id] = _Holding(block_ids, num_hit, last_hash, window_ids, num_slid)
        if self.enable_prefix_caching:
            self._queries += len(token_ids)
            self._hits += num_cached
        return tuple(block_ids), num_cached

    def _hit(self, token_ids: Sequence[int], root: int = _ROOT_HASH) -> tuple[int, list[int], list[int], int]:
        """The longest usable prefix-cache hit for ``token_ids``, chained
        from ``root``: its length in blocks, its full-group blocks, the
        window group's blocks of it that a window layer still reads (the
        hit's trailing ones), and the hash of its last block (``root``
        without a hit)."""
        # The last token is never served from the cache: computing it gives
        # the logits the next token is sampled from.
        num_full = max(0, len(token_ids) - 1) // self.block_size
        parent = root
        blocks: list[int] = []
        hashes: list[int] = []
        for i in range(num_full):
            block_hash = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self._pool.cached.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
            hashes.append(block_hash)
            parent = block_hash
        window = self._window_pool
        if window is None:
            return len(blocks), blocks, [], parent
        # The longest k whose window blocks first_seen(k) .. k - 1 are all cached.
        for k in range(len(blocks), 0, -1):
            first = self._first_seen_block(k * self.block_size)
            found = [window.cached.get(h) for h in hashes[first:k]]
            if all(b is not None for b in found):
                return k, blocks[:k], [b for b in found if b is not None], hashes[k - 1]
        return 0, [], [], root

    # -- checks ---------------------------------------------------------------

    def check_invariants(self, holders: Mapping[str, Sequence[int]]) -> None:
        """Check the pool against ``holders`` (request id -> block table).

        Raise ``AssertionError`` naming the block or request at fault if a
        block is leaked (neither held nor free), freed twice, or its ref count
        differs from the number of holders, or the cache index is
        inconsistent; with a window group, the same of its blocks, and each
        window table must be as long as its request's table.
        """
        mine = {rid: h.block_ids for rid, h in self._holdings.items()}
        for rid in sorted(set(mine) | set(holders)):
            theirs = list(holders.get(rid, ()))
            if mine.get(rid, []) != theirs:
                raise AssertionError(
                    f"request {rid!r}: the pool holds blocks {mine.get(rid, [])}, the caller says {theirs}"
                )
        self._pool.check(mine, "")
        if self._window_pool is None:
            return
        window_tables = {}
        for rid, holding in self._holdings.items():
            assert holding.window_ids is not None
            if len(holding.window_ids) != len(holding.block_ids):
                raise AssertionError(
                    f"request {rid!r} has {len(holding.window_ids)} window blocks for {len(holding.block_ids)} blocks"
                )
            slid, live = holding.window_ids[: holding.num_slid], holding.window_ids[holding.num_slid :]
            if any(b != NULL_BLOCK for b in slid) or NULL_BLOCK in live:
                raise AssertionError(
                    f"request {rid!r}'s window table {holding.window_ids} is not released blocks, then held ones"
                )
            window_tables[rid] = live
        self._window_pool.check(window_tables, "window ")
