"""Latency objectives' metrics (issue #44), beside ``metrics.py``'s, per
served model and priority class (``priority``, the request's value):

- ``trioserve:slo_requests_total{decision}``: requests with objectives, by
  what the door decided: ``admitted``, ``refused_ttft``, ``refused_tpot``,
  ``shortened`` (admitted at a lower ``max_tokens``), ``not_enforced``
  (the server does not run ``--scheduling-policy slo``);
- ``trioserve:slo_outcomes_total{objective, outcome}``: for each target of a
  finished request, ``met`` or ``missed``;
- ``trioserve:slo_predicted_ttft_seconds`` / ``slo_measured_ttft_seconds``
  (and ``..._tpot_...``): what admission predicted and what came, for the
  requests it judged, and ``slo_ttft_relative_error`` (``|predicted -
  measured| / measured``; ``slo_tpot_relative_error``): the latency model's
  error, whose p90 docs/reliability.md reports.
"""

from __future__ import annotations

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram

from trioserve.engine.core.outputs import RequestOutput

from .slo import SloReport

PREFIX = "trioserve:"
DECISIONS = ("admitted", "refused_ttft", "refused_tpot", "shortened", "not_enforced")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.5, 1.0, 2.5)
ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


@attrs.define
class _Judged:
    model: str
    priority: str
    report: SloReport


@attrs.define(slots=False)
class SloMetrics:
    """The SLO series, in ``registry``."""

    registry: CollectorRegistry
    _tracked: dict[str, _Judged] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        labels = ["model_name", "priority"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.requests = Counter(
            PREFIX + "slo_requests", "Requests with latency objectives, by the door's decision.", [*labels, "decision"],
            registry=self.registry,
        )
        self.outcomes = Counter(
            PREFIX + "slo_outcomes", "Targets of finished requests, met or missed.", [*labels, "objective", "outcome"],
            registry=self.registry,
        )
        self.predicted_ttft = histogram("slo_predicted_ttft_seconds", "TTFT admission predicted.", TTFT_BUCKETS)
        self.measured_ttft = histogram("slo_measured_ttft_seconds", "TTFT measured, of judged requests.", TTFT_BUCKETS)
        self.ttft_error = histogram(
            "slo_ttft_relative_error", "|predicted - measured| / measured TTFT.", ERROR_BUCKETS
        )
        self.predicted_tpot = histogram("slo_predicted_tpot_seconds", "TPOT admission predicted.", TPOT_BUCKETS)
        self.measured_tpot = histogram("slo_measured_tpot_seconds", "TPOT measured, of judged requests.", TPOT_BUCKETS)
        self.tpot_error = histogram(
            "slo_tpot_relative_error", "|predicted - measured| / measured TPOT.", ERROR_BUCKETS
        )

    def refused(self, model: str, priority: int, reason: str) -> None:
        """A request refused at the door for its ``reason`` (``ttft`` / ``tpot``)."""
        self.requests.labels(model, str(priority), f"refused_{reason}").inc()

    def track(self, request_id: str, model: str, priority: int, report: SloReport) -> None:
        """A request with objectives was accepted: count its decision, and
        observe its outcome when its first completion finishes."""
        self.requests.labels(model, str(priority), report.verdict).inc()
        self._tracked[request_id] = _Judged(model, str(priority), report)

    def observe_output(self, output: RequestOutput) -> None:
        """Feed a delta; on its request's first completion's final one,
        count met and missed, and observe predicted against measured."""
        if output.index != 0 or output.finish_reason is None:
            return
        judged = self._tracked.pop(output.request_id, None)
        if judged is None:
            return
        labels = (judged.model, judged.priority)
        for objective, met in judged.report.met(output.times, output.num_output_tokens).items():
            if met is not None:
                self.outcomes.labels(*labels, objective, "met" if met else "missed").inc()
        decision = judged.report.decision
        ttft, tpot = judged.report.measured(output.times, output.num_output_tokens)
        if decision is None:
            return
        prediction = decision.prediction
        if ttft is not None:
            self.predicted_ttft.labels(*labels).observe(prediction.ttft)
            self.measured_ttft.labels(*labels).observe(ttft)
            self.ttft_error.labels(*labels).observe(abs(prediction.ttft - ttft) / max(ttft, 1e-6))
        if tpot is not None:
            self.predicted_tpot.labels(*labels).observe(prediction.tpot)
            self.measured_tpot.labels(*labels).observe(tpot)
            self.tpot_error.labels(*labels).observe(abs(prediction.tpot - tpot) / max(tpot, 1e-6))

    def forget(self, request_id: str) -> None:
        """Drop a request whose stream ended without its final delta."""
        self._tracked.pop(request_id, None)
