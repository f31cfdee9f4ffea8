"""Reading request bodies, bounded in size (``max_body_size``) and in time
(``body_timeout``).

A request's body is read whole before its handler runs. A body over the
size limit is not read on (413); a body still arriving when the time is up
is not waited for (408). Either way the response says ``Connection: close``
and hypercorn closes the connection after it, since the rest of the body
was never read.
"""

from __future__ import annotations

from typing import Any

import trio
from quart import g, request

from .errors import BodyTimeout, RequestTooLarge
from .json_body import parse_json_body


async def read_body(limit: int, timeout: float) -> None:
    """Read the body into ``g.body``; raise ``RequestTooLarge`` past
    ``limit`` bytes and ``BodyTimeout`` if it takes over ``timeout`` seconds."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise RequestTooLarge(declared, limit)
    chunks, size = [], 0
    try:
        with trio.fail_after(timeout):
            async for chunk in request.body:
                size += len(chunk)
                if size > limit:  # chunked, so no declared length: count as it comes
                    raise RequestTooLarge(size, limit)
                chunks.append(chunk)
    except trio.TooSlowError:
        raise BodyTimeout(timeout, size) from None
    g.body = b"".join(chunks)


def body_left_unread() -> bool:
    """Whether the request has a body that ``read_body`` did not finish."""
    has_body = bool(request.content_length) or "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    return has_body and g.get("body") is None


def request_json() -> dict[str, Any]:
    """The body (read by ``read_body``) as a JSON object."""
    return parse_json_body(g.body)
