"""Running a batch's lines through the app's own handlers, in this process.

A line is not sent over HTTP to ourselves: ``dispatch`` builds the request
a client would have sent and hands it to quart's ``full_dispatch_request``,
so it runs the same hooks (request id, API key, body checks, plugins,
tracing) and the same handler as an interactive request, on the same
engine, and a refusal comes back in the API's own error shape with its
status.

Batch lines run at low priority: each line's ``priority`` is raised to the
engine's lowest class (``DegradationPolicy.low_priority``) if it asks for
more, so the scheduler runs interactive requests first and preempts batch
lines for them, admission sheds a queued batch line for a new interactive
request, and under pressure a batch line's ``max_tokens`` is capped as the
policy says. Each batch has at most ``max_in_flight`` lines in the engine
at once, so a batch never fills the admission queue by itself.

A line the engine turned away for load (429, or 503 ``queue_timeout``) is
tried again after its ``Retry-After``: it has not run. A 503 saying the
server is loading, draining or failed ends the run with ``ServerStopping``
and leaves the line unrecorded, for a restart to run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import trio
from quart_trio import QuartTrio

from .batch_lines import RequestLine, response_line
from .request_ids import HEADER, new_request_id

# Seconds to wait before trying a line the engine turned away for load
# again, when its answer gave no Retry-After.
DEFAULT_RETRY_AFTER = 1.0
# Codes of a 503 that say the request was dropped for load and may be tried again.
RETRYABLE_503 = frozenset({"queue_timeout"})


class ServerStopping(Exception):
    """The server stopped taking requests (loading, draining or failed):
    the line did not run, and the batch must wait for a restart."""


@attrs.frozen
class LineRunner:
    """How a batch's lines run: through ``app``'s handlers at ``priority``
    or lower, ``max_in_flight`` at a time, with ``api_key`` if the app
    wants one."""

    app: QuartTrio
    priority: int
    max_in_flight: int = attrs.field(validator=attrs.validators.ge(1))
    api_key: str | None = None

    async def run(self, lines: Iterable[RequestLine], record: Callable[[RequestLine, dict[str, Any]], None]) -> None:
        """Run ``lines``, ``max_in_flight`` at a time, calling ``record``
        with each line and its output line as it finishes."""
        pending = iter(lines)  # shared by the workers: next() never awaits

        async def worker() -> None:
            for line in pending:
                record(line, await self.run_line(line))

        async with trio.open_nursery() as nursery:
            for _ in range(self.max_in_flight):
                nursery.start_soon(worker)

    async def run_line(self, line: RequestLine) -> dict[str, Any]:
        """The output line of ``line``, tried again while the engine turns it away for load."""
        while True:
            request_id = new_request_id()
            status, headers, body = await self.dispatch(line, request_id)
            code = body.get("error", {}).get("code") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
            if status == 429 or (status == 503 and code in RETRYABLE_503):
                await trio.sleep(_retry_after(headers))
                continue
            if status == 503:
                raise ServerStopping(f"the server answered 503 ({code})")
            return response_line(line.custom_id, status, headers.get(HEADER, request_id), body)

    async def dispatch(self, line: RequestLine, request_id: str) -> tuple[int, dict[str, str], Any]:
        """The status, headers and JSON body the app answers ``line`` with."""
        body = dict(line.body)
        given = body.get("priority")
        # A priority of the wrong type is left for the handler to refuse.
        if given is None or (type(given) is int and given < self.priority):
            body["priority"] = self.priority
        headers = {"Content-Type": "application/json", HEADER: request_id}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        # quart's "test" request context is its plain request context over a
        # request made from these parts; nothing in it is for tests only.
        context = self.app.test_request_context(line.url, method="POST", headers=headers, data=data)
        async with context:
            response = await self.app.full_dispatch_request(context)
            raw = await response.get_data()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = raw.decode("utf-8", "replace")
        return response.status_code, dict(response.headers), answer


def _retry_after(headers: dict[str, str]) -> float:
    try:
        seconds = float(headers.get("Retry-After", DEFAULT_RETRY_AFTER))
    except ValueError:
        return DEFAULT_RETRY_AFTER
    return seconds if math.isfinite(seconds) and seconds > 0 else DEFAULT_RETRY_AFTER
