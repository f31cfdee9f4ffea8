"""Server-sent events: the framing of a streamed response.

Each chunk is one event, ``data: {json}\\n\\n``; ``SSE_DONE`` ends the
stream as OpenAI's do. An error once the stream has started (its status
already 200) is one more event holding the error's JSON body.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from .errors import ApiError

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(data: dict[str, Any]) -> bytes:
    """One server-sent event, ``data: {json}\\n\\n``; the JSON holds no newline."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace") + b"\n\n"


def sse_events(chunks: Iterable[dict[str, Any]]) -> bytes:
    """The events of ``chunks``, in order, as one write."""
    return b"".join(sse_event(chunk) for chunk in chunks)


def sse_error(error: ApiError) -> bytes:
    """An error inside an already started stream (the status is already 200)."""
    return sse_event(error.to_json())
