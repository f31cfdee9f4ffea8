"""The deadlines of the requests the scheduler actor holds.

Two heaps of ``(time, order, route)``:

- a request's *deadline*: when it passes, the request is aborted with
  ``DEADLINE`` at the next step boundary;
- its *queue deadline* (arrival plus ``max_queue_time``): when it passes,
  the request is dropped with ``QueueTimeout`` if nothing has been computed
  for it yet, and left alone otherwise.

A heap cannot drop an entry cheaply, so a request that ends first leaves its
deadline entry behind, stale (its route is closed). Once half the heap is
stale it is rebuilt, so the heap, and the routes it keeps alive, stay
proportional to the requests in flight. Queue deadlines are short-lived
(``max_queue_time``) and are simply dropped when their time comes.
"""

from __future__ import annotations

import heapq
import itertools
import math
import attrs

from .route import Route

_Entry = tuple[float, int, Route]


@attrs.define
class Deadlines:
    """Deadline and queue-deadline heaps over routes; an entry counts only
    while its route is open (``route.closed`` is False)."""

    _heap: list[_Entry] = attrs.field(init=False, factory=list)
    _queue_heap: list[_Entry] = attrs.field(init=False, factory=list)
    _order: itertools.count[int] = attrs.field(init=False, factory=itertools.count)
    _stale: int = attrs.field(init=False, default=0)  # entries of _heap whose route is closed

    def add(self, route: Route, *, deadline: float | None, queue_deadline: float | None) -> None:
        """Watch ``route``'s deadline and queue deadline (trio time; None: none)."""
        if deadline is not None:
            heapq.heappush(self._heap, (deadline, next(self._order), route))
            route.has_deadline = True
        if queue_deadline is not None:
            heapq.heappush(self._queue_heap, (queue_deadline, next(self._order), route))

    def forget(self, route: Route) -> None:
        """``route`` has just been closed: its deadline entry, if any, is stale."""
        if not route.has_deadline:
            return
        self._stale += 1
        if self._stale * 2 > len(self._heap):
            self._heap = [entry for entry in self._heap if not entry[2].closed]
            heapq.heapify(self._heap)
            self._stale = 0

    def expired(self, now: float) -> list[Route]:
        """The open routes whose deadline is at or before ``now``; their
        entries are dropped."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            _, _, route = heapq.heappop(self._heap)
            if route.closed:
                self._stale -= 1
            else:
                route.has_deadline = False  # its entry is gone
                due.append(route)
        return due

    def queue_expired(self, now: float) -> list[Route]:
        """The open routes whose queue deadline is at or before ``now``;
        their entries are dropped."""
        due = []
        while self._queue_heap and self._queue_heap[0][0] <= now:
            _, _, route = heapq.heappop(self._queue_heap)
            if not route.closed:
                due.append(route)
        return due

    def next_time(self) -> float:
        """The earliest deadline or queue deadline held (stale entries
        included: waking for one costs a boundary, no more); inf if none."""
        times = [heap[0][0] for heap in (self._heap, self._queue_heap) if heap]
        return min(times, default=math.inf)

    def __len__(self) -> int:
        """Deadline entries, stale ones not yet swept included."""
        return len(self._heap)
