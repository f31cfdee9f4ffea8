"""``GrpcService``: the gRPC server beside the HTTP one, for the app's life.

``create_app`` starts ``GrpcService.run`` in the app's serving nursery when
``ServerConfig.grpc_port`` is set. It runs grpcio's asyncio server on a
thread of its own (``grpc-server``) with the ``trioserve.v1.Generation``
service and the standard ``grpc.health.v1.Health`` service; the handlers
reach the engines through a ``TrioPortal`` whose tasks live in this
service's nursery.

Health follows the host: ``NOT_SERVING`` while the models load, ``SERVING``
once they serve, ``NOT_SERVING`` from the start of the drain on (for the
whole server, ``""``, and for ``trioserve.v1.Generation``). The server stops
once the engines have stopped: by then every request has had its final
output, and ``grace`` seconds let the last responses go out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import attrs
import grpc
import trio
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import trioserve_pb2 as pb
from . import trioserve_pb2_grpc as pb_grpc
from .host import Host, NoPlugins, Objectives, Plugins, Translate
from .portal import TrioPortal
from .servicer import GenerationServicer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# Seconds the responses still in flight get once the engines have stopped.
DEFAULT_GRACE = 1.0

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@attrs.frozen
class _Running:
    """What the asyncio thread hands to trio once its server listens."""

    port: int
    loop: asyncio.AbstractEventLoop
    stop: asyncio.Event
    health: Any  # grpc_health.aio.HealthServicer


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@attrs.define(eq=False)
class GrpcService:
    """The gRPC server for ``host``'s models, listening on ``address``
    (``host:port``; port 0 picks a free one, then ``port`` tells which).
    ``translate``, ``objectives``, ``plugins`` and ``max_request_time`` are the server's
    (``GenerationServicer``)."""

    host: Host
    address: str
    grace: float = DEFAULT_GRACE
    translate: Translate = attrs.field(kw_only=True)
    objectives: Objectives = attrs.field(kw_only=True)
    plugins: Plugins = attrs.field(factory=NoPlugins, kw_only=True)
    max_request_time: float | None = attrs.field(default=None, kw_only=True)
    port: int | None = attrs.field(default=None, init=False)
    _stopped: trio.Event = attrs.field(factory=trio.Event, init=False)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until the host's engines stop; ``task_status.started`` gets
        the bound port. A port that cannot be bound raises ``OSError``."""
        token = trio.lowlevel.current_trio_token()
        reported = trio.Event()
        result: list[_Running | BaseException] = []

        def report(value: _Running | BaseException) -> None:
            result.append(value)
            reported.set()

        try:
            async with trio.open_nursery() as rpcs:
                portal = TrioPortal(token, rpcs)
                thread = threading.Thread(
                    target=asyncio.run, args=(self._serve(portal, report),), name="grpc-server", daemon=True
                )
                thread.start()
                try:
                    await reported.wait()
                    running = result[0]
                    if isinstance(running, BaseException):
                        raise running
                    self.port = running.port
                    log.info("gRPC listening on %s (port %d)", self.address, running.port)
                    task_status.started(running.port)
                    await self._follow_health(running)
                finally:
                    with trio.CancelScope(shield=True):
                        await reported.wait()  # the thread always reports
                        if isinstance(result[0], _Running):
                            _call_soon(result[0].loop, result[0].stop.set)
                        await trio.to_thread.run_sync(thread.join)
                    rpcs.cancel_scope.cancel()  # handlers the server cut off
        finally:
            self._stopped.set()

    async def _follow_health(self, running: _Running) -> None:
        def publish(status: int) -> None:
            for name in ("", SERVICE_NAME):
                asyncio.run_coroutine_threadsafe(running.health.set(name, status), running.loop)

        try:
            await self.host.wait_ready()
        except Exception:
            pass  # loading failed: the host's log says why; health stays NOT_SERVING
        else:
            publish(_SERVING)
            await self.host.wait_draining()
            publish(_NOT_SERVING)
        await self.host.wait_stopped()

    async def _serve(self, portal: TrioPortal, report: Any) -> None:
        """The asyncio thread's main: serve until ``stop`` is set."""
        try:
            server = grpc.aio.server()
            health = grpc_health.aio.HealthServicer()
            for name in ("", SERVICE_NAME):
                await health.set(name, _NOT_SERVING)
            servicer = GenerationServicer(
                self.host,
                portal,
                translate=self.translate,
                objectives=self.objectives,
                plugins=self.plugins,
                max_request_time=self.max_request_time,
            )
            pb_grpc.add_GenerationServicer_to_server(servicer, server)
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            try:
                port = server.add_insecure_port(self.address)
            except RuntimeError as exc:  # grpcio's way of saying the bind failed
                raise OSError(f"gRPC cannot listen on {self.address}: {exc}") from None
            await server.start()
        except Exception as exc:
            _report(portal, report, exc)
            return
        stop = asyncio.Event()
        _report(portal, report, _Running(port, asyncio.get_running_loop(), stop, health))
        try:
            await stop.wait()
        finally:
            await health.enter_graceful_shutdown()
            await server.stop(self.grace)


def _report(portal: TrioPortal, report: Any, value: Any) -> None:
    try:
        portal.token.run_sync_soon(report, value)
    except trio.RunFinishedError:
        pass


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:
        pass  # that loop has ended already
