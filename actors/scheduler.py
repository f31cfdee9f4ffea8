"""The scheduler actor: admission, control and the step loop.

It owns the engine core's scheduling state (``EngineCore`` minus its pool and
runner), the routes of the requests it holds (``Delivery``, delivery.py),
their deadlines (``Deadlines``, deadlines.py), what is applied between steps
(``StepBoundary``, boundary.py) and the blocks of hung steps
(``Quarantine``, quarantine.py), and runs three loops in one nursery:

- the *admission loop* takes ``AddRequest`` messages from the admission
  queue, but only while the core's waiting queue is short and its working
  set has room, so the queue's bound really bounds the backlog;
- the *control loop* takes ``Abort`` / ``Resume`` / ``AbortAll`` and queues
  them; they are applied at the next step boundary;
- the *step loop*: apply control, expired deadlines and queue deadlines,
  plan the step with one allocator round trip (``propose`` -> ``Allocate``
  -> ``finalize``), hand it to the executor, and while it computes fill the
  structured-output mask of its constrained rows (in a worker thread; it
  follows the plan as a ``StepMask``) and deliver the previous step's
  outputs; then post-process the result (and, with adaptive concurrency,
  feed the step's timing to the running limit).

While a step runs in the executor's thread the other two loops keep going:
requests are admitted into the core (validated, given detokenizers and
sampling state, queued in priority order), aborts are collected and outputs
are delivered. That is the part of planning step n+1 that is safe to do
during step n; choosing step n+1's tokens is not, because every decoding
request needs the token step n samples.
"""

from __future__ import annotations

import logging
import math
from typing import Any, NoReturn

import attrs
import trio

from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.core.kv_batch import KVResult
from trioserve.engine.core.latency_model import LatencyModel, StepShape
from trioserve.engine.runtime.step_plan import StepPlan
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.core.scheduler import SchedulerOutput
from trioserve.engine.core.sequence import FinishReason, Request
from trioserve.engine.core.slo_policy import SloPolicy, next_token_deadline
from trioserve.engine.runtime.model_runner import RunnerOutput
from trioserve.engine.sampling.grammar import MaskFill

from .admission import AdmissionQueue
from .boundary import StepBoundary
from .concurrency import AdaptiveConcurrency
from .deadlines import Deadlines
from .delivery import Delivery
from .errors import WorkerLost
from .failures import output_failure, step_failure
from .messages import Abort, AddRequest, Allocate, RunStep, StepDone, StepFailed, StepMask
from .quarantine import Quarantine
from .slo_admission import StepInFlight, admission_order
from .statistics import RateMeter, SchedulerActorStatistics, estimate_retry_after

__all__ = ["SchedulerActor"]

log = logging.getLogger(__name__)

_NO_OUTPUT = RunnerOutput(sampled={}, logprobs={})


