"""A batch's input lines, read and checked, and the lines it writes.

An input line is OpenAI's request line::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

``read_lines`` turns a file's bytes into ``RequestLine`` values and, for the
lines that cannot run, ``LineError`` values saying why and naming the field:
not JSON, not an object, no ``custom_id`` or one already used, a method
other than POST, a URL that is not one of the batch's endpoints, a body
that is not an object or asks to stream. The rest go on regardless. Blank
lines are skipped and not counted.

Each line leaves one output line, OpenAI's shape: ``response`` holds what
the endpoint answered (its status code, request id and JSON body) and
``error`` is null, or (a line that never ran) ``response`` is null and
``error`` says why, with the line's number.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection, Iterator
from typing import Any

import attrs

# The endpoints a line may call when the server serves them.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@attrs.frozen
class RequestLine:
    """A line that can run: its number in the file (from 1) and its request."""

    number: int
    custom_id: str
    url: str
    body: dict[str, Any]


@attrs.frozen
class LineError:
    """A line that cannot run, and why (``param``: the field at fault)."""

    number: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None

    def output_line(self) -> dict[str, Any]:
        """Its line in the batch's error file."""
        error = {"code": self.code, "message": self.message, "param": self.param, "line": self.number}
        return {"id": new_line_id(), "custom_id": self.custom_id, "response": None, "error": error}


def new_line_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def response_line(custom_id: str, status_code: int, request_id: str, body: Any) -> dict[str, Any]:
    """A line that ran: what its endpoint answered."""
    response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {"id": new_line_id(), "custom_id": custom_id, "response": response, "error": None}


def read_lines(data: bytes, endpoints: Collection[str]) -> Iterator[RequestLine | LineError]:
    """Each non-blank line of ``data`` as a ``RequestLine``, or a
    ``LineError`` if it cannot run; ``endpoints``: the URLs a line may call."""
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        yield _read_line(number, raw, endpoints, seen)


def _read_line(number: int, raw: bytes, endpoints: Collection[str], seen: set[str]) -> RequestLine | LineError:
    try:
        line = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return LineError(number, None, "invalid_json", f"line {number} is not UTF-8: {exc.reason} at byte {exc.start}")
    except ValueError as exc:  # JSONDecodeError, or a number too long to read
        return LineError(number, None, "invalid_json", f"line {number} is not valid JSON: {exc}")
    except RecursionError:
        return LineError(number, None, "invalid_json", f"line {number} nests too deep to read")
    if not isinstance(line, dict):
        return LineError(number, None, "invalid_request", f"line {number} must be a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(number, None, "invalid_custom_id", f"line {number}: custom_id must be a non-empty string", "custom_id")
    if custom_id in seen:
        return LineError(
            number, custom_id, "duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is used by an earlier line", "custom_id"
        )
    seen.add(custom_id)
    method = line.get("method")
    if method != "POST":
        return LineError(number, custom_id, "invalid_method", f"line {number}: method must be 'POST', got {method!r}", "method")
    url = line.get("url")
    if url not in endpoints:
        allowed = ", ".join(sorted(endpoints))
        return LineError(number, custom_id, "invalid_url", f"line {number}: url must be one of {allowed}; got {url!r}", "url")
    body = line.get("body")
    if not isinstance(body, dict):
        return LineError(number, custom_id, "invalid_body", f"line {number}: body must be a JSON object", "body")
    if body.get("stream"):
        return LineError(number, custom_id, "invalid_body", f"line {number}: a batch line cannot stream", "body.stream")
    return RequestLine(number, custom_id, url, body)
