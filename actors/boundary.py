"""The scheduler actor's requests between steps.

``StepBoundary`` takes requests from the admission queue into the engine
core (``admit``, in the admission loop, which may run while a step does:
admitting only queues the request in the core) and collects the control
messages that arrive meanwhile (``put``: ``Abort``, ``Resume``,
``AbortAll``, and LoRA's ``LoadLora`` / ``UnloadLora``). ``apply``, called
by the step loop between steps, applies them, then the deadlines and queue
deadlines that have passed, then the pauses of readers that fell behind. A request dropped before any compute
gets its final outputs or its error through ``Delivery`` (delivery.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import trio

from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.core.sequence import FinishReason
from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.lora.adapter import LoraError

from .admission import AdmissionQueue
from .deadlines import Deadlines
from .deltas import final_output
from .delivery import Delivery, outcome_of
from .errors import QueueTimeout
from .messages import Abort, AbortAll, AddRequest, LoadLora, Resume, UnloadLora
from .quarantine import Quarantine
from .route import Route


@attrs.define(eq=False)
class StepBoundary:
    """Admission and control for the scheduler actor of ``core``.

    ``max_queue_time`` is the core's (None: off); ``retry_after()`` is what
    a request dropped for lack of room is told. ``receiving`` is set by the
    admission loop while it waits on the queue: an abort for a request
    still in transit from the queue is kept for when it arrives.
    """

    core: EngineCore
    admission: AdmissionQueue
    delivery: Delivery
    deadlines: Deadlines
    quarantine: Quarantine
    retry_after: Callable[[], float]
    receiving: bool = attrs.field(init=False, default=False)
    _control: list[Any] = attrs.field(init=False, factory=list)
    _pending_aborts: dict[str, FinishReason] = attrs.field(init=False, factory=dict)  # for requests still queued
    _abort_all: FinishReason | None = attrs.field(init=False, default=None)

    @property
    def max_queue_time(self) -> float | None:
        return self.core.config.max_queue_time

    def put(self, message: Abort | Resume | AbortAll | LoadLora | UnloadLora) -> None:
        """A control message, applied at the next step boundary."""
        self._control.append(message)

    # -- admission --------------------------------------------------------------

    def admit(self, message: AddRequest) -> bool:
        """Take ``message``'s request: into the core, or, if it was aborted,
        its deadline or queue deadline has passed, or its id is still held
        for a hung step, ended at once. True if it is in the core."""
        reason = self._pending_aborts.pop(message.request_id, None) or self._abort_all
        now = trio.current_time()
        if reason is None and message.deadline is not None and message.deadline <= now:
            reason = FinishReason.DEADLINE
        if not self.admission.num_queued:
            self._pending_aborts.clear()  # nothing else queued: the rest are stale
        route = self.delivery.open(message)
        if reason is None and message.queue_deadline is not None and message.queue_deadline <= now:
            self._queue_timeout(route)
            return False
        if reason is not None:
            # Dropped before any compute was spent on it.
            for index in range(message.params.n):
                final = final_output(
                    message.request_id, index, reason, num_prompt_tokens=message.num_tokens, arrival_time=message.arrival_time
                )
                self.delivery.send(route, final)
            self.delivery.close(route, outcome=outcome_of({reason}))
            return False
        new = message.request  # validated by the engine's edge: admitted as it is
        if self.quarantine and self.quarantine.holds(new.sequence_ids()):
            error = InvalidRequestError(
                f"request id {message.request_id!r} is still in use (its earlier request's step hung)",
                field="request_id",
            )
            self.delivery.fail(route, error)
            return False
        try:
            self.core.admit(new, arrival_time=message.arrival_time)
        except InvalidRequestError as exc:
            self.delivery.fail(route, exc)
            return False
        self.deadlines.add(route, deadline=message.deadline, queue_deadline=message.queue_deadline)
        return True

    # -- between steps ----------------------------------------------------------

    def apply(self) -> bool:
        """Apply the control messages, the deadlines and queue deadlines
        passed, and the pauses asked for. True if blocks were let go (the
        next batch must carry their frees)."""
        release = False
        routes = self.delivery.routes
        control, self._control = self._control, []
        for message in control:
            if isinstance(message, Abort):
                release |= self._abort(message.request_id, message.reason)
            elif isinstance(message, Resume):
                route = routes.get(message.request_id)
                if route is not None and route.pause_pending:
                    route.pause_pending = False
                elif route is not None and route.paused:
                    route.paused = False
                    self.core.resume(route.request_id)
            elif isinstance(message, AbortAll):
                self._abort_all = message.reason
                for request_id in list(routes):
                    release |= self._abort(request_id, message.reason)
            elif isinstance(message, LoadLora | UnloadLora):
                self._change_lora(message)
        for route in self.deadlines.expired(trio.current_time()):
            release |= self._abort(route.request_id, FinishReason.DEADLINE)
        if self.max_queue_time is not None:
            release |= self._expire_queue_deadlines()
        for route in routes.values():
            if route.pause_pending:
                route.pause_pending = False
                if self.core.pause(route.request_id):
                    route.paused = True
                    release = True
        return release

    def _change_lora(self, message: LoadLora | UnloadLora) -> None:
        """Load or unload an adapter now, between steps, and answer."""
        error: Exception | None = None
        try:
            if isinstance(message, LoadLora):
                self.core.load_lora(message.adapter)
            else:
                self.core.unload_lora(message.name)
        except LoraError as exc:
            error = exc
        try:
            message.reply.send_nowait(error)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # its caller went away; the change stands
        message.reply.close()

    def _expire_queue_deadlines(self) -> bool:
        """Drop the requests past their queue deadline that nothing has been
        computed for: those still in the admission queue, and those admitted
        but never scheduled. Requests that have run are left alone."""
        release = False
        now = trio.current_time()
        for message in self.admission.remove_expired(now):
            self._pending_aborts.pop(message.request_id, None)
            self._queue_timeout(self.delivery.open(message))
        for route in self.deadlines.queue_expired(now):
            if self.core.is_unscheduled(route.request_id):
                self._queue_timeout(route)
                self.core.abort(route.request_id, FinishReason.QUEUE_TIMEOUT)
                release = True
        return release

    def _queue_timeout(self, route: Route) -> None:
        assert self.max_queue_time is not None
        retry_after = self.retry_after()
        error = QueueTimeout(
            f"request {route.request_id!r} waited longer than max_queue_time ({self.max_queue_time:g} s) "
            f"before any compute and was dropped; retry in about {retry_after:.1f} s",
            request_id=route.request_id,
            retry_after=retry_after,
            num_prompt_tokens=route.num_prompt_tokens,
        )
        self.delivery.fail(route, error, outcome="queue_timeout")

    def _abort(self, request_id: str, reason: FinishReason) -> bool:
        """End ``request_id`` for ``reason``; True if blocks were let go."""
        route = self.delivery.routes.get(request_id)
        if route is None:
            # Still in the admission queue (or being handed to the admission
            # loop): drop it when it is taken. Otherwise it is stale.
            in_transit = self.receiving and not self.admission.receiver_parked
            if self.admission.num_queued or in_transit:
                self._pending_aborts[request_id] = reason
            return False
        if self.core.abort(request_id, reason):
            route.paused = False
            return True
        return False
