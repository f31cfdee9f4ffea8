"""The bridge between grpcio's asyncio server and the engine's trio loop.

grpcio's servers run on asyncio (``grpc.aio``) or on a thread pool; the
engine's API (``Engine.generate_nowait``, its ``RequestStream``) must be
called from the trio loop. The gRPC server runs ``grpc.aio`` on an asyncio
loop in a thread of its own (``service.py``); its handlers use a
``TrioPortal`` to run work as trio tasks in the service's nursery:

- ``run(fn, *args)`` awaits one result (a unary call);
- ``iterate(produce, *args)`` streams items: ``produce(emit, *args)`` runs
  in trio and ``await emit(item)``s each one; at most ``window`` items wait
  unread, so a client that reads slowly holds up ``produce`` (and so the
  request's output channel, which pauses it in the engine).

Cancelling the asyncio side (the client cancelled, or its deadline passed)
cancels the trio task, so a stream's ``finally`` closes the request and
the engine aborts it and frees its blocks. Neither side blocks the other's
loop: every hop is ``TrioToken.run_sync_soon`` or
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import outcome
import trio

log = logging.getLogger(__name__)

# Items a stream may have posted but not yet handed to gRPC.
DEFAULT_WINDOW = 16


class PortalClosed(Exception):
    """The trio side stopped (the server is shutting down) before answering."""


Emit = Callable[[Any], Awaitable[None]]

_END = object()


@attrs.define(eq=False)
class TrioPortal:
    """Runs work in ``nursery``'s trio loop for code on another thread's asyncio loop."""

    token: trio.lowlevel.TrioToken
    nursery: trio.Nursery
    window: int = DEFAULT_WINDOW

    def _soon(self, fn: Callable[..., object], *args: object) -> None:
        try:
            self.token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass  # trio is gone: nothing left to cancel or release

    async def run(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``await fn(*args)`` in trio; its result or exception here.
        Cancelling this call cancels the trio task."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[outcome.Outcome] = loop.create_future()
        scope = trio.CancelScope()

        def settle(result: outcome.Outcome) -> None:
            if not future.done():
                future.set_result(result)

        async def task() -> None:
            result: outcome.Outcome = outcome.Error(PortalClosed("the server is shutting down"))
            try:
                with scope:
                    result = outcome.Value(await fn(*args))
            except Exception as exc:
                result = outcome.Error(exc)
            finally:
                _post(loop, settle, result)

        self._soon(self.nursery.start_soon, task)
        try:
            result = await future
        except asyncio.CancelledError:
            self._soon(scope.cancel)
            raise
        return result.unwrap()

    async def iterate(self, produce: Callable[..., Awaitable[None]], *args: Any) -> AsyncIterator[Any]:
        """The items ``produce(emit, *args)`` emits in trio, in order; an
        exception it raises is raised here after the items before it.
        Leaving the loop (or a cancel) cancels ``produce``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[Any, Any]] = asyncio.Queue()
        scope = trio.CancelScope()
        credits = trio.Semaphore(self.window)

        async def emit(item: Any) -> None:
            _post(loop, queue.put_nowait, (item, None))
            await credits.acquire()

        async def task() -> None:
            end: tuple[Any, Any] = (_END, PortalClosed("the server is shutting down"))
            try:
                with scope:
                    await produce(emit, *args)
                    end = (_END, None)
            except Exception as exc:
                end = (_END, exc)
            finally:
                _post(loop, queue.put_nowait, end)

        self._soon(self.nursery.start_soon, task)
        try:
            while True:
                item, error = await queue.get()
                if item is _END:
                    if error is not None:
                        raise error
                    return
                self._soon(credits.release)
                yield item
        finally:
            self._soon(scope.cancel)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the asyncio loop has closed: its call is gone already
