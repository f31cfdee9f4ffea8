"""A request's timeout: the tightest of the body's ``timeout`` field, the
``X-Request-Timeout`` header and ``--max-request-time``, in seconds. It
becomes the engine's deadline (web/completions.py)."""

from __future__ import annotations

import math
from typing import Any

from .errors import InvalidRequest


def timeout_field(body: dict[str, Any]) -> float | None:
    """The body's ``timeout``: seconds, a number > 0 (None: not set)."""
    value = body.get("timeout")
    if value is None:
        return None
    try:
        seconds = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer past any float
        seconds = math.nan
    if not math.isfinite(seconds):
        raise InvalidRequest(f"timeout must be a number of seconds, got {value!r}", param="timeout")
    if seconds <= 0:
        raise InvalidRequest(f"timeout must be > 0, got {value}", param="timeout")
    return seconds


def parse_timeout_header(value: str | None) -> float | None:
    """The ``X-Request-Timeout`` header: seconds, a number > 0."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequest(f"X-Request-Timeout must be a number of seconds > 0, got {value!r}", param="timeout")
    return seconds


def effective_timeout(*timeouts: float | None) -> float | None:
    """The tightest of the given timeouts (body, header, ``--max-request-time``); None if none is set."""
    given = [t for t in timeouts if t is not None]
    return min(given) if given else None
