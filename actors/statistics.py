"""Statistics values of each actor and of the whole engine (frozen attrs),
and the sliding-window rate meter behind the throughput figures."""

from __future__ import annotations

import collections

import attrs

from trioserve.engine.core.kv_batch import KVBudget
from trioserve.engine.faults import Fault


@attrs.frozen
class AllocatorStatistics:
    """The allocator actor's view: the pool as of its last batch."""

    kv: KVBudget
    num_batches: int  # round trips served


@attrs.frozen
class ExecutorStatistics:
    num_steps: int
    num_failed_steps: int  # raised (the step thread dying included)
    busy_seconds: float  # summed wall time of the steps
    last_step_seconds: float
    step_in_flight: bool
    num_hung_steps: int = 0  # declared hung by the watchdog, ever
    num_hung_steps_running: int = 0  # of those, not returned yet (their threads still busy)
    num_thread_restarts: int = 0  # step threads replaced (hung, died or found closed)
    last_fault: Fault | None = None
    # worker_mode="process" only (None / 0 with the step thread):
    worker_state: str | None = None  # starting, ready, restarting, failed, stopped
    worker_pid: int | None = None
    num_worker_restarts: int = 0  # worker processes restarted after one died


@attrs.frozen
class SchedulerActorStatistics:
    """The scheduler actor's view: its queues, outcomes and throughput."""

    num_waiting: int  # admitted, waiting to be scheduled (new or preempted)
    num_running: int
    num_paused: int  # sequences (each completion of a request) paused because their reader fell behind
    num_live: int  # requests the scheduler actor holds (incl. finished, not yet delivered)
    num_deadlines: int  # entries in its deadline heap, incl. stale ones not yet swept
    num_steps: int
    num_preemptions: int
    num_finished: int  # by a finish reason of the model: stop or length
    num_aborted: int
    num_deadline_exceeded: int
    num_failed: int  # by a failed step or an invalid request
    prompt_tokens_per_s: float  # over the last ``window`` seconds
    generation_tokens_per_s: float
    requests_per_s: float  # completions of any kind, queue timeouts aside
    total_prompt_tokens: int
    total_generation_tokens: int
    num_queue_timeouts: int = 0  # dropped past max_queue_time, from the queue or waiting unscheduled

    # Faults (docs/reliability.md): KV blocks held for hung steps, requests
    # refused because the tokenizer raised, requests failed because the
    # detokenizer raised, and the latest such fault.
    num_quarantined_blocks: int = 0
    num_tokenizer_errors: int = 0
    num_detokenizer_errors: int = 0
    last_fault: Fault | None = None
    # Speculative decoding (--speculative): tokens proposed and, of those, accepted, since start.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@attrs.frozen
class OverloadStatistics:
    """Overload control: the pressure the degradation policy acts on, the
    running-sequence limit, and what each control did (cumulative counts)."""

    pressure: float  # admission queue fill, 0..1 (see DegradationPolicy)
    concurrency_limit: int  # sequences that may run at once now (max_num_seqs unless adaptive)
    tpot_p90: float | None  # seconds, adaptive concurrency's last window (None: off or no window yet)
    num_queue_timeouts: int  # dropped past max_queue_time, wherever they waited
    num_shed: int  # displaced from the full queue by a higher priority
    num_capped: int  # low priority with max_tokens capped under pressure
    num_refused_expensive: int  # n > 1 or many top logprobs refused under pressure
    num_limit_decreases: int
    num_limit_increases: int

    def action_counts(self) -> dict[str, int]:
        """The counts by action name, as /metrics labels them."""
        return {
            "queue_timeout": self.num_queue_timeouts,
            "shed": self.num_shed,
            "cap_max_tokens": self.num_capped,
            "refuse_expensive": self.num_refused_expensive,
            "limit_decrease": self.num_limit_decreases,
            "limit_increase": self.num_limit_increases,
        }


@attrs.frozen
class ReplicaStatistics:
    """One data-parallel replica's figures (``EngineStatistics.replicas``);
    with one replica, the engine's own."""

    index: int
    num_queued: int  # in its admission queue, routed to it, not yet taken
    scheduler: SchedulerActorStatistics
    allocator: AllocatorStatistics
    executor: ExecutorStatistics


@attrs.frozen
class EngineStatistics:
    """What ``Engine.statistics()`` reports."""

    num_queued: int  # in the admission queue, not yet taken by the scheduler
    num_queued_tokens: int
    num_waiting_to_queue: int  # generate() calls blocked on a full queue
    max_queued_requests: int
    max_queued_tokens: int | None
    num_refused: int  # generate_nowait calls refused with EngineOverloaded
    num_reserved_ids: int  # request ids in use: a request's actor is open or the scheduler holds it
    # Requests that ended while waiting for room in the queue (never queued):
    num_deadline_unqueued: int  # their deadline passed
    num_cancelled_unqueued: int  # cancelled or aborted
    # Requests queued by generate or generate_nowait. Each ends exactly once:
    # in the scheduler's figures (finished, aborted, deadline exceeded,
    # failed, queue timeouts) or shed from the queue (overload.num_shed).
    num_accepted: int
    scheduler: SchedulerActorStatistics
    allocator: AllocatorStatistics
    executor: ExecutorStatistics
    overload: OverloadStatistics
    # Per data-parallel replica (one entry with one replica); the fields
    # above are the sums over replicas.
    replicas: tuple[ReplicaStatistics, ...] = ()

    # The headline figures, flattened.
    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def kv_usage(self) -> float:
        return self.allocator.kv.usage

    @property
    def num_deadline_exceeded(self) -> int:
        """Every request that ended by its deadline, queued or not."""
        return self.scheduler.num_deadline_exceeded + self.num_deadline_unqueued

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.allocator.kv.prefix_cache_hit_rate

    @property
    def generation_tokens_per_s(self) -> float:
        return self.scheduler.generation_tokens_per_s

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.scheduler.prompt_tokens_per_s


@attrs.define
class RateMeter:
    """Counts events over the last ``window`` seconds of some clock."""

    window: float
    start: float  # when counting began
    _events: collections.deque[tuple[float, int]] = attrs.field(init=False, factory=collections.deque)
    _total_in_window: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if self.window <= 0:
            raise ValueError("window must be > 0")

    def add(self, now: float, count: int) -> None:
        if count:
            self._events.append((now, count))
            self._total_in_window += count
        self._expire(now)

    def rate(self, now: float) -> float:
        """Events per second over the window (or since ``start``, if that
        is more recent)."""
        self._expire(now)
        span = min(self.window, now - self.start)
        return self._total_in_window / span if span > 0 else 0.0

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window:
            self._total_in_window -= self._events.popleft()[1]


def estimate_retry_after(num_queued: int, completion_rate: float) -> float:
    """Seconds until an admission queue holding ``num_queued`` requests has
    room, at ``completion_rate`` requests a second (1 s before there is a
    rate), in [0.1, 60]: what a refused or dropped request is told."""
    if completion_rate <= 0:
        return 1.0
    return min(60.0, max(0.1, (num_queued + 1) / completion_rate))
