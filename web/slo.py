"""Latency objectives at the HTTP edge (issue #44; docs/api.md, "Latency
objectives").

A request states its targets with the body's extension fields
``ttft_ms`` / ``tpot_ms`` (milliseconds), ``slo_mode`` (``"enforced"``,
the default, or ``"best_effort"``) and ``slo_allow_shorter`` (a request
refused for its TPOT target may be served with a lower ``max_tokens``), or
with the headers ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` of the Gateway API
Inference Extension. The body wins over a header: it is the request's own
statement, and a header may have been set for every request by a proxy on
the way. What neither gives, the server's defaults fill (per priority
class, per model, per server: ``ObjectiveDefaults``).

A target on a server without ``--scheduling-policy slo`` is accepted,
carried, and reported in the response's ``usage.slo`` as not enforced:
never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from trioserve.actors.slo_admission import SloDecision
from trioserve.engine.latency_objectives import NO_OBJECTIVES, LatencyObjectives, ObjectiveDefaults
from trioserve.engine.core.new_request import RequestInput
from trioserve.engine.core.outputs import RequestTimes
from trioserve.engine.errors import InvalidRequestError

from .errors import InvalidRequest

# The body's extension fields and the headers, by the objective they set.
BODY_FIELDS = {"ttft": "ttft_ms", "tpot": "tpot_ms"}
# Every extension field of a body: what /v1/responses and /v1/messages pass
# on to the chat body they become, and gRPC's request fields.
EXTENSION_FIELDS = ("ttft_ms", "tpot_ms", "slo_mode", "slo_allow_shorter")
HEADERS = {"ttft": "x-slo-ttft-ms", "tpot": "x-slo-tpot-ms"}
SLO_MODES = ("enforced", "best_effort")


def _seconds(value: object, field: str) -> float | None:
    """A target in ms as seconds, or a 400 naming ``field``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{field} must be a number of milliseconds, got {value!r}", param=field)
    try:
        return LatencyObjectives(ttft=value / 1000).ttft
    except InvalidRequestError:
        raise InvalidRequest(f"{field} must be > 0 and at most a day (86400000 ms), got {value!r}", param=field) from None


def body_objectives(body: Mapping[str, Any]) -> LatencyObjectives:
    """The objectives a body states (its fields left out: none)."""
    ttft = _seconds(body.get("ttft_ms"), "ttft_ms")
    tpot = _seconds(body.get("tpot_ms"), "tpot_ms")
    mode = body.get("slo_mode")
    if mode is not None and mode not in SLO_MODES:
        raise InvalidRequest(f"slo_mode must be one of {', '.join(map(repr, SLO_MODES))}, got {mode!r}", param="slo_mode")
    shorter = body.get("slo_allow_shorter")
    if shorter is not None and not isinstance(shorter, bool):
        raise InvalidRequest(f"slo_allow_shorter must be true or false, got {shorter!r}", param="slo_allow_shorter")
    if ttft is None and tpot is None and mode is None and shorter is None:
        return NO_OBJECTIVES
    return LatencyObjectives(ttft, tpot, best_effort=mode == "best_effort", allow_shorter=bool(shorter))


def header_objectives(headers: Mapping[str, str]) -> tuple[float | None, float | None]:
    """The TTFT and TPOT targets of the headers, in seconds (None: absent)."""
    values = []
    for kind in ("ttft", "tpot"):
        name = HEADERS[kind]
        text = headers.get(name)
        if text is None:
            values.append(None)
            continue
        try:
            number = float(text)
        except ValueError:
            raise InvalidRequest(f"{name} must be a number of milliseconds, got {text!r}", param=name) from None
        values.append(_seconds(number, name))
    return values[0], values[1]


def request_objectives(
    given: LatencyObjectives, headers: Mapping[str, str], defaults: ObjectiveDefaults, *, model: str, priority: int
) -> LatencyObjectives:
    """``given`` (the body's), each target it leaves unset taken from the
    headers, then from ``defaults``."""
    ttft, tpot = header_objectives(headers)
    if (ttft is not None and given.ttft is None) or (tpot is not None and given.tpot is None):
        given = attrs.evolve(given, ttft=given.ttft if given.ttft is not None else ttft, tpot=given.tpot if given.tpot is not None else tpot)
    return defaults.resolve(given, model=model, priority=priority)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


