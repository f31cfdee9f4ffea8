"""``X-Request-Id``: one id per HTTP request, from the caller or made here.

Every response carries it. A caller's id is kept when it is 1 to 128
visible ASCII characters without ``/`` (the engine names the completions of
a request ``ID/INDEX``); anything else is replaced by a generated one, with a
log line saying why. The id is the engine's request id too, so the engine's
own log lines about the request name it; when a caller reuses an id that is
still in the engine, the engine's id becomes ``ID-xxxxxxxx`` and a log line
links the two.

The request's task carries the id in a context variable, so log lines
written while handling it can show it: ``RequestIdFilter`` on a handler sets
``record.request_id`` (``-`` outside a request), and ``trioserve serve``
puts it in its log format. Hypercorn's access log shows the response's
header (``ACCESS_LOG_FORMAT``).
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid
from typing import Any

from quart import Quart, Response, g, request

from trioserve.actors import Engine, RequestStream
from trioserve.actors.errors import DuplicateRequestError
from trioserve.engine.core.new_request import RequestInput

HEADER = "X-Request-Id"
MAX_LENGTH = 128
# Visible ASCII (0x21-0x7e) but "/" (0x2f).
_VALID = re.compile(rf"[\x21-\x2e\x30-\x7e]{{1,{MAX_LENGTH}}}")
# Hypercorn's access log line: its default fields, the time taken and the id.
ACCESS_LOG_FORMAT = '%(h)s "%(r)s" %(s)s %(b)s %(L)ss request_id=%({x-request-id}o)s'

# The id of the request the current task serves. A context variable is
# module state by nature: each request's task sees its own value (trio
# copies the context into every task it starts), and nothing else shares it.
CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("trioserve_request_id", default=None)

log = logging.getLogger(__name__)


def new_request_id() -> str:
    return uuid.uuid4().hex


def choose_request_id(given: str | None) -> tuple[str, str | None]:
    """The request's id, and why ``given`` was refused (None: it was kept or absent)."""
    if given is None:
        return new_request_id(), None
    if _VALID.fullmatch(given):
        return given, None
    if not given:
        why = "it is empty"
    elif len(given) > MAX_LENGTH:
        why = f"it is longer than {MAX_LENGTH} characters"
    else:
        why = "it may hold only visible ASCII characters other than '/'"
    return new_request_id(), why


async def assign_request_id() -> None:
    """``before_request``: choose the id; registered first, so even a refusal carries it."""
    given = request.headers.get(HEADER)
    request_id, refused = choose_request_id(given)
    g.request_id = request_id
    CURRENT.set(request_id)
    if refused is not None:
        log.info("ignored %s %r: %s; using %s", HEADER, given[:MAX_LENGTH], refused, request_id)


async def add_request_id_header(response: Response) -> Response:
    """``after_request``: the id on every response the app makes."""
    request_id = g.get("request_id")
    if request_id is not None:
        response.headers[HEADER] = request_id
    return response


def register(app: Quart) -> None:
    """Give every request of ``app`` its id; call before any other ``before_request``."""
    app.before_request(assign_request_id)
    app.after_request(add_request_id_header)


def submit_nowait(engine: Engine, request: RequestInput, **options: Any) -> RequestStream:
    """``engine.submit_nowait`` under the current request's id: the
    engine's request id is the HTTP one, or ``ID-xxxxxxxx`` when a request
    with that id is still in the engine."""
    request_id = g.get("request_id") or new_request_id()
    try:
        return engine.submit_nowait(request, request_id=request_id, **options)
    except DuplicateRequestError:
        alias = f"{request_id[: MAX_LENGTH - 9]}-{uuid.uuid4().hex[:8]}"
        log.info("request id %s is still in the engine; the engine calls this request %s", request_id, alias)
        return engine.submit_nowait(request, request_id=alias, **options)


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id``: the id of the request being handled where
    the record was made, or ``-``. Add it to a handler (a logger's filters do
    not see records from its children)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = CURRENT.get() or "-"
        return True
