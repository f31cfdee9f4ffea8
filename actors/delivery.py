"""Delivery: the scheduler actor's side of each request's output channel.

``Delivery`` owns the routes (route.py) of the requests the scheduler
holds. Every send is ``send_nowait`` and the channel's capacity
(``request.output_capacity``) makes it always succeed, so a reader that
stops reading never stalls the step loop: once
``max_buffered_outputs`` outputs sit unread, a ``Paused`` marker goes out and
the scheduler pauses the sequence at the next step boundary. Closing a route
closes the channel's send end, which ends the reader's stream and is how the
request's side learns that the engine has let go of it (its id is free
again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import trio

from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.core.sequence import FinishReason

from .deadlines import Deadlines
from .messages import AddRequest, Failed, Paused
from .route import Route
from .statistics import RateMeter

# How a request the scheduler held ended, as its statistics count them.
OUTCOMES = ("finished", "aborted", "deadline", "failed", "queue_timeout")


def outcome_of(reasons: set[FinishReason]) -> str:
    """The outcome of a request whose completions ended for ``reasons``."""
    if FinishReason.ERROR in reasons:
        return "failed"
    if FinishReason.DEADLINE in reasons:
        return "deadline"
    if FinishReason.ABORT in reasons:
        return "aborted"
    return "finished"


@attrs.define
class Delivery:
    """The routes of the requests the scheduler holds, and the count of how
    the others ended.

    ``max_buffered_outputs``: unread outputs before the ``Paused`` marker.
    ``deadlines``: told when a route closes (its entry goes stale).
    ``request_rate``: counts every request let go, queue timeouts aside (the
    completion rate behind ``retry_after``). ``on_close()`` is called
    whenever a route closes (the scheduler has room for one more).
    """

    max_buffered_outputs: int
    deadlines: Deadlines
    request_rate: RateMeter
    on_close: Callable[[], None] = lambda: None
    routes: dict[str, Route] = attrs.field(init=False, factory=dict)
    counts: dict[str, int] = attrs.field(init=False, factory=lambda: dict.fromkeys(OUTCOMES, 0))

    def open(self, message: AddRequest) -> Route:
        """Take the request of ``message`` (and its output channel)."""
        assert message.request_id not in self.routes, "request ids are reserved while the scheduler holds them"
        route = Route(message.request_id, message.outputs, message.params.n, message.num_tokens)
        self.routes[message.request_id] = route
        return route

    def deliver(self, outputs: list[RequestOutput]) -> list[str]:
        """Send each output to its request (those of requests let go are
        dropped), close each route whose completions have all finished, and
        send ``Paused`` to readers that fell ``max_buffered_outputs`` behind.
        Returns the ids of requests whose reader is gone without an abort
        having reached the scheduler (it raced the admission): to abort."""
        gone = []
        for output in outputs:
            route = self.routes.get(output.request_id)
            if route is None:
                continue
            self.send(route, output)
            if output.finish_reason is not None:
                route.reasons[output.index] = output.finish_reason
                if len(route.reasons) == route.num_completions:
                    self.close(route, outcome=outcome_of(set(route.reasons.values())))
                    continue
            if route.broken:
                gone.append(route.request_id)
            elif (
                not route.paused
                and not route.pause_pending
                and route.outputs.statistics().current_buffer_used >= self.max_buffered_outputs
            ):
                route.pause_pending = True
                self.send(route, Paused(route.request_id))
        return gone

    def send(self, route: Route, message: Any) -> None:
        if route.broken:
            return
        try:
            route.outputs.send_nowait(message)
        except trio.BrokenResourceError:
            route.broken = True
        # trio.WouldBlock cannot happen (request.output_capacity); if it did,
        # it is a bug and tears the engine down.

    def close(self, route: Route, *, outcome: str) -> None:
        """Let the request go: end its stream and count how it ended."""
        route.outputs.close()
        route.closed = True
        del self.routes[route.request_id]
        self.deadlines.forget(route)
        self.counts[outcome] += 1
        if outcome != "queue_timeout":
            # The rate behind Retry-After: requests served (or ended), not
            # those turned away for lack of room.
            self.request_rate.add(trio.current_time(), 1)
        self.on_close()

    def fail(self, route: Route, error: Exception, *, outcome: str = "failed") -> None:
        """End the request with ``error`` (its ``generate`` raises it)."""
        self.send(route, Failed(route.request_id, error))
        self.close(route, outcome=outcome)

    def close_all(self) -> None:
        """The scheduler is stopping: end every stream (the readers get
        ``EngineClosed``); nothing is counted."""
        for route in self.routes.values():
            route.outputs.close()
            route.closed = True
        self.routes.clear()