@attrs.frozen
class SloReport:
    """What a response's ``usage.slo`` says of its objectives: the targets,
    whether the server enforces them, what admission predicted (``decision``;
    None when not enforced) and, from the request's times, what was measured
    and whether each target was met. ``max_tokens_field``: what the
    surface's request calls the output cap that ``slo_allow_shorter`` may
    lower (``max_output_tokens`` on /v1/responses, ``params.max_tokens``
    over gRPC), so that the reason names the field the client set."""

    objectives: LatencyObjectives
    enforced: bool
    decision: SloDecision | None = None
    max_tokens_field: str = "max_tokens"

    @property
    def verdict(self) -> str:
        """What the door decided, as the metrics and traces name it:
        ``admitted``, ``shortened`` (at a lower ``max_tokens``) or
        ``not_enforced``."""
        if not self.enforced:
            return "not_enforced"
        return "shortened" if self.decision is not None and self.decision.max_tokens is not None else "admitted"

    def measured(self, times: RequestTimes | None, num_output_tokens: int) -> tuple[float | None, float | None]:
        """The measured TTFT and TPOT, in seconds (None: not known yet)."""
        if times is None or times.first_token is None:
            return None, None
        ttft = max(0.0, times.first_token - times.arrival)
        tpot = None
        if num_output_tokens > 1:
            tpot = max(0.0, times.now - times.first_token) / (num_output_tokens - 1)
        return ttft, tpot

    def met(self, times: RequestTimes | None, num_output_tokens: int) -> dict[str, bool | None]:
        """Per objective with a target: whether it was met (None: not known)."""
        ttft, tpot = self.measured(times, num_output_tokens)
        met: dict[str, bool | None] = {}
        if self.objectives.ttft is not None:
            met["ttft"] = None if ttft is None else ttft <= self.objectives.ttft
        if self.objectives.tpot is not None:
            met["tpot"] = None if tpot is None else tpot <= self.objectives.tpot
        return met

    def usage(self, times: RequestTimes | None, num_output_tokens: int) -> dict[str, Any]:
        ttft, tpot = self.measured(times, num_output_tokens)
        report: dict[str, Any] = {
            "enforced": self.enforced,
            "slo_mode": "best_effort" if self.objectives.best_effort else "enforced",
            "ttft_ms": _ms(self.objectives.ttft),
            "tpot_ms": _ms(self.objectives.tpot),
        }
        if not self.enforced:
            report["reason"] = "the server does not run --scheduling-policy slo: targets are reported, not enforced"
        if self.decision is not None:
            prediction = self.decision.prediction
            report["predicted"] = {"ttft_ms": _ms(prediction.ttft), "tpot_ms": _ms(prediction.tpot)}
            if self.decision.max_tokens is not None:
                report["max_tokens_lowered_to"] = self.decision.max_tokens
                report["reason"] = (
                    f"predicted to miss tpot_ms at the {self.max_tokens_field} asked; slo_allow_shorter lowered it"
                )
        report["measured"] = {"ttft_ms": _ms(ttft), "tpot_ms": _ms(tpot)}
        report["met"] = self.met(times, num_output_tokens)
        return report


def slo_report(
    objectives: LatencyObjectives, policy: str, decision: SloDecision | None, *, max_tokens_field: str = "max_tokens"
) -> SloReport | None:
    """The report of a request with ``objectives`` on a server running
    ``policy`` (None: it stated none, and the server has no defaults)."""
    if objectives.empty:
        return None
    return SloReport(objectives, enforced=policy == "slo", decision=decision, max_tokens_field=max_tokens_field)


def with_objectives(new: RequestInput, headers: Mapping[str, str], defaults: ObjectiveDefaults, model: str) -> RequestInput:
    """``new`` with its objectives completed from ``headers`` and the
    server's ``defaults`` for ``model`` and its priority."""
    objectives = request_objectives(new.objectives, headers, defaults, model=model, priority=new.priority)
    return new if objectives is new.objectives else attrs.evolve(new, objectives=objectives)
