"""Reading request bodies, bounded by the server's ``max_body_size``.

Every request's body is read before anything answers it, refusals included:
hypercorn (0.18) loses a keep-alive connection whose response went out
before the request body was read, and the client's next request on it hangs.
A body over the limit is not read; its 413 says ``Connection: close``
instead, so the client does not reuse the connection.
"""

from __future__ import annotations

from typing import Any

from quart import g, request

from .errors import RequestTooLarge
from .protocol import parse_json_body


async def read_body(limit: int) -> None:
    """Read the body into ``g.body``; raise ``RequestTooLarge`` past ``limit`` bytes."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise RequestTooLarge(declared, limit)
    chunks, size = [], 0
    async for chunk in request.body:
        size += len(chunk)
        if size > limit:  # chunked, so no declared length: count as it comes
            raise RequestTooLarge(size, limit)
        chunks.append(chunk)
    g.body = b"".join(chunks)


def request_json() -> dict[str, Any]:
    """The body (read by ``read_body``) as a JSON object."""
    return parse_json_body(g.body)
