"""The callers' side of a replicated engine: one admission bound over every
replica's queue, routing each request into one of them, and the control
messages that follow a request to its replica (replicas.py puts them in
front of the replicas)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from .admission import AdmissionQueue, BoundedSenders
from .messages import Abort, AbortAll, AddRequest, Resume
from .router import ReplicaRouter

__all__ = ["ReplicaControl", "ReplicatedAdmission"]


class ReplicatedAdmission(BoundedSenders):
    """The admission queue of a replicated engine: the one bound over every
    replica's queue, and the routing of each request into one of them.

    The senders' side of ``AdmissionQueue`` (``send``, ``send_nowait``,
    ``displace_nowait``, ``close``, the figures). Each replica's scheduler
    receives from its own queue in ``queues``; a take there wakes the
    senders waiting here. A request that displaces a queued one (shedding)
    takes the displaced request's place in that replica's queue.
    """

    def __init__(
        self,
        max_requests: int,
        max_tokens: int | None,
        router: ReplicaRouter,
        kv_usage: Callable[[], Sequence[float]],
    ) -> None:
        super().__init__(max_requests, max_tokens)
        self._router = router
        self._kv_usage = kv_usage
        # Each queue may hold the whole bound: this object keeps their sum under it.
        self.queues = tuple(
            AdmissionQueue(max_requests, max_tokens, on_room=self._room.unpark_all)
            for _ in range(router.num_replicas)
        )

    def _put(self, message: AddRequest) -> None:
        self._check_open()
        replica, hashes = self._router.choose(message.prompt_token_ids, self._kv_usage(), message.predicted_ttfts)
        # Raises if that replica's scheduler is gone (BrokenResourceError).
        self.queues[replica].send_nowait(message)
        self._router.record(message.request_id, replica, hashes, self._router.cost(message.prompt_token_ids, message.params))

    def displace_nowait(self, message: AddRequest) -> AddRequest:
        """As ``AdmissionQueue.displace_nowait``, over every replica's queue:
        the victim is the lowest priority queued anywhere (the latest
        arrival among equals); ``message`` takes its place in its queue."""
        self._check_open()
        best: tuple[int, AddRequest] | None = None
        for index, queue in enumerate(self.queues):
            victim = queue.lowest_priority()
            if victim is not None and (
                best is None or (victim.priority, victim.arrival_time) > (best[1].priority, best[1].arrival_time)
            ):
                best = (index, victim)
        if best is None or best[1].priority <= message.priority:
            raise trio.WouldBlock
        index, victim = best
        tokens = self.num_queued_tokens - victim.num_tokens
        if self.max_tokens is not None and tokens and tokens + message.num_tokens > self.max_tokens:
            raise trio.WouldBlock
        taken = self.queues[index].displace_nowait(message)
        assert taken is victim
        self._router.release(victim.request_id)
        self._router.record(message.request_id, index, (), self._router.cost(message.prompt_token_ids, message.params))
        return victim

    def close(self) -> None:
        """Stop admission everywhere: waiting and later senders get
        ``ClosedResourceError``; each scheduler takes what its queue holds."""
        self._closed = True
        for queue in self.queues:
            queue.close()
        self._room.unpark_all()

    @property
    def num_queued(self) -> int:
        return sum(queue.num_queued for queue in self.queues)

    @property
    def num_queued_tokens(self) -> int:
        return sum(queue.num_queued_tokens for queue in self.queues)


@attrs.define(eq=False)
class ReplicaControl:
    """The control channel of a replicated engine: each message to the
    scheduler of the replica its request went to; ``AbortAll`` to all."""

    controls: Sequence[trio.MemorySendChannel[Any]]
    router: ReplicaRouter

    def send_nowait(self, message: Abort | Resume | AbortAll) -> None:
        if isinstance(message, AbortAll):
            full = False
            for control in self.controls:  # every replica, whatever one of them answers
                try:
                    control.send_nowait(message)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    pass  # that scheduler has stopped already
                except trio.WouldBlock:
                    full = True
            if full:
                raise trio.WouldBlock
            return
        replica = self.router.replica_of(message.request_id)
        # A request is routed when it is queued and released when its actor
        # closes, which sends nothing after: an unrouted id was never queued.
        if replica is not None:
            self.controls[replica].send_nowait(message)

    def close(self) -> None:
        for control in self.controls:
            control.close()
