"""What the gRPC service needs of the server that hosts it.

The server (web/: its ``ModelHost``, plugins and error translation) sits
above rpc/: it makes the ``GrpcService`` and hands these in, and rpc/
imports nothing of it. Each protocol lists only what the handlers use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from trioserve.actors import Engine
from trioserve.engine.core.new_request import RequestInput
from trioserve.engine.core.outputs import RequestOutput, RequestTimes
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


class SloReport(Protocol):
    """What became of a request's latency objectives (web/slo.py's)."""

    def usage(self, times: RequestTimes | None, num_output_tokens: int) -> Mapping[str, Any]:
        """The report as the HTTP API's ``usage.slo`` states it."""


class Objectives(Protocol):
    """Latency objectives at the door, as the HTTP API takes them
    (web/slo_door.py's ``GrpcObjectives``): one validator, one set of
    defaults, one count of decisions for every API."""

    def given(self, new: RequestInput, fields: Mapping[str, Any]) -> RequestInput:
        """``new`` with the objectives ``fields`` state (the HTTP body's
        names: ``ttft_ms``, ``tpot_ms``, ``slo_mode``, ``slo_allow_shorter``);
        a bad value raises the 400 naming it."""

    def complete(self, served: ServedModel, new: RequestInput, metadata: Mapping[str, str]) -> RequestInput:
        """``new`` with the targets it leaves unset taken from the call's
        ``x-slo-*`` metadata, then the server's defaults."""

    def refused(self, served: ServedModel, priority: int, exc: BaseException) -> None:
        """Count a request the door refused (``exc``: any refusal)."""

    def admitted(self, served: ServedModel, new: RequestInput, stream: Any) -> SloReport | None:
        """The report of a queued request (None: no objectives), counted."""


class Plugins(Protocol):
    def postprocessed(self, stream: Any, context: RequestContext, n: int) -> Any:
        """``stream`` with the output post-processors applied."""


class NoPlugins:
    """No output post-processors."""

    def postprocessed(self, stream: Any, context: RequestContext, n: int) -> Any:
        return stream
