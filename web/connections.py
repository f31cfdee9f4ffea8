"""Serving connections: hypercorn's HTTP machinery under trioserve's own
accept loop, which caps the connections open and drops clients that stop
reading.

hypercorn's ``serve`` accepts every connection the kernel hands it, until
the process runs out of file descriptors and accepting fails for everyone.
Here the accept loop counts the connections open: past ``max_connections``
a new one is answered 503 at once (OpenAI's error JSON,
``Connection: close``) and closed, while those already open are served on.
Each admitted connection runs hypercorn's own ``TCPServer`` (HTTP/1.1 and
h2c, keep-alive and its idle timer, ``Connection: close``) over a
``ClientStream``, whose sends give up after ``send_timeout`` seconds:
hypercorn shields its sends from cancellation, so a client that reads
nothing would otherwise hold its connection, and the server's shutdown,
forever.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
from collections.abc import Awaitable, Callable

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app
from quart import Quart

from .errors import ServiceUnavailable
from .request_ids import new_request_id

log = logging.getLogger(__name__)

# The cap when none is given, and the file descriptors it leaves to the rest
# of the process (model files, worker threads, refusals in progress) when
# the process's limit is lower.
DEFAULT_MAX_CONNECTIONS = 2048
RESERVED_FILE_DESCRIPTORS = 256
# Connections being refused at once, at most; past that a new one is closed
# without an answer (each refusal holds a descriptor for up to a second).
MAX_REFUSING = 64
# Seconds a refusal waits for the client to read its 503 and hang up.
REFUSAL_TIMEOUT = 1.0
# accept() errors that mean "out of resources for now": wait, then go on.
_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
ACCEPT_RETRY_DELAY = 0.1


def default_max_connections() -> int:
    """``DEFAULT_MAX_CONNECTIONS``, lowered to leave
    ``RESERVED_FILE_DESCRIPTORS`` under the process's descriptor limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    return max(1, min(DEFAULT_MAX_CONNECTIONS, soft - RESERVED_FILE_DESCRIPTORS))


@attrs.frozen
class ConnectionLimits:
    """``max_connections`` open at once; ``send_timeout`` seconds for one
    send to a client to make progress."""

    max_connections: int
    send_timeout: float


@attrs.frozen
class ConnectionStatistics:
    """``open``: connections being served; ``refusing``: being answered 503;
    ``refused``: refused since the server started."""

    open: int
    refusing: int
    refused: int


@attrs.define
class ConnectionGate:
    """Counts the connections of one server against its limits."""

    limits: ConnectionLimits
    _open: int = 0
    _refusing: int = 0
    _refused: int = 0
    _at_cap_logged: bool = False

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(open=self._open, refusing=self._refusing, refused=self._refused)

    async def serve(
        self,
        listener: trio.SocketListener,
        handle: Callable[[trio.abc.HalfCloseableStream], Awaitable[None]],
        nursery: trio.Nursery,
    ) -> None:
        """Accept connections from ``listener`` forever: each admitted one is
        ``handle``d in ``nursery``, the others refused there."""
        refusal = _refusal_response(self.limits.max_connections)
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _RESOURCE_ERRNOS:
                    raise
                log.error("cannot accept connections: %s; retrying in %g s", os.strerror(exc.errno), ACCEPT_RETRY_DELAY)
                await trio.sleep(ACCEPT_RETRY_DELAY)
                continue
            if self._open < self.limits.max_connections:
                self._open += 1
                self._at_cap_logged = False
                nursery.start_soon(self._run, handle, stream)
                continue
            self._refused += 1
            if not self._at_cap_logged:
                log.warning("%d connections open, the maximum: refusing new ones with 503", self._open)
                self._at_cap_logged = True
            if self._refusing < MAX_REFUSING:
                self._refusing += 1
                nursery.start_soon(self._refuse, stream, refusal)
            else:
                await trio.aclose_forcefully(stream)

    async def _run(self, handle: Callable[[trio.abc.HalfCloseableStream], Awaitable[None]], stream: trio.SocketStream) -> None:
        try:
            # hypercorn takes the end of what a client sends as its going
            # away (the request under way, if any, is cancelled), but then
            # waits for the connection's idle timer before it lets go of
            # the socket: end the connection's handler at once instead.
            with trio.CancelScope() as scope:
                await handle(ClientStream(stream, self.limits.send_timeout, on_hang_up=scope.cancel))
        finally:
            await trio.aclose_forcefully(stream)  # a no-op if the handler closed it
            self._open -= 1

    async def _refuse(self, stream: trio.SocketStream, response: bytes) -> None:
        try:
            with trio.move_on_after(REFUSAL_TIMEOUT):
                await stream.send_all(response)
                await stream.send_eof()
                # Read what the client sends until it hangs up: closing with
                # its request unread would reset the connection, and the
                # reset can reach the client before the 503 is read.
                while await stream.receive_some(1 << 16):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client is gone already
        finally:
            await trio.aclose_forcefully(stream)
            self._refusing -= 1


