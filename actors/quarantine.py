"""The KV blocks of hung steps, held until each step returns.

A step declared hung (``StepFailed.released`` is set only for those) is
still running in an abandoned thread and may still write its sequences'
blocks, so they must not be reused before it returns: the scheduler actor
withholds their frees from the pool (``filter``) until ``released`` is set,
and refuses a new request whose sequence ids the pool would take for the
hung ones (``holds``).
"""

from __future__ import annotations

import attrs
import trio

from trioserve.engine.core.kv_batch import KVBatch
from trioserve.engine.core.scheduler import SchedulerOutput


@attrs.define(eq=False)
class _Held:
    """The sequences of one hung step: held until ``released`` is set."""

    released: trio.Event
    children: frozenset[str]  # sequence ids, as the pool knows them
    num_blocks: int


@attrs.define
class Quarantine:
    """The hung steps' sequences, and the frees withheld for them."""

    _held: list[_Held] = attrs.field(init=False, factory=list)
    _withheld: set[str] = attrs.field(init=False, factory=set)  # held ids whose free the pool has not had

    def __bool__(self) -> bool:
        """Whether anything is held or withheld (else ``filter`` is a no-op)."""
        return bool(self._held or self._withheld)

    def hold(self, plan: SchedulerOutput, released: trio.Event) -> None:
        """Hold the blocks of the hung step ``plan`` until ``released`` is set."""
        children = frozenset(c.request_id for c in plan.chunks)
        blocks = {block for c in plan.chunks for block in c.block_ids}
        self._held.append(_Held(released, children, len(blocks)))

    def filter(self, batch: KVBatch) -> KVBatch:
        """``batch`` with the frees of held sequences withheld, and the
        withheld frees of released ones added."""
        released = [h for h in self._held if h.released.is_set()]
        held: set[str] = set()
        for entry in self._held:
            if not entry.released.is_set():
                held |= entry.children
        self._held = [h for h in self._held if not h.released.is_set()]
        frees = []
        for request_id in batch.frees:
            if request_id in held:
                self._withheld.add(request_id)
            else:
                frees.append(request_id)
        for entry in released:
            frees.extend(sorted(entry.children & self._withheld))
            self._withheld -= entry.children
        return attrs.evolve(batch, frees=frees)

    def holds(self, ids: tuple[str, ...]) -> bool:
        """Whether one of these sequence ids is still held (the pool would
        take it for the hung sequence's holding)."""
        return any(i in self._withheld or any(i in h.children for h in self._held) for i in ids)

    @property
    def num_blocks(self) -> int:
        """Blocks held for hung steps (until their frees reach the pool)."""
        return sum(h.num_blocks for h in self._held)
