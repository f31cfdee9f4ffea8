"""What the gRPC service needs of the server that hosts it.

The server (web/: its ``ModelHost``, plugins and error translation) sits
above rpc/: it makes the ``GrpcService`` and hands these in, and rpc/
imports nothing of it. Each protocol lists only what the handlers use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from trioserve.actors import Engine
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.plugins import RequestContext


class ClientError(Protocol):
    """An error as the client is told it: the HTTP status it maps from, the
    message, the field at fault (``param``), a stable ``code``, and
    ``headers`` (``Retry-After``)."""

    status: int
    message: str
    param: str | None
    code: str | None
    headers: Mapping[str, str]


# The error to answer for an exception of the engine, the actors or the host
# (the host's own errors, unknown model or not ready, already are).
Translate = Callable[[Exception], ClientError]


class ServedMetrics(Protocol):
    def forget(self, request_id: str) -> None:
        """The request has ended: drop what the metrics keep of it."""


class ServedModel(Protocol):
    name: str
    engine: Engine
    created: int
    metrics: ServedMetrics

    @property
    def max_model_len(self) -> int: ...

    def observe(self, output: RequestOutput, num_completions: int) -> None:
        """Feed one delta to the metrics."""


class Host(Protocol):
    """The served models and the server's lifecycle."""

    @property
    def models(self) -> Mapping[str, ServedModel]:
        """The served models by name, in the order they are served (once ready)."""

    def get(self, name: str | None) -> ServedModel:
        """The model ``name`` (None: the first); raises the host's error if
        there is no such model or the host is not ready."""

    def raise_unless_ready(self) -> None: ...

    async def wait_ready(self) -> None: ...

    async def wait_draining(self) -> None: ...

    async def wait_stopped(self) -> None: ...


class Plugins(Protocol):
    def postprocessed(self, stream: Any, context: RequestContext, n: int) -> Any:
        """``stream`` with the output post-processors applied."""


class NoPlugins:
    """No output post-processors."""

    def postprocessed(self, stream: Any, context: RequestContext, n: int) -> Any:
        return stream
