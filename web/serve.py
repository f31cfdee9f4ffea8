"""Run an app made by ``create_app`` with hypercorn, in this
process, until SIGTERM or SIGINT.

Connections (web/connections.py, docs/api.md): at most ``max_connections``
are open (beyond, 503); a connection with no request under way closes after
``keep_alive_timeout``; a request body gets ``body_timeout`` to arrive
(web/body.py); a client that reads nothing for ``send_timeout`` is dropped.

Shutdown is graceful: at the first signal the listeners close (no new
connections), idle keep-alive connections close, the engines stop taking
requests (``/health`` and new requests answer 503) and in-flight requests
get ``shutdown_timeout`` seconds to finish before they are aborted; aborted
streams still end with their final chunk and ``data: [DONE]``. A second
signal aborts what is left at once.
"""

from __future__ import annotations

import functools
import logging
import signal
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Config
from quart_trio import QuartTrio

from .app import SHUTDOWN_MARGIN, app_host
from .connections import ConnectionLimits, default_max_connections, serve_connections
from .request_ids import ACCESS_LOG_FORMAT
from .scopes import cancel_after
from .settings import ServerConfig

log = logging.getLogger(__name__)

# Seconds connections get to send their last bytes once the engines have
# stopped, before the ones still open are closed.
CLOSE_GRACE = 1.0


def hypercorn_config(host: str, port: int, server: ServerConfig) -> Config:
    """Hypercorn settings for ``server``: its keep-alive timeout, no read
    timeout, and a graceful period long enough for the engines' drain."""
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    # Hypercorn cancels whatever connections are left this long after the
    # shutdown began; the drain ends every request before that.
    config.graceful_timeout = server.shutdown_timeout + SHUTDOWN_MARGIN
    # The idle timer runs whenever no request is under way: between
    # requests, and until a request's headers are complete.
    config.keep_alive_timeout = server.keep_alive_timeout
    # Hypercorn's read timeout bounds every read of a connection, also while
    # a response is under way, and a client sends nothing while it waits
    # for a completion or reads a stream: it would cut those. Bodies have
    # their own bound (body_timeout, web/body.py), headers the idle timer.
    config.read_timeout = None
    config.errorlog = logging.getLogger("hypercorn.error")
    if server.access_log:
        config.accesslog = logging.getLogger("hypercorn.access")
        config.access_log_format = ACCESS_LOG_FORMAT
    return config


def connection_limits(server: ServerConfig) -> ConnectionLimits:
    """The limits ``serve`` applies: ``server``'s, the connection cap
    worked out from this process's descriptor limit when not given."""
    return ConnectionLimits(
        max_connections=server.max_connections or default_max_connections(), send_timeout=server.send_timeout
    )


async def serve(
    app: QuartTrio,
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until ``shutdown_trigger`` returns, or the engines stop
    on their own (a model failed to load); then shut down gracefully.
    ``task_status.started`` gets the bound URLs."""
    host = app_host(app)

    async def trigger() -> None:
        async with trio.open_nursery() as nursery:
            for wait in (shutdown_trigger, host.wait_stopped):
                if wait is not None:
                    nursery.start_soon(cancel_after, wait, nursery.cancel_scope)
        # Stop the engines' admission together with the listeners, so the
        # drain's clock starts when accepting stops.
        host.begin_drain()

    async def run_server(task_status: trio.TaskStatus[list[str]]) -> None:
        limits = connection_limits(host.config)
        await serve_connections(app, config, limits, shutdown_trigger=trigger, task_status=task_status)
        nursery.cancel_scope.cancel()  # done: stop close_lingering

    async def close_lingering() -> None:
        # Once the engines have stopped, every request has had its last
        # output. A connection still open then is a client slow to send a
        # body or to read; it need not hold the exit for graceful_timeout.
        await host.wait_stopped()
        await trio.sleep(CLOSE_GRACE)
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close_lingering)
        task_status.started(await nursery.start(run_server))


async def serve_until_signal(
    app: QuartTrio, config: Config, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> None:
    """``serve`` until SIGTERM or SIGINT; a second signal aborts in-flight requests."""
    host = app_host(app)
    first_signal = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:

        async def watch_signals() -> None:
            async for signum in signals:
                name = signal.Signals(signum).name
                if not first_signal.is_set():
                    log.info("%s: draining, in-flight requests have %g s", name, host.config.shutdown_timeout)
                    first_signal.set()
                else:
                    log.info("%s again: aborting in-flight requests", name)
                    host.abort_all()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_signals)
            async with trio.open_nursery() as server:
                binds = await server.start(functools.partial(serve, app, config, shutdown_trigger=first_signal.wait))
                log.info(
                    "listening on %s for %s (at most %d connections)",
                    " ".join(binds),
                    ", ".join(host.config.model_names),
                    connection_limits(host.config).max_connections,
                )
                task_status.started(binds)
            nursery.cancel_scope.cancel()


def run(app: QuartTrio, *, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Serve ``app`` in this process until a signal; the exit status is 0
    after a clean shutdown and 1 if the engines failed."""
    config = hypercorn_config(host, port, app_host(app).config)
    trio.run(serve_until_signal, app, config)
    return 0 if app_host(app).error is None else 1
