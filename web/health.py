"""What ``GET /health`` says while the server serves: that it does, and what
faults it has survived (docs/api.md lists the fields).

A fault never makes ``/health`` fail while the engines serve: a load
balancer that pulled a server for a hung step would turn one bad request
into an outage. ``degraded`` says a hung step is still running in an
abandoned thread (holding a CPU and quarantined KV blocks); the counters and
``last_error`` say what happened.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from trioserve.engine.faults import Fault

if TYPE_CHECKING:
    from trioserve.actors.statistics import EngineStatistics

    from .served import ServedModel


def count_tasks() -> int:
    """Every task of the current trio run (the server's, its connections',
    its engines'): a figure that must return to its idle value after load."""
    count = 0
    pending = [trio.lowlevel.current_root_task()]
    while pending:
        task = pending.pop()
        if task is None:
            continue
        count += 1
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return count


def fault_json(fault: Fault | None) -> dict[str, Any] | None:
    if fault is None:
        return None
    return {"kind": fault.kind, "message": fault.message, "time": round(fault.time, 3)}


def model_health(stats: EngineStatistics) -> dict[str, Any]:
    """One engine's part of the report."""
    executor, scheduler = stats.executor, stats.scheduler
    worker_down = executor.worker_state is not None and executor.worker_state != "ready"
    return {
        "degraded": executor.num_hung_steps_running > 0 or scheduler.num_quarantined_blocks > 0 or worker_down,
        "failed_steps": executor.num_failed_steps,
        "hung_steps": executor.num_hung_steps,
        "hung_steps_running": executor.num_hung_steps_running,
        "step_thread_restarts": executor.num_thread_restarts,
        "quarantined_kv_blocks": scheduler.num_quarantined_blocks,
        "failed_requests": scheduler.num_failed,
        "tokenizer_errors": scheduler.num_tokenizer_errors,
        "detokenizer_errors": scheduler.num_detokenizer_errors,
        "last_error": fault_json(Fault.latest(executor.last_fault, scheduler.last_fault)),
        # --worker-mode process: the worker's state and pid, and its restarts.
        "worker": None
        if executor.worker_state is None
        else {"state": executor.worker_state, "pid": executor.worker_pid, "restarts": executor.num_worker_restarts},
    }


def health_report(served: Mapping[str, ServedModel]) -> dict[str, Any]:
    """The body of a 200 ``/health``, for a ready host's ``models``."""
    models = {name: model_health(model.engine.statistics()) for name, model in served.items()}
    return {
        "status": "ready",
        "degraded": any(m["degraded"] for m in models.values()),
        "tasks": count_tasks(),
        "models": models,
    }


class TaskCountCollector(Collector):
    """``trioserve:trio_tasks`` in ``/metrics``: the tasks of the server's
    trio run at the time of the scrape."""

    def collect(self) -> Iterable[GaugeMetricFamily]:
        try:
            value = count_tasks()
        except RuntimeError:  # not in a trio run (a scrape from elsewhere)
            return []
        return [GaugeMetricFamily("trioserve:trio_tasks", "Tasks in the server's trio run", value=value)]