def _refusal_response(limit: int) -> bytes:
    error = ServiceUnavailable.too_many_connections(limit)
    body = json.dumps(error.to_json(), separators=(",", ":")).encode()
    head = [
        "HTTP/1.1 503 Service Unavailable",
        "content-type: application/json",
        f"content-length: {len(body)}",
        *(f"{name.lower()}: {value}" for name, value in error.headers.items()),
        "connection: close",
        f"x-request-id: {new_request_id()}",  # every response carries one (web/request_ids.py)
    ]
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


class ClientStream(trio.abc.HalfCloseableStream):
    """A client's connection as the server reads and writes it: ``send_all``
    breaks the connection when it has not finished within ``send_timeout``
    seconds (the client reads nothing), and ``on_hang_up`` is called when
    the client's side ends (end of stream, or a reset)."""

    def __init__(
        self, stream: trio.SocketStream, send_timeout: float, *, on_hang_up: Callable[[], object] = lambda: None
    ) -> None:
        self._stream = stream
        self._send_timeout = send_timeout
        self._on_hang_up = on_hang_up
        self.socket = stream.socket  # hypercorn reads the addresses off it

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with trio.move_on_after(self._send_timeout) as scope:
            await self._stream.send_all(data)
        if scope.cancelled_caught:
            # Part of ``data`` may have gone: the stream cannot be used on.
            await trio.aclose_forcefully(self._stream)
            raise trio.BrokenResourceError(f"the client read nothing for {self._send_timeout:g} s")

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            data = await self._stream.receive_some(max_bytes)
        except trio.BrokenResourceError:
            self._on_hang_up()
            raise
        if not data:
            self._on_hang_up()
        return data

    async def aclose(self) -> None:
        await self._stream.aclose()


async def serve_connections(
    app: Quart,
    config: Config,
    limits: ConnectionLimits,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` as hypercorn's trio worker does, under ``limits``, until
    ``shutdown_trigger`` returns; ``task_status.started`` gets the bound URLs.

    Shutdown: the listeners close, idle connections close, and the others
    get ``config.graceful_timeout`` seconds to finish before they are
    cancelled; then the app's lifespan ends.
    """
    asgi = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: dict = {}
    lifespan = Lifespan(asgi, config, lifespan_state)
    context = WorkerContext(None)
    gate = ConnectionGate(limits)

    async def handle(stream: trio.abc.HalfCloseableStream) -> None:
        await TCPServer(asgi, config, context, ConnectionState(lifespan_state.copy()), stream)

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        sockets = config.create_sockets()
        if sockets.secure_sockets or sockets.quic_sockets:
            raise ValueError("trioserve serves plain HTTP only; put a TLS-terminating proxy in front")
        listeners, binds = [], []
        for sock in sockets.insecure_sockets:
            sock.listen(config.backlog)
            listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
            binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
        async with trio.open_nursery() as connections:
            try:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(gate.serve, listener, handle, connections)
                    task_status.started(binds)
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()
            finally:
                for listener in listeners:
                    await trio.aclose_forcefully(listener)
                await context.terminated.set()  # idle connections close now, busy ones after their response
                connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
