"""The cache-allocator actor: serves the engine core's KV block pool.

The pool (``EngineCore.block_manager``, with its prefix cache) is the
core's, as it is offline; on the actors' path this actor is the only one
that applies batches to it. It serves one ``Allocate`` (a ``KVBatch``:
commits, frees and allocations with their prefix-cache lookups) per step
with one ``KVResult``: at most one round trip a step, however many sequences
the step touches. Nothing else changes the pool here (the actors never call
the core's in-process ``schedule`` or ``step``), so it needs no lock.
"""

from __future__ import annotations

from collections.abc import Mapping

import trio

from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.core.kv_batch import KVBudget, KVResult

from .messages import Allocate
from .statistics import AllocatorStatistics

# One batch in flight: the scheduler waits for the answer before the next.
INBOX_CAPACITY = 1


class AllocatorActor:
    """Serves ``Allocate`` messages from the scheduler against
    ``block_manager``, the core's pool: nothing else writes to it."""

    def __init__(self, block_manager: BlockManager) -> None:
        self._block_manager = block_manager
        self._num_batches = 0
        self._kv: KVBudget = block_manager.statistics()

    async def run(
        self,
        replies: trio.MemorySendChannel[KVResult],
        *,
        task_status: trio.TaskStatus[trio.MemorySendChannel[Allocate]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Answer each batch on ``replies``; return when the inbox's sender
        (the scheduler) closes it."""
        inbox_send, inbox = trio.open_memory_channel[Allocate](INBOX_CAPACITY)
        with inbox, replies:
            task_status.started(inbox_send)
            async for message in inbox:
                result = self._block_manager.apply(message.batch)
                self._num_batches += 1
                self._kv = result.budget
                await replies.send(result)

    def check_invariants(self, holders: Mapping[str, tuple[int, ...]]) -> None:
        """Raise ``AssertionError`` if the pool is inconsistent or its block
        tables differ from ``holders`` (the scheduler's mirror). For tests,
        between steps."""
        self._block_manager.check_invariants(holders)

    def statistics(self) -> AllocatorStatistics:
        """The pool as of the last batch; published by the actor, read
        without a round trip."""
        return AllocatorStatistics(kv=self._kv, num_batches=self._num_batches)
