"""The request actor: one per request, run by the task that reads the request.

It owns the request's output stream (the receive end of its output channel)
and its deadline, and it always tells the scheduler when the request ends
early: ``close()`` sends the one ``Abort`` with ``send_nowait``, so it works
in a ``finally`` under a cancelled scope.

Why the caller's task and not a task of its own: the caller bounds a request
with a cancel scope around its ``async for``. A task in the engine's nursery
would be out of that scope's reach, and a nursery opened per request inside
``generate`` would have to stay open across ``yield`` (which trio forbids in
async generators). Run in the caller's task, the caller's cancel scope *is*
the request's scope. The deadline is a cancel scope around each receive,
never around a ``yield``.

The reader coalesces: each time it runs it takes everything buffered and
merges it into one delta per completion. A reader that falls
``max_buffered_outputs`` behind finds a ``Paused`` marker where the
scheduler preempted its sequence; taking the marker sends ``Resume``.

``RequestStream`` (stream.py) is the handle ``Engine.generate_nowait``
returns: the request actor behind an async iterator.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import attrs
import trio

from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.core.new_request import NewRequest
from trioserve.engine.core.sequence import FinishReason

from .admission import AdmissionQueue
from .deltas import Delta, final_output
from .errors import EngineClosed, EngineOverloaded, QueueTimeout
from .messages import Abort, AddRequest, Failed, Paused, Resume

log = logging.getLogger(__name__)


def output_capacity(max_buffered_outputs: int, n: int) -> int:
    """The output channel's capacity: ``max_buffered_outputs`` deltas before
    the scheduler pauses the sequence, plus room that can never be exceeded
    after that: the ``Paused`` marker, the rest of the step being delivered
    when it was sent (up to ``n - 1`` outputs), one output per completion of
    the step in flight, one final output per completion and a ``Failed``
    marker."""
    return max_buffered_outputs + 3 * n + 1


class RequestActor:
    """One request (``request``, validated), from admission to its last output.

    ``submit()`` waits for room in the admission queue (bounded by the
    deadline and the queue deadline); ``submit_nowait()`` raises
    ``EngineOverloaded`` instead, unless ``on_full(message)`` finds it a
    place (by shedding a request of lower priority; it raises
    ``trio.WouldBlock`` if it cannot). ``queue_deadline`` (trio time) is when
    the request is dropped with ``QueueTimeout`` if nothing has been computed
    for it by then.
    ``receive()`` returns the next coalesced output, or None once every
    completion has finished. ``close()`` must follow, always; ``on_close``
    is called then.

    The request's id is in use while the actor is open or the engine still
    holds the request (``engine_holds``): until the scheduler lets a request
    go, it may still send outputs for it.
    """

    def __init__(
        self,
        request: NewRequest,
        *,
        deadline: float | None,
        final_only: bool,
        max_buffered_outputs: int,
        admission: AdmissionQueue,
        control: trio.MemorySendChannel[Any],
        retry_after: Callable[[], float],
        on_close: Callable[[RequestActor], None],
        queue_deadline: float | None = None,
        on_full: Callable[[AddRequest], None] | None = None,
    ) -> None:
        self.request = request
        self.request_id = request.request_id
        self.params = request.params
        self.deadline = deadline
        self.queue_deadline = queue_deadline
        self.final_only = final_only
        self.arrival_time = time.monotonic()
        # What SLO admission predicted and decided at the door (None: not
        # judged: no objectives, or not the slo policy); the engine sets it.
        self.slo: Any = None
        self._on_full = on_full
        self._admission = admission
        self._control = control
        self._retry_after = retry_after
        self._on_close = on_close
        capacity = output_capacity(max_buffered_outputs, request.params.n)
        self._outputs_send, self._inbox = trio.open_memory_channel[Any](capacity)
        self._submitted = False
        self._submit_scope: trio.CancelScope | None = None
        self._abort_requested = False
        self._abort_sent = False
        self._ended = False  # the reader has its last output
        self._engine_done = False  # the scheduler has forgotten the request
        self._closed = False
        # Why it ended while waiting for room in the queue, if it did.
        self.unqueued_reason: FinishReason | None = None
        self._done: set[int] = set()  # completions over, by the engine or on this side
        self._engine_finished: set[int] = set()  # completions whose final output the engine sent
        self._deltas: dict[int, Delta] = {}
        self._last: dict[int, RequestOutput] = {}
        self._ready: collections.deque[RequestOutput] = collections.deque()

    # -- admission ------------------------------------------------------------

    def _message(self) -> AddRequest:
        return AddRequest(
            request=self.request,
            deadline=self.deadline,
            arrival_time=self.arrival_time,
            outputs=self._outputs_send,
            queue_deadline=self.queue_deadline,
            predicted_ttfts=() if self.slo is None else self.slo.replica_ttfts,
        )

    async def submit(self) -> None:
        """Queue the request, waiting for room; a passed deadline or
        ``abort()`` while waiting ends it without the engine, and a passed
        queue deadline raises ``QueueTimeout``."""
        if not self._abort_requested:
            deadline = min(d for d in (self.deadline, self.queue_deadline, math.inf) if d is not None)
            with trio.CancelScope(deadline=deadline) as scope:
                self._submit_scope = scope
                try:
                    await self._admission.send(self._message())
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    raise EngineClosed("the engine is not taking requests") from None
                except BaseException:
                    self.unqueued_reason = FinishReason.ABORT  # cancelled while waiting for room
                    raise
                finally:
                    self._submit_scope = None
                self._submitted = True
        if not self._submitted:
            if self._abort_requested:
                self.unqueued_reason = FinishReason.ABORT
            elif self.deadline is None or (self.queue_deadline is not None and self.queue_deadline < self.deadline):
                self.unqueued_reason = FinishReason.QUEUE_TIMEOUT
                self._ended = self._engine_done = True
                raise self._queue_timeout()
            else:
                self.unqueued_reason = FinishReason.DEADLINE
            self._end_here(self.unqueued_reason)

    def _queue_timeout(self) -> QueueTimeout:
        """The error of this request dropped while waiting for room."""
        retry_after = self._retry_after()
        return QueueTimeout(
            f"request {self.request_id!r} waited for room in the admission queue longer than max_queue_time "
            f"and was dropped before any compute; retry in about {retry_after:.1f} s",
            request_id=self.request_id,
            retry_after=retry_after,
            num_prompt_tokens=self.request.num_tokens,
        )

    def submit_nowait(self) -> None:
        """Queue the request now or raise ``EngineOverloaded``."""
        message = self._message()
        try:
            try:
                self._admission.send_nowait(message)
            except trio.WouldBlock:
                if self._on_full is None:
                    raise
                self._on_full(message)
        except trio.WouldBlock:
            retry_after = self._retry_after()
            raise EngineOverloaded(
                f"the admission queue is full; retry in about {retry_after:.1f} s", retry_after=retry_after
            ) from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise EngineClosed("the engine is not taking requests") from None
        self._submitted = True

    # -- the stream -----------------------------------------------------------

    async def receive(self) -> RequestOutput | None:
        """The next output (a coalesced delta, or the cumulative final one
        with ``final_only``); None after the last."""
        while not self._ready:
            if self._ended:
                return None
            await self._read()
        return self._ready.popleft()

    async def _read(self) -> None:
        messages: list[Any] = []
        end_of_channel = False
        try:
            if self.deadline is None:
                messages.append(await self._inbox.receive())
            else:
                with trio.move_on_at(self.deadline):
                    messages.append(await self._inbox.receive())
        except trio.EndOfChannel:
            end_of_channel = True
        while not end_of_channel:  # take everything already buffered
            try:
                messages.append(self._inbox.receive_nowait())
            except trio.WouldBlock:
                break
            except trio.EndOfChannel:
                end_of_channel = True
        self._take(messages)
        if not self._ended and self.deadline is not None and trio.current_time() >= self.deadline:
            self._send_abort(FinishReason.DEADLINE)
            self._end_here(FinishReason.DEADLINE)
        if end_of_channel:
            self._engine_done = True
            if not self._ended:
                self._ended = True
                raise EngineClosed(f"the engine shut down before request {self.request_id!r} finished")
        self._publish()

    def _take(self, messages: list[Any]) -> None:
        for message in messages:
            if isinstance(message, RequestOutput):
                self._last[message.index] = message
                self._deltas.setdefault(message.index, Delta()).add(message)
                if message.finished:
                    self._done.add(message.index)
                    self._engine_finished.add(message.index)
            elif isinstance(message, Paused):
                self._send_control(Resume(self.request_id))
            elif isinstance(message, Failed):
                self._ended = self._engine_done = True
                self._deltas.clear()
                raise message.error
        if len(self._done) == self.params.n:
            self._ended = self._engine_done = True

    def _publish(self) -> None:
        if self.final_only and not self._ended:
            return
        for index in sorted(self._deltas) if self.final_only else list(self._deltas):
            self._ready.append(self._deltas[index].build())
        self._deltas.clear()

    def _end_here(self, reason: FinishReason) -> None:
        """Finish every open completion with ``reason`` on this side."""
        for index in range(self.params.n):
            if index in self._done:
                continue
            delta = self._deltas.get(index)
            if delta is not None and delta.last is not None:
                self._deltas[index].last = attrs.evolve(delta.last, finish_reason=reason, stop_reason=None)
            else:
                self._deltas[index] = Delta(
                    last=final_output(
                        self.request_id,
                        index,
                        reason,
                        num_prompt_tokens=self.request.num_tokens,
                        arrival_time=self.arrival_time,
                        last=self._last.get(index),
                    )
                )
            self._done.add(index)
        self._ended = True
        self._publish()

    # -- ending -----------------------------------------------------------------

    def abort(self) -> bool:
        """Ask the engine to end this request (``engine.abort``); the stream
        then ends with an ``ABORT`` final output. False if already over."""
        if self._ended or self._closed:
            return False
        if not self._submitted:
            self._abort_requested = True
            if self._submit_scope is not None:
                self._submit_scope.cancel()
            return True
        self._send_abort(FinishReason.ABORT)
        return True

    @property
    def submitted(self) -> bool:
        return self._submitted

    @property
    def engine_holds(self) -> bool:
        """After ``close()``: whether the engine still holds the request,
        that is, its output channel's send end is open (the request is in
        the admission queue, or the scheduler has it and closes the channel
        when it lets the request go)."""
        return self._inbox.statistics().open_send_channels > 0

    def close(self) -> None:
        """End the request on this side; sends the ``Abort`` unless the
        engine already finished it. Safe to call more than once.
        ``on_close(self)`` follows."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._submitted:
                self._outputs_send.close()
            elif not self._engine_done and not self._end_is_buffered():
                self._send_abort(FinishReason.DEADLINE if self.deadline_passed() else FinishReason.ABORT)
        finally:
            self._inbox.close()
            self._on_close(self)

    def deadline_passed(self) -> bool:
        return self.deadline is not None and trio.current_time() >= self.deadline

    def _end_is_buffered(self) -> bool:
        """Whether the engine's last word is already in the buffer (then the
        scheduler has forgotten the request and wants no abort). Completions
        ended on this side (a deadline) do not count: the engine still holds them."""
        done = set(self._engine_finished)
        while True:
            try:
                message = self._inbox.receive_nowait()
            except trio.WouldBlock:
                return False
            except trio.EndOfChannel:
                return True
            if isinstance(message, Failed):
                return True
            if isinstance(message, RequestOutput) and message.finished:
                done.add(message.index)
                if len(done) == self.params.n:
                    return True

    def _send_abort(self, reason: FinishReason) -> None:
        if not self._abort_sent:
            self._abort_sent = True
            self._send_control(Abort(self.request_id, reason))

    def _send_control(self, message: Abort | Resume) -> None:
        try:
            self._control.send_nowait(message)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the engine is gone, and the request with it
        except trio.WouldBlock:
            # Cannot happen (see docs/architecture.md: each request sends at
            # most one Abort and one Resume per Paused while the scheduler
            # holds it). Were it to, the scheduler still aborts a request
            # whose reader has closed at its next output.
            log.error("control channel full; %s for %r dropped", type(message).__name__, self.request_id)
