"""``RequestStream``: the handle ``Engine.generate_nowait`` returns.

The request actor (request.py) behind an async iterator, closed by its
finalizer if its owner drops it unclosed.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from trioserve.engine.core.outputs import RequestOutput

from .request import RequestActor

log = logging.getLogger(__name__)


class RequestStream:
    """The output stream of a request queued by ``Engine.generate_nowait``.

    Iterate it (``async for``) and close it: ``async with`` or ``aclose()``,
    or iterate to the end. A cancel or error inside an iteration closes it,
    which aborts the request. A stream dropped unclosed is closed (its
    request aborted) by the event loop soon after it is collected.
    """

    def __init__(self, actor: RequestActor, token: trio.lowlevel.TrioToken) -> None:
        self._actor = actor
        self._token = token  # the engine's event loop, for the finalizer
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._actor.request_id

    @property
    def slo(self) -> Any:
        """SLO admission's ``SloDecision`` for the request, or None when it
        was not judged (no objectives, or not ``--scheduling-policy slo``)."""
        return self._actor.slo

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            output = await self._actor.receive()
        except BaseException:
            self.close()
            raise
        if output is None:
            self.close()
            raise StopAsyncIteration
        return output

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._actor.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A finalizer runs wherever the collector happens to run, even in
        # another thread or in the middle of trio's own bookkeeping, so it
        # touches no trio object: it hands the close (which sends the Abort)
        # to the event loop, as trio does to finalize async generators.
        if getattr(self, "_closed", True):
            return
        try:
            self._token.run_sync_soon(_close_dropped, self._actor)
        except trio.RunFinishedError:
            pass  # the event loop is gone, and the engine with it


def _close_dropped(actor: RequestActor) -> None:
    # Runs in the event loop's own task, where an exception would crash the
    # whole run: a bug here is logged instead.
    try:
        actor.close()
    except Exception:
        log.exception("closing the dropped stream of request %r failed", actor.request_id)
