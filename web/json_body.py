"""Request bodies decoded: a JSON object in UTF-8, nested at most
``MAX_JSON_DEPTH`` levels, whose strings are all Unicode text.

What any body must be before its fields are read (protocol.py); each
refusal is a 400 that names the field it is in, when it is in one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import InvalidRequest

# OpenAI's request bodies nest a few levels (a chat message's content parts
# are four deep); a deeper body is refused before anything walks it.
MAX_JSON_DEPTH = 32

# A JSON escape of a UTF-16 surrogate (a pair is fine; a lone one is not).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def require_object(body: Any) -> dict[str, Any]:
    """``body`` if it is a JSON object (a dict), else a 400."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object in UTF-8, nested at
    most ``MAX_JSON_DEPTH`` levels, whose strings are all Unicode text."""
    try:
        # Strictly: json.loads(bytes) would let UTF-8-encoded surrogates
        # (b"\xed\xa0\x80") through, and accept UTF-16 and UTF-32 too.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        # json's parser guards its own recursion; past the interpreter's
        # limit it gives up cleanly, long before the stack is at risk.
        raise _too_deep(None) from None
    except ValueError:  # an integer of more digits than int() converts
        raise InvalidRequest("the request body holds a number too long to read") from None
    body = require_object(body)
    # Most bodies cannot break either rule; only the others are walked.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(text):
        _check_nesting_and_text(body)
    return body


def _too_deep(param: str | None) -> InvalidRequest:
    return InvalidRequest(f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep", param=param)


def _check_nesting_and_text(body: dict[str, Any]) -> None:
    """Refuse nesting past ``MAX_JSON_DEPTH`` and strings holding a lone
    UTF-16 surrogate (JSON's ``\\ud800`` escape): they are not text, and no
    tokenizer takes them. Iterative, so no depth can exhaust the stack."""
    pending: list[tuple[Any, str, int]] = [(body, "", 1)]
    while pending:
        value, path, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(path or None)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                if not _is_text(key):
                    where = _printable(f"{path}.{key}" if path else key)
                    raise InvalidRequest(
                        f"the field name {where} is not valid Unicode text: it holds a lone UTF-16 surrogate", param=where
                    )
                where = f"{path}.{key}" if path else key
            else:
                where = f"{path}[{key}]"
            if isinstance(item, dict | list):
                pending.append((item, where, depth + 1))
            elif isinstance(item, str) and not _is_text(item):
                where = _printable(where)
                raise InvalidRequest(f"{where} is not valid Unicode text: it holds a lone UTF-16 surrogate", param=where)


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
