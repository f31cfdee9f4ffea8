"""The admission queue: requests waiting for the scheduler to take them.

Bounded by ``max_requests`` queued requests and, optionally, ``max_tokens``
queued prompt tokens. ``send`` waits for room under both bounds, first come
first served; ``send_nowait`` raises ``trio.WouldBlock`` when either is full
or others are already waiting. A prompt longer than ``max_tokens`` is let in
when the queue holds no tokens, so it waits but is never refused for good.

It is a deque rather than a memory channel because overload control takes
requests out of the middle: one displaced by a request of higher priority
(``displace_nowait``) and those whose queue time ran out (``remove_expired``)
leave before the scheduler takes them. ``receive`` hands a message over
without a checkpoint between taking it out and returning it, so a message is
always either in the queue or with the scheduler, never in between.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import trio

from .messages import AddRequest


class BoundedSenders:
    """The senders' side of an admission bound of ``max_requests`` queued
    requests and, optionally, ``max_tokens`` queued prompt tokens: waiting
    for room first come first served, and the figures of the bound.

    A subclass keeps the queue: it says how much is queued
    (``num_queued``, ``num_queued_tokens``), puts a message in (``_put``),
    checks it may (``_check_open``), says when waiting must stop
    (``_stopped``), and unparks ``_room`` whenever room may have been made.
    """

    def __init__(self, max_requests: int, max_tokens: int | None) -> None:
        if max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._fifo = trio.Lock()  # senders waiting for room, in order; the holder waits on _room
        self._room = trio.lowlevel.ParkingLot()
        self._closed = False  # no more sends

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the admission queue is closed")

    def _stopped(self) -> bool:
        """Waiting for room is over: the caller's ``_put`` raises why."""
        return self._closed

    def _fits(self, num_tokens: int) -> bool:
        if self.num_queued >= self.max_requests:
            return False
        tokens = self.num_queued_tokens
        return self.max_tokens is None or tokens == 0 or tokens + num_tokens <= self.max_tokens

    async def send(self, message: AddRequest) -> None:
        """Queue ``message`` once there is room under both bounds and every
        sender that came first has queued."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self.send_nowait(message)  # room, and nobody waiting before us
        except trio.WouldBlock:
            pass
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        async with self._fifo:
            while not self._stopped() and not self._fits(message.num_tokens):
                await self._room.park()
            self._put(message)

    def send_nowait(self, message: AddRequest) -> None:
        """Queue ``message`` now, or raise ``trio.WouldBlock`` when a bound is
        full or other senders are already waiting."""
        self._check_open()
        if self._fifo.locked() or not self._fits(message.num_tokens):
            raise trio.WouldBlock
        self._put(message)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_waiting_to_send(self) -> int:
        # The lock's holder waits for room; the others wait for the lock.
        return self._fifo.statistics().tasks_waiting + (1 if self._fifo.locked() else 0)

    @property
    def pressure(self) -> float:
        """How full the queue is, in [0, 1]: the larger of its request and
        token fills, and 1 while callers wait for room (the degradation
        policy's measure, see ``DegradationPolicy``)."""
        if self._fifo.locked():
            return 1.0
        fill = self.num_queued / self.max_requests
        if self.max_tokens is not None:
            fill = max(fill, self.num_queued_tokens / self.max_tokens)
        return min(1.0, fill)


class AdmissionQueue(BoundedSenders):
    """Requests queued for the scheduler (one receiver: its admission loop)."""

    def __init__(
        self, max_requests: int, max_tokens: int | None = None, *, on_room: Callable[[], None] | None = None
    ) -> None:
        super().__init__(max_requests, max_tokens)
        self._queue: collections.deque[AddRequest] = collections.deque()
        self._items = trio.lowlevel.ParkingLot()  # the receiver, waiting for a message
        self._tokens = 0
        self._receiver_closed = False
        # Called whenever room may have been made (a take, the receiver
        # closing): the replicated queue in front of several (replicas.py)
        # wakes its own waiting senders with it.
        self._on_room = on_room
        # The order the receiver takes requests in: None, first come first
        # served; else the least ``order(message)`` first, the earliest among
        # equals. The slo policy's scheduler sets it to its own order
        # (actors/slo_admission.py), so a tight deadline is not stuck behind
        # loose ones before the core even sees it.
        self.order: Callable[[AddRequest], tuple[float, ...]] | None = None
        # Called after every message queued: the slo policy's scheduler,
        # holding its bound of requests, looks then whether the queue's head
        # is one to take past it (actors/scheduler.py, ``max_urgent``).
        self.on_put: Callable[[], None] | None = None

    def _check_open(self) -> None:
        super()._check_open()
        if self._receiver_closed:
            raise trio.BrokenResourceError("the scheduler has stopped taking requests")

    def _stopped(self) -> bool:
        return self._closed or self._receiver_closed

    # -- senders ----------------------------------------------------------------

    def displace_nowait(self, message: AddRequest) -> AddRequest:
        """Queue ``message`` in place of the queued request of the lowest
        priority (the highest ``priority`` value; the latest among equals),
        if that priority is strictly lower than ``message``'s and taking it
        out makes room. Return the displaced request: its output channel is
        the caller's to end. Raise ``trio.WouldBlock`` otherwise."""
        self._check_open()
        victim = self.lowest_priority()
        if victim is None or victim.priority <= message.priority:
            raise trio.WouldBlock
        tokens = self._tokens - victim.num_tokens
        if self.max_tokens is not None and tokens and tokens + message.num_tokens > self.max_tokens:
            raise trio.WouldBlock
        self._queue.remove(victim)
        self._tokens -= victim.num_tokens
        self._put(message)
        return victim

    def lowest_priority(self) -> AddRequest | None:
        """The queued request ``displace_nowait`` would take out: the lowest
        priority (the highest ``priority`` value), the latest among equals."""
        if not self._queue:
            return None
        return max(reversed(self._queue), key=lambda queued: queued.priority)

    def _put(self, message: AddRequest) -> None:
        self._check_open()
        self._queue.append(message)
        self._tokens += message.num_tokens
        self._items.unpark_all()
        if self.on_put is not None:
            self.on_put()

    # -- the receiver -------------------------------------------------------------

    async def receive(self) -> AddRequest:
        await trio.lowlevel.checkpoint()
        while not self._queue:
            if self._receiver_closed:
                raise trio.ClosedResourceError("the admission queue's receiver is closed")
            if self._closed:
                raise trio.EndOfChannel
            await self._items.park()
        return self._take(self._pop())

    def receive_nowait(self) -> AddRequest:
        if self._queue:
            return self._take(self._pop())
        if self._receiver_closed:
            raise trio.ClosedResourceError("the admission queue's receiver is closed")
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    def peek(self) -> AddRequest | None:
        """The message ``receive`` would hand over next (None: none queued)."""
        if not self._queue:
            return None
        if self.order is None:
            return self._queue[0]
        return min(self._queue, key=self.order)  # the first of equals

    def _pop(self) -> AddRequest:
        best = self.peek()
        assert best is not None
        if self.order is None:
            return self._queue.popleft()
        self._queue.remove(best)
        return best

    def remove_expired(self, now: float) -> list[AddRequest]:
        """Take out every queued request whose ``queue_deadline`` has passed;
        their output channels are the caller's to end."""
        expired = [m for m in self._queue if m.queue_deadline is not None and m.queue_deadline <= now]
        for message in expired:
            self._queue.remove(message)
            self._take(message)
        return expired

    def next_queue_deadline(self) -> float | None:
        """The earliest ``queue_deadline`` of a queued request."""
        return min((m.queue_deadline for m in self._queue if m.queue_deadline is not None), default=None)

    def _take(self, message: AddRequest) -> AddRequest:
        self._tokens -= message.num_tokens
        self._room.unpark_all()
        if self._on_room is not None:
            self._on_room()
        return message

    # -- closing ----------------------------------------------------------------

    def close(self) -> None:
        """Stop admission: waiting and later senders get ``ClosedResourceError``;
        the receiver takes what is queued, then ``EndOfChannel``."""
        self._closed = True
        self._room.unpark_all()
        self._items.unpark_all()

    def close_receiver(self) -> None:
        """The scheduler is gone: close the output channel of every request
        still queued (its reader gets ``EngineClosed`` rather than waiting
        forever); senders get ``BrokenResourceError`` from now on."""
        self._receiver_closed = True
        while self._queue:
            self._take(self._queue.popleft()).outputs.close()
        self._room.unpark_all()
        if self._on_room is not None:
            self._on_room()
        self._items.unpark_all()

    # -- figures ----------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def queued(self) -> tuple[AddRequest, ...]:
        """The queued messages, oldest first (a copy: SLO admission reads
        them to predict a new request's wait)."""
        return tuple(self._queue)

    @property
    def num_queued_tokens(self) -> int:
        return self._tokens

    @property
    def receiver_parked(self) -> bool:
        """The receiver waits in ``receive`` for a message."""
        return self._items.statistics().tasks_waiting > 0
