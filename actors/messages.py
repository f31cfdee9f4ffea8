"""The messages that cross the actors' channels; every one is a frozen attrs value.

Who sends what to whom (see docs/architecture.md for capacities):

- request actor -> scheduler, admission queue: ``AddRequest``.
- request actor -> scheduler, control channel: ``Abort``, ``Resume``;
  ``Engine.drain`` sends ``AbortAll``; ``Engine.load_lora`` /
  ``unload_lora`` send ``LoadLora`` / ``UnloadLora``, answered on their
  ``reply`` channel once applied between steps.
- scheduler -> request actor, the request's output channel:
  ``RequestOutput`` (the engine core's value), ``Paused``, ``Failed``.
- scheduler -> allocator: ``Allocate``; allocator -> scheduler: ``KVResult``.
- scheduler -> executor: ``RunStep``, then ``StepMask`` when its plan
  ``awaits_mask``; executor -> scheduler: ``StepDone`` or ``StepFailed`` (a
  step that raised, or hung past the watchdog).
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from trioserve.engine.core.kv_batch import KVBatch
from trioserve.engine.core.new_request import NewRequest
from trioserve.engine.lora.adapter import LoraAdapter
from trioserve.engine.runtime.model_runner import RunnerOutput
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.runtime.step_plan import StepPlan
from trioserve.engine.sampling.rows import TokenMask
from trioserve.engine.core.sequence import FinishReason


@attrs.frozen
class AddRequest:
    """A validated, tokenized request (``request``) asking to be scheduled.

    ``deadline`` is in ``trio.current_time()`` units (None: none);
    ``arrival_time`` is ``time.monotonic()``, the clock of ``RequestTimes``.
    ``outputs`` is the send end of the request's output channel, which the
    scheduler owns from the moment it receives this message.
    ``queue_deadline`` (trio time; None: none) is when the request is
    dropped with ``QueueTimeout`` if nothing has been computed for it yet
    (arrival plus ``max_queue_time``). ``predicted_ttfts``: with the slo
    policy, the TTFT SLO admission predicted on each replica, for the
    data-parallel router (empty: route by affinity and load).
    """

    request: NewRequest
    deadline: float | None
    arrival_time: float
    outputs: trio.MemorySendChannel[Any] = attrs.field(eq=False, repr=False)
    queue_deadline: float | None = None
    predicted_ttfts: tuple[float, ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens


@attrs.frozen
class Abort:
    """End a request at the next step boundary, freeing its blocks.

    ``reason`` is ``ABORT`` (the caller went away or asked) or ``DEADLINE``.
    Each request sends at most one, and only while the scheduler still
    holds it (queued or live).
    """

    request_id: str
    reason: FinishReason = FinishReason.ABORT


@attrs.frozen
class Resume:
    """The request's reader took the ``Paused`` marker: schedule it again."""

    request_id: str


@attrs.frozen
class AbortAll:
    """End every request, queued or live (``Engine.drain`` past its timeout)."""

    reason: FinishReason = FinishReason.ABORT


@attrs.frozen
class Paused:
    """Output-channel marker: the reader fell ``max_buffered_outputs`` behind,
    so the sequence was preempted (its output is kept) until the reader
    takes this marker and answers ``Resume``."""

    request_id: str


@attrs.frozen
class Failed:
    """Output-channel marker: the request ended on an error, not a finish
    reason. ``error`` is the exception the caller's ``generate`` raises."""

    request_id: str
    error: Exception = attrs.field(eq=False)


@attrs.frozen
class Allocate:
    """One step's KV work (commits, frees, allocations) for the allocator."""

    batch: KVBatch


@attrs.frozen
class RunStep:
    """Run one planned step: ``plan`` is a value (it pickles), so nothing
    the scheduler changes while the step runs reaches the step."""

    step_id: int
    plan: StepPlan


@attrs.frozen
class StepMask:
    """The allowed tokens of step ``step_id``'s constrained rows: the next
    message after a ``RunStep`` whose plan ``awaits_mask``. The scheduler
    fills it while the step's forward runs; the step samples once it has it."""

    step_id: int
    mask: TokenMask


@attrs.frozen
class StepDone:
    step_id: int
    output: RunnerOutput
    seconds: float  # wall time of the step itself


@attrs.frozen
class StepFailed:
    """The step raised, or hung past the watchdog; ``error`` is the
    exception (its requests fail).

    ``released`` is set for a hung step only: the step is still running in
    an abandoned thread and may still write its requests' KV blocks, so
    their blocks stay quarantined (held, never reused) until this event is
    set, when the step has returned.
    """

    step_id: int
    error: Exception = attrs.field(eq=False)
    seconds: float
    released: trio.Event | None = attrs.field(default=None, eq=False)


@attrs.frozen(eq=False)
class LoadLora:
    """Serve ``adapter`` (read and checked already) from the next step on;
    ``reply`` (capacity 1) gets None, or the ``LoraError`` that refused it."""

    adapter: LoraAdapter
    reply: trio.MemorySendChannel[Exception | None]


@attrs.frozen(eq=False)
class UnloadLora:
    """Stop serving adapter ``name`` at the next step boundary; ``reply``
    (capacity 1) gets None, or the ``LoraError`` that refused it (not
    loaded, or requests still run with it)."""

    name: str
    reply: trio.MemorySendChannel[Exception | None]