class SchedulerActor:
    """Drives ``core`` (its scheduler, detokenizers and sampling states),
    taking requests from ``admission``.

    ``max_ready``: waiting requests the core holds before admission stops
    pulling (default ``max_num_seqs``). ``max_live``: requests it holds at
    all, paused ones included (default ``2 * max_num_seqs``).
    ``max_urgent``: with the slo policy, how many more than both it may
    take for requests whose first token is at risk behind them (default
    ``max_num_seqs``; 0 with another policy): ``_take_urgent``.
    ``concurrency``: the adaptive running limit, if on. A reader may fall
    ``core.config.max_buffered_outputs`` outputs behind before its sequence
    is paused.
    """

    @classmethod
    def from_config(cls, core: EngineCore, admission: AdmissionQueue) -> SchedulerActor:
        """The scheduler actor of ``core``, with adaptive concurrency when
        its configuration asks for it."""
        config = core.config
        concurrency = None
        if config.adaptive_concurrency:
            concurrency = AdaptiveConcurrency(max_limit=config.max_num_seqs, target=config.target_tpot_ms / 1000)
        return cls(core, admission, concurrency=concurrency)

    def __init__(
        self,
        core: EngineCore,
        admission: AdmissionQueue,
        *,
        max_ready: int | None = None,
        max_live: int | None = None,
        max_urgent: int | None = None,
        rate_window: float = 10.0,
        concurrency: AdaptiveConcurrency | None = None,
    ) -> None:
        self.core = core
        self.concurrency = concurrency
        self.admission = admission
        num_seqs = core.scheduler.max_num_seqs
        self.max_ready = max_ready or num_seqs
        self.max_live = max_live or 2 * num_seqs
        slo = isinstance(core.scheduler.policy, SloPolicy)
        self.max_urgent = (num_seqs if max_urgent is None else max_urgent) if slo else 0
        # Each request sends at most one Abort, and one Resume per Paused,
        # and only while this actor holds it (queued or live): see
        # docs/architecture.md. Twice that leaves room for stale messages.
        self.control_capacity = 4 * (admission.max_requests + self.max_live + self.max_urgent) + 16
        now = trio.current_time()
        self._deadlines = Deadlines()
        self._delivery = Delivery(
            core.config.max_buffered_outputs, self._deadlines, RateMeter(rate_window, now), on_close=self._made_room
        )
        self._routes = self._delivery.routes  # the same dict: the delivery changes it, the step loop reads it
        self._quarantine = Quarantine()
        self._boundary = StepBoundary(core, admission, self._delivery, self._deadlines, self._quarantine, self.retry_after)
        self._input_closed = False
        self._release_needed = False
        self._wakeup = trio.Event()
        self._room = trio.Event()
        self._stopped = trio.Event()
        self._num_steps = 0
        self._prompt_rate = RateMeter(rate_window, now)
        self._generation_rate = RateMeter(rate_window, now)
        self._total_prompt = 0
        self._total_generation = 0
        self._nursery: trio.Nursery | None = None
        self._num_worker_recoveries = 0  # steps failed with WorkerLost: all running requests recomputed
        # This engine's step-cost law, learned from its own steps (issue #44):
        # SLO admission predicts with it (actors/slo_admission.py), and the
        # policy, built-in or a plugin's, schedules with the same one
        # (engine/core/scheduling_policy.py): the core's, fed here.
        self.latency: LatencyModel = core.latency
        if slo:
            admission.order = admission_order  # the queue hands over by deadline too
            admission.on_put = self._made_room  # a request to take past the bound, maybe
        self._cycle_start = now  # when the step being run began to be planned
        self._plan_in_flight: StepPlan | None = None  # the step being run
        self._proposed: KVBatch | None = None  # the step being planned: the pool's answer awaited

    # -- the actor --------------------------------------------------------------

    async def run(
        self,
        *,
        allocator: trio.MemorySendChannel[Allocate],
        kv_results: trio.MemoryReceiveChannel[KVResult],
        executor: trio.MemorySendChannel[RunStep | StepMask],
        step_results: trio.MemoryReceiveChannel[StepDone | StepFailed],
        task_status: trio.TaskStatus[trio.MemorySendChannel[Any]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until the admission queue is closed and every request has
        been delivered; then close the allocator's and executor's inboxes,
        which ends them. ``task_status.started`` hands out the control
        channel's send end (for ``Abort``, ``Resume`` and ``AbortAll``).
        On the way out, requests still queued or held get ``EngineClosed``."""
        control_send, control = trio.open_memory_channel[Any](self.control_capacity)
        try:
            with control, allocator, kv_results, executor, step_results:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._control_loop, control)
                    nursery.start_soon(self._admission_loop)
                    task_status.started(control_send)
                    await self._step_loop(allocator, kv_results, executor, step_results)
                    nursery.cancel_scope.cancel()
        finally:
            self.admission.close_receiver()
            self._delivery.close_all()
            self._stopped.set()

    @property
    def stopped(self) -> bool:
        """``run`` has returned (or raised)."""
        return self._stopped.is_set()

    async def wait_stopped(self) -> None:
        """Wait until ``run`` has returned (or raised)."""
        await self._stopped.wait()

    async def _control_loop(self, control: trio.MemoryReceiveChannel[Any]) -> None:
        async for message in control:
            self._boundary.put(message)
            self._wakeup.set()

    async def _admission_loop(self) -> None:
        while True:
            while not self._has_room():
                if self._take_urgent():
                    continue
                await self._room.wait()
                self._room = trio.Event()
            self._boundary.receiving = True
            try:
                message = await self.admission.receive()
                self._boundary.receiving = False
                self._admit(message)
                # Take what else is queued without a checkpoint per message,
                # so requests that arrive together start in the same step.
                while self._has_room():
                    try:
                        message = self.admission.receive_nowait()
                    except trio.WouldBlock:
                        break
                    self._admit(message)
            except (trio.EndOfChannel, trio.ClosedResourceError):
                self._input_closed = True
                self._wakeup.set()
                return
            finally:
                self._boundary.receiving = False

    def _admit(self, message: AddRequest) -> None:
        if self._boundary.admit(message):
            self._wakeup.set()

    def _has_room(self) -> bool:
        return self.core.scheduler.num_waiting < self.max_ready and len(self._routes) < self.max_live

    def _made_room(self) -> None:
        """A route closed (or, with the slo policy, a request was queued):
        the admission loop may take one more."""
        self._room.set()

    def _take_urgent(self) -> bool:
        """With the slo policy and the bound reached, take the admission
        queue's head (the earliest first-token deadline of the best class)
        into the core when the policy runs it before a request the core
        holds waiting (held there, that request would take the next free
        slot and the bound would invert the policy's order: interactive
        requests predicted to wait for one slot waited for two or three
        behind batch prompts), or when its first token is at risk: the
        policy would preempt a running request with slack for its slot
        (``slot_victim``), which it cannot do for a request it does not
        see. At most ``max_urgent`` past ``max_ready`` and ``max_live``, so
        the queue's bound still holds the backlog back. Asked when a
        request is queued or a route closes. True if one was taken."""
        if not self.max_urgent or not self.admission.num_queued:
            return False
        scheduler = self.core.scheduler
        if scheduler.num_waiting >= self.max_ready + self.max_urgent or len(self._routes) >= self.max_live + self.max_urgent:
            return False
        head = self.admission.peek()
        assert head is not None
        key = admission_order(head)
        held = [(r.priority, next_token_deadline(r)) for r in scheduler.waiting_requests]
        if any(key < h for h in held):
            self._admit(self.admission.receive_nowait())
            return True
        if math.isinf(key[-1]):
            return False  # no TTFT target: nothing is at risk
        if held:
            return False  # the policy would run a held request first: that one preempts, if any
        own = Request(
            request_id=head.request_id,
            prompt_token_ids=list(head.prompt_token_ids),
            sampling_params=head.params,
            priority=head.priority,
            arrival_time=head.arrival_time,
            objectives=head.request.objectives,
        )
        if scheduler.slot_victim_for(own) is None:
            return False
        self._admit(self.admission.receive_nowait())
        return True

    async def _step_loop(
        self,
        allocator: trio.MemorySendChannel[Allocate],
        kv_results: trio.MemoryReceiveChannel[KVResult],
        executor: trio.MemorySendChannel[RunStep | StepMask],
        step_results: trio.MemoryReceiveChannel[StepDone | StepFailed],
    ) -> None:
        pending: list[RequestOutput] = []  # the last step's outputs, delivered during the next
        while True:
            if self._boundary.apply():
                self._release_needed = True
            if not self._has_work():
                self._deliver_all(pending)
                pending = []
                if self._input_closed and not self._routes and not self.core.has_unfinished():
                    return
                if self.concurrency is not None:
                    self.concurrency.idle()
                self.core.release_memory()  # idle: the heap's free pages go back (engine/heap_trim.py)
                await self._wait_for_news()
                continue
            self._cycle_start = trio.current_time()
            plan, fill = await self._plan(allocator, kv_results)
            if plan.chunks:
                self._num_steps += 1
                self._plan_in_flight = plan.plan
                try:
                    await executor.send(RunStep(self._num_steps, plan.plan))
                    if fill is not None:
                        # The forward does not need the mask, only the sampling:
                        # filled beside it, off the event loop.
                        filled = await trio.to_thread.run_sync(fill.run)
                        await executor.send(StepMask(self._num_steps, self.core.mask_filled(filled)))
                    self._deliver_all(pending)
                    reply = await step_results.receive()
                except (trio.EndOfChannel, trio.BrokenResourceError):
                    await self._lost("executor")
                pending = self._process(plan, reply)
                self._fail_detokenized()
                if any(output.finish_reason is not None for output in pending):
                    self._release_needed = True  # their blocks go back with the next batch
            else:
                self._deliver_all(pending)
                pending = self.core.process_output(plan, _NO_OUTPUT)
                self._fail_detokenized()
                if not plan.finished and not plan.preempted:
                    # Nothing could run and nothing changed: wait for news
                    # rather than plan the same empty step again.
                    self._deliver_all(pending)
                    pending = []
                    await self._wait_for_news()
                else:
                    await trio.lowlevel.checkpoint()

    @staticmethod
    async def _lost(actor: str) -> NoReturn:
        # A crashed actor closes its channels as it unwinds, and its
        # exception then cancels the engine's nursery: this checkpoint
        # delivers that cancel, so the crash is the one error reported.
        await trio.lowlevel.checkpoint()
        raise RuntimeError(f"the {actor} actor ended while the scheduler needed it")

    async def _wait_for_news(self) -> None:
        """Sleep until a message arrives, a request is admitted or the
        earliest deadline or queue deadline passes."""
        deadline = self._deadlines.next_time()
        max_queue_time = self.core.config.max_queue_time
        if max_queue_time is not None:
            # A request queued while we sleep expires no sooner than this.
            queued = self.admission.next_queue_deadline()
            deadline = min(deadline, trio.current_time() + max_queue_time, math.inf if queued is None else queued)
        with trio.move_on_at(deadline):
            await self._wakeup.wait()
        self._wakeup = trio.Event()

    def _has_work(self) -> bool:
        scheduler = self.core.scheduler
        return self._release_needed or scheduler.num_running > 0 or scheduler.num_waiting > 0

    async def _plan(
        self, allocator: trio.MemorySendChannel[Allocate], kv_results: trio.MemoryReceiveChannel[KVResult]
    ) -> tuple[SchedulerOutput, MaskFill | None]:
        """The next step's plan, and the fill of its constrained rows' mask
        (None if it has none: then the plan does not await one)."""
        scheduler = self.core.scheduler
        batch = scheduler.propose()
        self._proposed = batch
        self._release_needed = False
        sent = self._quarantine.filter(batch) if self._quarantine else batch
        if sent.commits or sent.frees or sent.allocations:
            try:
                await allocator.send(Allocate(sent))
                result = await kv_results.receive()
            except (trio.EndOfChannel, trio.BrokenResourceError):
                await self._lost("allocator")
        else:
            result = KVResult(block_tables=(), num_cached_tokens=(), budget=scheduler.statistics().kv)
        self._proposed = None
        plan = scheduler.finalize(batch, result)
        # Constrained rows' allowed tokens, for all of them at once: filled
        # while the step runs (the step loop), so the plan goes without.
        fill = self.core.mask_fill(plan)
        if fill is not None:
            plan = attrs.evolve(plan, plan=attrs.evolve(plan.plan, awaits_mask=True))
        if self._has_room():
            self._room.set()
        return plan, fill

    def step_in_flight(self) -> StepInFlight:
        """The step cycle running now (none between steps): the seconds it
        still needs, as the latency model expects of a step that has run
        this long (``LatencyModel.seconds_left``), and the tokens it
        computes per request. A request arriving now
        starts after it, on the state it leaves: SLO admission predicts so."""
        elapsed = trio.current_time() - self._cycle_start
        plan = self._plan_in_flight
        if plan is not None:
            left = self.latency.seconds_left(StepShape.of_plan(plan), elapsed)
            return StepInFlight(left, {chunk.request_id: chunk.num_tokens for chunk in plan.chunks})
        if self._proposed is not None and self._proposed.allocations:
            # Planned already, the pool's answer awaited: a request arriving
            # now is not in this step and waits for it, though no step runs
            # yet (the breakdown at 10 req/s of the bench's mix showed such
            # requests predicted into a batch prompt's step they waited out).
            allocations = self._proposed.allocations
            left = self.latency.seconds_left(StepShape.of_allocations(allocations), elapsed)
            return StepInFlight(left, {a.request_id: a.num_new_tokens for a in allocations})
        return StepInFlight()

    def _process(self, plan: SchedulerOutput, reply: StepDone | StepFailed) -> list[RequestOutput]:
        self._plan_in_flight = None
        if isinstance(reply, StepFailed) and isinstance(reply.error, WorkerLost):
            return self._recompute_all(plan, reply.error)
        if isinstance(reply, StepFailed):
            if reply.released is not None:
                # Hung: the step may still write its blocks until it returns.
                self._quarantine.hold(plan, reply.released)
                assert self._nursery is not None
                self._nursery.start_soon(self._wait_released, reply.released)
            for request_id in {self.core.parent_of(c.request_id) for c in plan.chunks}:
                if request_id is None:
                    continue
                route = self._routes.get(request_id)
                if route is not None:
                    self._delivery.fail(route, step_failure(request_id, reply.error))
                self.core.abort(request_id, FinishReason.ERROR)
                self._release_needed = True
            return self.core.process_output(plan, _NO_OUTPUT)
        now = trio.current_time()
        # Decode chunks compute the token sampled last step; the rest is prefill.
        decodes = sum(1 for c in plan.chunks if c.is_decode)
        # Speculating chunks: their proposals are not prompt, their accepted tokens are generated.
        drafts = sum(c.num_draft_tokens for c in plan.chunks)
        generated = len(reply.output.sampled) + sum(map(len, reply.output.extra_tokens.values()))
        self._prompt_rate.add(now, plan.num_batched_tokens - decodes - drafts)
        self._generation_rate.add(now, generated)
        self._total_prompt += plan.num_batched_tokens - decodes - drafts
        self._total_generation += generated
        outputs = self.core.process_output(plan, reply.output)
        # The latency model learns the whole step cycle, not only the
        # model's step: planning, the allocator's round trip and reading
        # the outputs delay a first token as much (actors/slo_admission.py).
        self.latency.observe_plan(plan.plan, trio.current_time() - self._cycle_start)
        if self.concurrency is not None:
            scheduler = self.core.scheduler
            self.concurrency.observe(
                now,
                decoding=decodes > 0,
                num_running=len(plan.chunks),
                num_waiting=scheduler.num_waiting + self.admission.num_queued,
            )
            scheduler.limit_running(self.concurrency.limit)
        return outputs

    # -- faults: failed and hung steps, the detokenizer ----------------------------

    def _recompute_all(self, plan: SchedulerOutput, error: WorkerLost) -> list[RequestOutput]:
        """The worker process died and its KV cache with it: every running
        request goes back to waiting, to recompute its prompt and output on
        the next worker (the preemption path); nothing fails. Their blocks
        are freed, and the pool forgets its prefix cache, in the next batch."""
        preempted = self.core.scheduler.recompute_all()
        self._num_worker_recoveries += 1
        self._release_needed = True
        log.warning("%s: %d running requests recompute on the next worker", error, len(preempted))
        return self.core.process_output(plan, _NO_OUTPUT)

    async def _wait_released(self, released: trio.Event) -> None:
        await released.wait()
        self._release_needed = True  # the withheld frees go with the next batch
        self._wakeup.set()

    def _fail_detokenized(self) -> None:
        """Tell the requests whose detokenizer or grammar failed (the core has ended them)."""
        for request_id, error in self.core.take_failures().items():
            route = self._routes.get(request_id)
            if route is None:
                continue
            self._delivery.fail(route, output_failure(request_id, error))
            self._release_needed = True

    @property
    def num_quarantined_blocks(self) -> int:
        """Blocks held for hung steps (until their frees reach the pool)."""
        return self._quarantine.num_blocks

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Deliver the last step's outputs (delivery.py)."""
        for request_id in self._delivery.deliver(outputs):
            # Its reader is gone without an abort reaching us (it raced the
            # admission): end the request here.
            self._boundary.put(Abort(request_id))

    # -- statistics ---------------------------------------------------------------

    def statistics(self) -> SchedulerActorStatistics:
        now = trio.current_time()
        core = self.core.scheduler.statistics()
        counts = self._delivery.counts
        return SchedulerActorStatistics(
            num_waiting=core.num_waiting,
            num_running=core.num_running,
            num_paused=core.num_paused,
            num_live=len(self._routes),
            num_deadlines=len(self._deadlines),
            num_steps=self._num_steps,
            num_preemptions=core.num_preemptions,
            num_finished=counts["finished"],
            num_aborted=counts["aborted"],
            num_deadline_exceeded=counts["deadline"],
            num_failed=counts["failed"],
            prompt_tokens_per_s=self._prompt_rate.rate(now),
            generation_tokens_per_s=self._generation_rate.rate(now),
            requests_per_s=self._delivery.request_rate.rate(now),
            total_prompt_tokens=self._total_prompt,
            total_generation_tokens=self._total_generation,
            num_queue_timeouts=counts["queue_timeout"],
            num_quarantined_blocks=self.num_quarantined_blocks,
            num_tokenizer_errors=self.core.num_tokenizer_errors,
            num_detokenizer_errors=self.core.num_detokenizer_errors,
            last_fault=self.core.last_fault,
            num_draft_tokens=core.num_draft_tokens,
            num_accepted_tokens=core.num_accepted_tokens,
        )

    def retry_after(self) -> float:
        """Seconds until the admission queue has room, estimated from its
        length and the recent completion rate (1 s before there is a
        rate), in [0.1, 60]: what a refused or dropped request is told."""
        return estimate_retry_after(self.admission.num_queued, self._delivery.request_rate.rate(trio.current_time()))
