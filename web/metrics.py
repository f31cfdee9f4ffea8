"""Prometheus metrics with vLLM's names under a ``trioserve:`` prefix.

``Metrics`` owns its own ``CollectorRegistry`` (never the global one), so
several apps and tests can live in one process. The app feeds it three ways:

- ``observe_output`` with every ``RequestOutput`` delta it streams, for the
  latency histograms (times come from ``output.times``, monotonic);
- ``update_from_statistics`` with ``engine.statistics()`` before each scrape,
  for the gauges and the engine-wide token and cache counters;
- ``reject`` for every request refused before it reached the engine or
  ended by its deadline before admission;
- ``update_overload`` with ``engine.statistics().overload`` before each
  scrape, for the overload controls (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import attrs
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from trioserve.engine.core.sequence import FinishReason

from .replica_metrics import ReplicaMetrics
from .slo_metrics import SloMetrics

if TYPE_CHECKING:
    from trioserve.engine.core.outputs import RequestOutput

PREFIX = "trioserve:"
REJECT_REASONS = (
    "overloaded",
    "deadline",
    "invalid",
    "unauthorized",
    "not_found",
    "too_large",
    "draining",
    "queue_timeout",
)
# What overload control did (the label of trioserve:overload_actions_total).
OVERLOAD_ACTIONS = ("queue_timeout", "shed", "cap_max_tokens", "refuse_expensive", "limit_decrease", "limit_increase")

# Seconds. Fine steps under a second (a token on a GPU), coarse ones up to
# the longest CPU requests.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (inclusive)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale >= max_model_len:
                return (*buckets, max_model_len)
            buckets.append(step * scale)
        scale *= 10


class MetricsSource(Protocol):
    """The fields of ``engine.statistics()`` that ``update_from_statistics`` reads.

    Counts of requests and blocks now; engine-lifetime totals in tokens.
    """

    num_running: int
    num_waiting: int  # waiting and preempted requests, not yet running
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    spec_decode_num_draft_tokens: int  # speculative decoding: tokens proposed
    spec_decode_num_accepted_tokens: int  # of those, accepted


class OverloadSource(Protocol):
    """What ``update_overload`` reads (``OverloadStatistics``)."""

    pressure: float  # admission queue fill, 0..1
    concurrency_limit: int  # running sequences admitted now

    def action_counts(self) -> Mapping[str, int]: ...  # cumulative, by OVERLOAD_ACTIONS name


# Engine totals mirrored into counters of the same name.
_TOTALS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


@attrs.define
class _Completion:
    first_token: float | None = None
    last_token: float | None = None
    finished: bool = False


@attrs.define
class _Tracked:
    """Per-request state between deltas."""

    num_completions: int
    first_token_seen: bool = False
    completions: dict[int, _Completion] = attrs.field(factory=dict)
    generation_tokens: int = 0


# Not slotted: the metric objects are made in __attrs_post_init__ and would
# otherwise each need a field declaration repeating its name.
@attrs.define(slots=False)
class Metrics:
    """The server's metrics; ``render()`` gives the ``GET /metrics`` body."""

    max_model_len: int = 8192
    registry: CollectorRegistry = attrs.field(factory=CollectorRegistry)
    _tracked: dict[str, _Tracked] = attrs.field(factory=dict, init=False)
    _last_totals: dict[tuple[str, str], int] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *labels], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry)

        self.num_requests_running = gauge("num_requests_running", "Requests running on the engine now.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for the engine (incl. preempted).")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = 100%).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted to free KV blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed (--speculative)."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted."
        )
        self.request_success = counter("request_success", "Requests finished, by finish reason.", "finished_reason")
        self.request_rejected = counter("request_rejected", "Requests refused, by reason.", "reason")
        self.concurrency_limit = gauge(
            "concurrency_limit", "Sequences allowed to run at once (adaptive concurrency; else max_num_seqs)."
        )
        self.overload_pressure = gauge("overload_pressure", "Admission queue fill, 0..1, that degradation acts on.")
        self.overload_actions = counter("overload_actions", "Overload-control actions taken, by action.", "action")
        self.worker_restarts = counter(
            "worker_restarts", "Worker processes restarted after one died (--worker-mode process)."
        )
        tokens = token_buckets(self.max_model_len)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between a completion's tokens.", TOKEN_LATENCY_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Per completion: (last - first token time) / (tokens - 1).", TOKEN_LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to last token.", REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request (all completions).", tokens
        )
        # Per data-parallel replica, labelled ``replica`` (replica_metrics.py).
        self.replicas = ReplicaMetrics(self.registry)
        # Latency objectives, per priority class (slo_metrics.py).
        self.slo = SloMetrics(self.registry)

    @property
    def _model_only(self) -> list[Gauge | Counter | Histogram]:
        """The metrics labelled by ``model_name`` alone."""
        skip = (self.request_success, self.request_rejected, self.overload_actions)
        return [m for m in vars(self).values() if isinstance(m, Gauge | Counter | Histogram) and m not in skip]

    def add_model(self, model: str) -> None:
        """Create every series of ``model`` at zero, so dashboards see them before traffic."""
        for metric in self._model_only:
            metric.labels(model)
        for reason in FinishReason:
            self.request_success.labels(model, reason.value)
        for reason in REJECT_REASONS:
            self.request_rejected.labels(model, reason)
        for action in OVERLOAD_ACTIONS:
            self.overload_actions.labels(model, action)

    def reject(self, model: str, reason: str) -> None:
        """Count a refused request. ``model`` must be a served model's name,
        never a client's unknown one (label values must stay few)."""
        if reason not in REJECT_REASONS:
            raise ValueError(f"reason must be one of {', '.join(REJECT_REASONS)}, got {reason!r}")
        self.request_rejected.labels(model, reason).inc()

    def observe_output(self, model: str, output: RequestOutput, *, num_completions: int = 1) -> None:
        """Feed one streamed delta. ``num_completions`` is the request's ``n``:
        the request-level histograms are observed once all have finished."""
        self.slo.observe_output(output)
        times = output.times
        tracked = self._tracked.get(output.request_id)
        if tracked is None:
            tracked = self._tracked[output.request_id] = _Tracked(num_completions)
        completion = tracked.completions.setdefault(output.index, _Completion())
        if output.new_token_ids:
            first = times.first_token if times.first_token is not None else times.now
            if not tracked.first_token_seen:
                tracked.first_token_seen = True
                self.time_to_first_token.labels(model).observe(max(0.0, first - times.arrival))
            if completion.last_token is not None:
                self.inter_token_latency.labels(model).observe(max(0.0, times.now - completion.last_token))
            if completion.first_token is None:
                completion.first_token = first
            completion.last_token = times.now
        if output.finish_reason is None or completion.finished:
            return
        completion.finished = True
        tracked.generation_tokens += output.num_output_tokens
        if output.num_output_tokens > 1 and completion.first_token is not None:
            per_token = (completion.last_token - completion.first_token) / (output.num_output_tokens - 1)
            self.time_per_output_token.labels(model).observe(max(0.0, per_token))
        if sum(c.finished for c in tracked.completions.values()) < tracked.num_completions:
            return
        del self._tracked[output.request_id]
        self.e2e_request_latency.labels(model).observe(max(0.0, times.now - times.arrival))
        if times.first_scheduled is not None:
            self.request_queue_time.labels(model).observe(max(0.0, times.first_scheduled - times.arrival))
        self.request_prompt_tokens.labels(model).observe(output.num_prompt_tokens)
        self.request_generation_tokens.labels(model).observe(tracked.generation_tokens)
        # With n > 1 the request counts once, under its last completion's reason.
        self.request_success.labels(model, output.finish_reason.value).inc()

    def forget(self, request_id: str) -> None:
        """Drop a request's state when its stream ended without a final delta
        (the client went away); call it in the handler's ``finally``."""
        self._tracked.pop(request_id, None)
        self.slo.forget(request_id)

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    def update_from_statistics(self, model: str, stats: MetricsSource) -> None:
        """Set the gauges, and advance each counter by the growth of its engine total."""
        self.num_requests_running.labels(model).set(stats.num_running)
        self.num_requests_waiting.labels(model).set(stats.num_waiting)
        self.kv_cache_usage_perc.labels(model).set(stats.kv_cache_usage)
        for field in _TOTALS:
            total = getattr(stats, field)
            last = self._last_totals.get((model, field), 0)
            # A total that went down means a new engine: count it from zero.
            growth = total - last if total >= last else total
            if growth:
                getattr(self, field).labels(model).inc(growth)
            self._last_totals[(model, field)] = total

    def update_overload(self, model: str, stats: OverloadSource) -> None:
        """Set the overload gauges, and advance each action's counter by the
        growth of its engine total."""
        self.concurrency_limit.labels(model).set(stats.concurrency_limit)
        self.overload_pressure.labels(model).set(stats.pressure)
        for action, total in stats.action_counts().items():
            key = (model, f"overload:{action}")
            last = self._last_totals.get(key, 0)
            growth = total - last if total >= last else total  # a new engine counts from zero
            if growth:
                self.overload_actions.labels(model, action).inc(growth)
            self._last_totals[key] = total

    def update_worker(self, model: str, restarts: int) -> None:
        """Advance the worker-restart counter to the engine's total."""
        last = self._last_totals.get((model, "worker_restarts"), 0)
        growth = restarts - last if restarts >= last else restarts  # a new engine counts from zero
        if growth:
            self.worker_restarts.labels(model).inc(growth)
        self._last_totals[(model, "worker_restarts")] = restarts

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
