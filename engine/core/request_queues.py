"""The scheduler's unfinished requests, by state, and the moves between them.

``waiting`` is kept in the order of the scheduler's key (its policy's, with
aging; lowest first), ``running`` in the order requests started, ``paused``
holds those out of scheduling until resumed. A request preempted by
recompute loses its blocks and computed tokens, keeps its output, and goes
back to waiting in key order.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import attrs

from trioserve.engine.core.sequence import Request, RequestStatus


@attrs.define
class RequestQueues:
    """Every unfinished request, in exactly one of ``waiting``,
    ``running`` and ``paused``; ``key`` orders the waiting."""

    key: Callable[[Request], tuple[float, ...]]
    requests: dict[str, Request] = attrs.field(init=False, factory=dict)  # by id
    waiting: list[Request] = attrs.field(init=False, factory=list)  # sorted by key
    running: list[Request] = attrs.field(init=False, factory=list)
    paused: dict[str, Request] = attrs.field(init=False, factory=dict)
    num_preemptions: int = attrs.field(init=False, default=0)  # since start
    _next_arrival: int = attrs.field(init=False, default=0)

    def add(self, request: Request) -> None:
        """A new request waits; its ``arrival_index`` is its order of admission."""
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=self.key)

    def resort(self) -> None:
        """Sort the waiting again: their keys moved on (aging)."""
        self.waiting.sort(key=self.key)

    def remove(self, request: Request) -> None:
        """The request finished: it leaves whichever queue held it."""
        del self.requests[request.request_id]
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            self.paused.pop(request.request_id, None)

    def start(self, request: Request) -> None:
        """A waiting request got its blocks: it runs."""
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING

    def preempt(self, request: Request) -> None:
        """Preempt a running request by recompute: back to waiting."""
        self.running.remove(request)
        self._reset_for_recompute(request)
        bisect.insort(self.waiting, request, key=self.key)

    def pause(self, request: Request) -> None:
        """Take a running (preempted by recompute) or waiting request out of scheduling."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._reset_for_recompute(request)
        else:
            self.waiting.remove(request)
        self.paused[request.request_id] = request

    def resume(self, request_id: str) -> bool:
        """A paused request waits again; False if it was not paused."""
        request = self.paused.pop(request_id, None)
        if request is None:
            return False
        bisect.insort(self.waiting, request, key=self.key)
        return True

    def _reset_for_recompute(self, request: Request) -> None:
        """A preempted request: no blocks, nothing computed, output kept."""
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.block_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1

    def check(self) -> None:
        """Raise ``AssertionError`` if the waiting are out of order or the
        queues do not hold exactly the unfinished requests."""
        if [self.key(r) for r in self.waiting] != sorted(self.key(r) for r in self.waiting):
            raise AssertionError("the waiting queue is out of (priority, arrival) order")
        queued = {r.request_id for r in self.running} | {r.request_id for r in self.waiting} | set(self.paused)
        if queued != set(self.requests):
            raise AssertionError("the running, waiting and paused requests are not exactly the unfinished ones")
