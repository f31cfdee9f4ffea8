"""Reading the fields of a decoded request body (json_body.py).

A missing field and JSON null are the same: the field's default. The
readers here check the fields that are the HTTP API's own (``stream``,
``model``, ...). The fields that become the engine's values
(``SamplingParams``, ``RequestInput``) go to them as JSON has them, and
their validators judge them; ``invalid`` states such an error as a 400
naming the body's field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trioserve.engine.errors import InvalidRequestError

from .errors import InvalidRequest


def boolean(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}", param=name)
    return value


def string(body: dict[str, Any], name: str, default: str | None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, got {value!r}", param=name)
    return value


# OpenAI's bounds on ``metadata`` (responses, batches): at most 16 pairs,
# keys of at most 64 characters, values strings of at most 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def metadata(value: Any) -> dict[str, str] | None:
    """``metadata`` as OpenAI bounds it (None when absent), else a 400 naming the field."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise InvalidRequest(f"metadata must be an object of at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise InvalidRequest(
                f"metadata.{key} must be a string of at most {MAX_METADATA_VALUE} characters under a key of at most "
                f"{MAX_METADATA_KEY}",
                param=f"metadata.{key}",
            )
    return value


def is_token_ids(value: Any) -> bool:
    """Whether ``value`` has the shape of token ids: a list of integers."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def token_ids(value: Any, name: str) -> tuple[int, ...]:
    if not is_token_ids(value) or any(t < 0 for t in value):
        raise InvalidRequest(f"{name} must be a list of non-negative integer token ids", param=name)
    return tuple(value)


def refuse_unsupported(body: dict[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    """A 400 if ``name`` is set to anything but one of ``allowed`` (a field we cannot honour)."""
    value = body.get(name)
    # By type too: 0 == False, but echo=0 is not the boolean this allows.
    if value is not None and not any(type(value) is type(ok) and value == ok for ok in allowed):
        raise InvalidRequest(f"{name} is not supported: {why}", param=name)


def invalid(exc: InvalidRequestError, names: Mapping[str, str] | None = None) -> InvalidRequest:
    """The engine's ``exc`` as a 400 whose ``param`` is the body's name for
    its field: ``names`` maps the engine's names to the body's where they
    differ (the chat API's ``top_logprobs`` is the engine's ``logprobs``),
    and the message then says the body's name too."""
    field = exc.field
    message = str(exc)
    name = (names or {}).get(field, field) if field is not None else None
    if name != field and field is not None and message.startswith(field):
        message = name + message[len(field) :]
    return InvalidRequest(message, param=name)
