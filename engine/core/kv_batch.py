"""The messages between the scheduler and the KV pool: one round trip a step.

The scheduler never calls the pool (``BlockManager``) method by method:
each step it sends one ``KVBatch`` and gets one ``KVResult`` back, from
``EngineCore.schedule`` in process or from the cache-allocator actor
(``trioserve.actors.allocator``), which serves the same pool. The pool
applies a batch in this order:

1. ``commits``: newly computed full blocks are hashed into the prefix cache.
   They go first so that a request freed in the same batch (finished,
   aborted or preempted) leaves all its computed blocks reusable.
2. ``frees``: each request's blocks are released, its last block first, so
   that among cached blocks a request's tail is evicted before its head.
3. ``forget_cache``: when set, the prefix cache forgets every block's
   content (the KV tensors it described are gone: their worker process
   died). After the frees, so a freed request's blocks are forgotten too,
   and before the allocations, so none is looked up.
4. ``allocations``, in the order given (the scheduler's priority order). One
   that does not fit gets ``None`` and takes nothing. After the first
   *admission* (a request holding no blocks) that does not fit, later
   admissions are refused too, so a large request at the head of the queue
   is not starved by smaller ones behind it.
"""

from __future__ import annotations

import attrs

from trioserve.engine.validators import non_negative, positive


@attrs.frozen
class KVCommit:
    """The token ids of a request's next full blocks, now computed.

    ``token_ids`` continues where the request's previous commit (or its
    prefix-cache hit) ended, and is a whole number of blocks long.
    """

    request_id: str
    token_ids: tuple[int, ...] = attrs.field(converter=tuple)


@attrs.frozen
class KVAllocation:
    """Make room for ``num_new_tokens`` more tokens of a request.

    A request holding blocks needs slots up to ``num_computed_tokens +
    num_new_tokens``. A request holding none (a new or preempted one, with
    ``num_computed_tokens == 0``) is first looked up in the prefix cache with
    ``token_ids``, all its tokens known so far; a hit of ``h`` tokens moves its
    start to ``h`` and it gets slots up to
    ``h + min(num_new_tokens, len(token_ids) - h)``. ``token_ids`` is empty
    for a request that already holds blocks, and for one that must not read
    the cache (it wants prompt logprobs): nothing is looked up then.
    ``root_hash`` is the parent hash of its first block: 0 for the base
    model, its adapter's for a LoRA request (``LoraRef.root_hash``), so
    blocks computed under different adapters never match.
    """

    request_id: str
    num_computed_tokens: int = attrs.field(validator=non_negative)
    num_new_tokens: int = attrs.field(validator=positive)
    token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    root_hash: int = 0


@attrs.frozen
class KVBatch:
    """Everything the scheduler asks of the pool for one step."""

    commits: tuple[KVCommit, ...] = attrs.field(default=(), converter=tuple)
    frees: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    allocations: tuple[KVAllocation, ...] = attrs.field(default=(), converter=tuple)
    forget_cache: bool = False


@attrs.frozen
class KVBudget:
    """A snapshot of the pool: what ``BlockManager.statistics()`` returns and
    every ``KVResult`` carries, and what the scheduler plans a step from.

    ``num_free_blocks`` counts every block no request holds, including those
    that still hold cached content and would be evicted to be reused. The
    prefix-cache counters are in tokens and cumulative.
    """

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int  # blocks, in use or free, whose content is in the prefix cache
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # of those, tokens found
    num_evictions: int  # cached blocks reused for other content
    num_window_blocks: int = 0  # the window group's blocks (its null block not counted)
    num_free_window_blocks: int = 0
    num_cached_window_blocks: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """The fraction of blocks held by some request."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_used_window_blocks(self) -> int:
        """The window group's blocks held by some request."""
        return self.num_window_blocks - self.num_free_window_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@attrs.frozen
class KVResult:
    """The pool's answer to a ``KVBatch``.

    ``block_tables[i]`` answers ``allocations[i]``: the request's whole block
    table after the allocation, or ``None`` when it did not fit.
    ``num_cached_tokens[i]`` is the prefix-cache hit found for a request that
    held no blocks (0 otherwise, and 0 when it did not fit).
    ``window_tables[i]``: with a window group, the request's table there
    (as long as its block table, the null block where released); empty
    without one.
    """

    block_tables: tuple[tuple[int, ...] | None, ...]
    num_cached_tokens: tuple[int, ...]
    budget: KVBudget
    window_tables: tuple[tuple[int, ...] | None, ...] = ()
