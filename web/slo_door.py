"""Latency objectives at every API's door (issue #44): the one sequence
that ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``,
``/v1/messages`` and gRPC's ``Generate`` (``GrpcObjectives``) take, so
that no surface keeps a copy of it.

Before the request is queued, its objectives are completed: the body's
own (checked by web/slo.py's ``body_objectives``: a bad value is a 400
naming the field), then the headers' (gRPC: the call's metadata), then
the server's defaults (``objectives``). Queueing it runs the decision
(actors/slo_admission.py): a refusal raises ``SloRefused``, which
web/errors.py's ``from_exception`` answers (429, or 503 while degraded,
with ``Retry-After``, the objective in ``param`` and by how much in the
message) and each surface tells in its API's error shape; ``refused``
counts it and marks it on the request's span. An admitted request gets
its ``SloReport`` (``admitted``): counted, marked on the span, and put in
the response's usage by the surface.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from trioserve.actors.slo_admission import SloRefused
from trioserve.engine.core.new_request import RequestInput

from . import tracing
from .served import ServedModel
from .slo import SloReport, body_objectives, slo_report, with_objectives

# Where a gRPC GenerateRequest caps its output: SamplingParameters' field.
GRPC_MAX_TOKENS = "params.max_tokens"


def objectives(served: ServedModel, new: RequestInput, headers: Mapping[str, str], model: str | None) -> RequestInput:
    """``new`` with its objectives completed from ``headers`` and the
    server's defaults for ``model`` (the name the request gave, else the
    served one) and its priority."""
    return with_objectives(new, headers, served.engine.config.slo_defaults, model or served.name)


def refused(served: ServedModel, priority: int, exc: BaseException, *, traced: bool = True) -> None:
    """Count (and, ``traced``, mark on the request's span) a request that
    the door refused for an objective; other exceptions pass unnoted."""
    if not isinstance(exc, SloRefused):
        return
    served.metrics.slo.refused(served.name, priority, exc.reason)
    if traced:
        tracing.slo_refused(exc)


def admitted(
    served: ServedModel, new: RequestInput, stream: Any, *, traced: bool = True, max_tokens_field: str = "max_tokens"
) -> SloReport | None:
    """The report of ``new``, queued as ``stream`` (read before any
    wrapper: its ``slo`` is the door's decision), counted and, ``traced``,
    marked on the request's span; None: it has no objectives.
    ``max_tokens_field``: the surface's name for the output cap a
    shortened admission lowers, which the report's reason names."""
    policy = served.engine.config.scheduling_policy
    report = slo_report(new.objectives, policy, stream.slo, max_tokens_field=max_tokens_field)
    if report is not None:
        served.metrics.slo.track(stream.request_id, served.name, new.priority, report)
        if traced:
            tracing.slo_decided(report)
    return report


@attrs.frozen
class GrpcObjectives:
    """The door for gRPC (rpc/host.py's ``Objectives``): rpc/ sits below
    web/ and imports nothing of it, so the server hands it this, as it
    hands ``translate``. No span: gRPC calls are not traced."""

    def given(self, new: RequestInput, fields: Mapping[str, Any]) -> RequestInput:
        """``new`` with the objectives the request's ``fields`` state (by
        their body names, unset ones left out): checked as a body's."""
        stated = body_objectives(fields)
        return new if stated is new.objectives else attrs.evolve(new, objectives=stated)

    def complete(self, served: Any, new: RequestInput, metadata: Mapping[str, str]) -> RequestInput:
        return objectives(served, new, metadata, None)

    def refused(self, served: Any, priority: int, exc: BaseException) -> None:
        refused(served, priority, exc, traced=False)

    def admitted(self, served: Any, new: RequestInput, stream: Any) -> SloReport | None:
        return admitted(served, new, stream, traced=False, max_tokens_field=GRPC_MAX_TOKENS)
