"""Errors the actor engine raises to its callers."""

from __future__ import annotations

from trioserve.engine.errors import InvalidRequestError, TrioserveError
from trioserve.engine.core.sequence import FinishReason


class EngineError(TrioserveError):
    """Base class of the actor engine's own errors."""


class EngineOverloaded(EngineError):
    """The admission queue is full (requests or tokens); nothing was queued.

    ``retry_after`` estimates, in seconds, when there will be room: the
    queue's length over the recent completion rate. The web layer answers
    429 with a ``Retry-After`` header from it.
    """

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineClosed(EngineError):
    """The engine does not take requests any more (drained or shut down),
    or shut down before this request finished."""


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is still in the engine."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in use", field="request_id")
        self.request_id = request_id


class RequestFailed(EngineError):
    """The request ended on a fault of the engine, not of the request: its
    model step raised or hung past the watchdog, the step thread died, or
    the detokenizer failed on its output. The request is over and its KV
    blocks are freed (after a hung step, once that step returns). Other
    requests are unaffected.

    ``code`` names the fault (``step_failed``, ``step_hung``,
    ``step_thread_died``, ``detokenizer_failed``); ``public_message`` says
    what happened without the inner error's text (which may hold file
    paths), for answers to clients. ``str()`` includes that text.
    """

    def __init__(
        self, message: str, *, request_id: str, code: str = "step_failed", public_message: str | None = None
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.code = code
        self.public_message = public_message or message


class StepHung(EngineError):
    """A model step did not return within the executor's watchdog timeout."""


class ExpensiveRequestRefused(EngineOverloaded):
    """Refused under pressure for asking for more than plain work: ``n > 1``
    or many top logprobs (see ``DegradationPolicy``); nothing was queued.
    ``field`` names the parameter at fault. The web layer answers 429."""

    def __init__(self, message: str, *, field: str, retry_after: float) -> None:
        super().__init__(message, retry_after=retry_after)
        self.field = field


class RequestDropped(EngineError):
    """The engine dropped this request under overload before computing
    anything for it: nothing was generated, so no output precedes this error.

    ``retry_after`` estimates, in seconds, when there will be room.
    ``finish_reason`` is what a response already started reports instead.
    """

    finish_reason: FinishReason

    def __init__(self, message: str, *, request_id: str, retry_after: float, num_prompt_tokens: int = 0) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.retry_after = retry_after
        self.num_prompt_tokens = num_prompt_tokens


class QueueTimeout(RequestDropped):
    """The request waited longer than ``max_queue_time`` (queued, or waiting
    to be scheduled) before any compute; the web layer answers 503."""

    finish_reason = FinishReason.QUEUE_TIMEOUT


class RequestShed(RequestDropped):
    """A request of higher priority took this one's place in the full
    admission queue; the web layer answers 429."""

    finish_reason = FinishReason.SHED


class WorkerLost(Exception):
    """The worker process that runs the model step died (or was killed for
    a hung step), and the KV cache it held went with it. A step failure the
    scheduler recovers from: every running request is preempted and
    recomputes its prompt and output on the restarted worker."""


class WorkerUnavailable(Exception):
    """The worker process is down for good: it died more often than
    ``max_worker_restarts`` within ``worker_restart_window``, or could not
    be started again. The steps' requests fail with it."""
