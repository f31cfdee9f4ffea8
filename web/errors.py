"""Errors the HTTP API answers with, in OpenAI's JSON shape.

Every error a handler raises on purpose is an ``ApiError``; the app turns it
into ``status``, ``headers`` and ``to_json()``. ``from_exception`` translates
the engine's and the actors' exceptions at the boundary, so handlers never
format an error themselves.
"""

from __future__ import annotations

import logging
import math
import traceback
from typing import Any

from trioserve.actors.errors import (
    EngineClosed,
    EngineOverloaded,
    ExpensiveRequestRefused,
    QueueTimeout,
    RequestDropped,
    RequestShed,
)
from trioserve.actors.slo_admission import SloRefused
from trioserve.engine.errors import InvalidRequestError, RequestTooLongError
from trioserve.engine.plugins import PluginError


class ApiError(Exception):
    """An HTTP error answered as ``{"error": {"message", "type", "param", "code"}}``.

    ``param`` names the request field at fault (OpenAI's convention), ``code``
    is a stable machine-readable word, and ``headers`` holds extra response
    headers such as ``Retry-After``.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        fields = f"type={self.type!r}, param={self.param!r}, code={self.code!r}"
        return f"{type(self).__name__}({self.status}, {self.message!r}, {fields})"


class InvalidRequest(ApiError):
    """400: a field has the wrong type or value; ``param`` names it."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(400, message, type="invalid_request_error", param=param, code=code)


class AuthenticationError(ApiError):
    """401: the ``Authorization: Bearer`` key is missing or wrong."""

    def __init__(self, message: str = "invalid or missing API key; send it as 'Authorization: Bearer KEY'") -> None:
        super().__init__(
            401, message, type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )


class NotFoundError(ApiError):
    """404: an unknown model, or an unknown path."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(404, message, type="invalid_request_error", param=param, code=code)

    @classmethod
    def model(cls, name: str, served: list[str] | tuple[str, ...] = ()) -> NotFoundError:
        hint = f"; this server serves {', '.join(repr(s) for s in served)}" if served else ""
        return cls(f"the model {name!r} does not exist{hint}", param="model", code="model_not_found")


class RequestTooLarge(ApiError):
    """413: the request body exceeds the server's limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            413,
            f"request body of {size} bytes exceeds the limit of {limit} bytes",
            type="invalid_request_error",
            code="request_too_large",
        )


class BodyTimeout(ApiError):
    """408: the request body did not finish arriving in time; the
    connection is closed after this answer."""

    def __init__(self, timeout: float, received: int) -> None:
        super().__init__(
            408,
            f"the request body did not arrive within {timeout:g} s ({received} bytes came)",
            type="timeout_error",
            code="body_timeout",
        )


class Overloaded(ApiError):
    """429: admission is full (``code`` ``engine_overloaded``), or the
    degradation policy refused or shed the request (``expensive_request_refused``,
    ``request_shed``); ``Retry-After`` says when to try again."""

    def __init__(
        self, retry_after: float, message: str | None = None, *, code: str = "engine_overloaded", param: str | None = None
    ) -> None:
        # Retry-After takes whole seconds; round up so a client that obeys it
        # never comes back early, and never say 0 (a busy loop).
        seconds = max(1, math.ceil(retry_after))
        super().__init__(
            429,
            message or f"the engine is at capacity; retry after {seconds} s",
            type="rate_limit_error",
            param=param,
            code=code,
            headers={"Retry-After": str(seconds)},
        )
        self.retry_after = seconds


