"""Per-replica metrics: the figures of each data-parallel replica under a
``replica`` label (``"0"``, ``"1"``, ...), beside the engine-wide series of
``metrics.py`` (which are their sums). One replica is reported as replica 0.

- ``trioserve:replica_num_requests_running``, ``..._waiting`` (waiting in its
  scheduler and in its admission queue), ``trioserve:replica_kv_cache_usage_perc``:
  gauges, set before each scrape;
- ``trioserve:replica_steps_total``: model steps it ran, a counter advanced
  by the growth of the replica's own count.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge

from trioserve.actors.statistics import ReplicaStatistics

PREFIX = "trioserve:"
LABELS = ["model_name", "replica"]


@attrs.define(slots=False)
class ReplicaMetrics:
    """The per-replica series, in ``registry``."""

    registry: CollectorRegistry
    _last_steps: dict[tuple[str, str], int] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, LABELS, registry=self.registry)

        self.num_requests_running = gauge("replica_num_requests_running", "Requests running on this replica now.")
        self.num_requests_waiting = gauge(
            "replica_num_requests_waiting", "Requests routed to this replica, not running yet (incl. preempted)."
        )
        self.kv_cache_usage_perc = gauge("replica_kv_cache_usage_perc", "Fraction of this replica's KV blocks in use.")
        self.steps = Counter(PREFIX + "replica_steps", "Model steps this replica ran.", LABELS, registry=self.registry)

    def update(self, model: str, replicas: Sequence[ReplicaStatistics]) -> None:
        """Set each replica's gauges and advance its step counter."""
        for replica in replicas:
            label = str(replica.index)
            scheduler = replica.scheduler
            self.num_requests_running.labels(model, label).set(scheduler.num_running)
            self.num_requests_waiting.labels(model, label).set(scheduler.num_waiting + replica.num_queued)
            self.kv_cache_usage_perc.labels(model, label).set(replica.allocator.kv.usage)
            key = (model, label)
            last = self._last_steps.get(key, 0)
            total = scheduler.num_steps
            growth = total - last if total >= last else total  # a new engine counts from zero
            if growth:
                self.steps.labels(model, label).inc(growth)
            self._last_steps[key] = total