class ServiceUnavailable(ApiError):
    """503: the server is loading its model or draining for shutdown, a
    request waited past ``--max-queue-time`` (``queue_timeout``), or one was
    refused for a latency objective while degraded (``slo_unattainable``,
    ``param`` naming the objective)."""

    def __init__(self, message: str, *, code: str, retry_after: float | None = None, param: str | None = None) -> None:
        headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
        super().__init__(503, message, type="service_unavailable_error", param=param, code=code, headers=headers)

    @classmethod
    def draining(cls) -> ServiceUnavailable:
        return cls("the server is shutting down and accepts no new requests", code="draining")

    @classmethod
    def loading(cls, retry_after: float | None = None) -> ServiceUnavailable:
        return cls("the model is still loading", code="loading", retry_after=retry_after)

    @classmethod
    def too_many_connections(cls, limit: int) -> ServiceUnavailable:
        return cls(
            f"the server has its maximum of {limit} connections open; retry shortly",
            code="too_many_connections",
            retry_after=1.0,
        )


class RequestTimeout(ApiError):
    """504: a non-streaming request ran past its deadline.

    504 rather than 408: the time ran out on our side, while generating, and
    browsers silently resend a request answered with 408.
    """

    def __init__(self, timeout: float | None, num_output_tokens: int = 0) -> None:
        limit = f"its deadline of {timeout:g} s" if timeout is not None else "its deadline"
        super().__init__(
            504,
            f"the request ran past {limit} after generating {num_output_tokens} tokens",
            type="timeout_error",
            param="timeout",
            code="request_timeout",
        )


class InternalError(ApiError):
    """500: a bug or a failed model step; the message holds no traceback."""

    def __init__(self, message: str = "internal server error") -> None:
        super().__init__(500, message, type="server_error", code="internal_error")


def from_exception(exc: BaseException) -> ApiError:
    """The ``ApiError`` to answer for an exception raised by the engine or actors.

    Matched with ``isinstance``, most specific class first, so subclasses map
    like their bases. Anything unknown becomes a 500 naming only the
    exception class.
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PluginError):  # a plugin failed on this request (web/plugins.py)
        return ApiError(500, str(exc), type="server_error", code="plugin_error")
    if isinstance(exc, RequestTooLongError):
        # The engine's message states the limit (max_model_len or KV pool).
        return InvalidRequest(str(exc), param=exc.field or "prompt", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return InvalidRequest(str(exc), param=exc.field)
    if isinstance(exc, QueueTimeout):
        return ServiceUnavailable(str(exc), code="queue_timeout", retry_after=_retry_after(exc))
    if isinstance(exc, RequestShed):
        return Overloaded(_retry_after(exc), str(exc), code="request_shed")
    if isinstance(exc, SloRefused):
        # Refused at the door for a latency objective (docs/reliability.md,
        # "Latency objectives"); 503 while the engine runs degraded. Either
        # way ``param`` names the objective, as a 400 names a bad field.
        if exc.degraded:
            return ServiceUnavailable(str(exc), code="slo_unattainable", retry_after=_retry_after(exc), param=exc.objective)
        return Overloaded(_retry_after(exc), str(exc), code="slo_unattainable", param=exc.objective)
    if isinstance(exc, ExpensiveRequestRefused):
        return Overloaded(_retry_after(exc), str(exc), code="expensive_request_refused", param=exc.field)
    if isinstance(exc, EngineOverloaded):
        return Overloaded(_retry_after(exc))
    if isinstance(exc, EngineClosed):
        return ServiceUnavailable.draining()
    return InternalError(f"internal server error ({type(exc).__name__})")


def _retry_after(exc: EngineOverloaded | RequestDropped) -> float:
    # An estimate of 0 would tell the client to come straight back.
    return float(exc.retry_after or 1.0)


def log_unexpected(logger: logging.Logger, what: str, exc: BaseException, *, with_message: bool) -> None:
    """Log an unexpected exception and its traceback under ``what``.

    An exception's message may quote the request (a bad prompt, say), and
    prompts are logged only with ``--log-requests``: unless
    ``with_message``, the message is left out and the class named instead.
    """
    if with_message:
        logger.error("%s", what, exc_info=exc)
        return
    frames = "".join(traceback.format_tb(exc.__traceback__)).rstrip()
    logger.error(
        "%s: %s (its message is logged with --log-requests)\nTraceback (most recent call last):\n%s",
        what,
        type(exc).__name__,
        frames,
    )
