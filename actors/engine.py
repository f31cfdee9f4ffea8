"""``open_engine`` and ``Engine``: the actors' public face.

``async with open_engine(config) as engine:`` builds the engine core, starts
the allocator, executor and scheduler actors in a nursery (each with
``nursery.start``, so each is ready before the next starts) and, on exit,
shuts them down in order: admission closes, what is left is aborted, the
step in flight finishes, the scheduler closes the executor's and the
allocator's inboxes, and they end. If that takes longer than
``shutdown_timeout``, the nursery is cancelled. An exception in the body, or
the crash of an actor, cancels the nursery at once; the crash propagates
out of ``open_engine`` in an exception group.
"""

from __future__ import annotations

import collections
import functools
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from trioserve.engine.config import EngineConfig
from trioserve.engine.engine_core import EngineCore, Prompt
from trioserve.engine.kv_batch import KVResult
from trioserve.engine.loader import LoadedModel
from trioserve.engine.outputs import RequestOutput
from trioserve.engine.sampling_params import SamplingParams
from trioserve.engine.sequence import FinishReason
from trioserve.engine.step_thread import StepThread

from .admission import AdmissionQueue
from .allocator import AllocatorActor
from .concurrency import AdaptiveConcurrency
from .degradation import Degradation
from .errors import DuplicateRequestError, EngineClosed, EngineOverloaded
from .executor import Executor, ModelExecutor
from .messages import AbortAll, AddRequest, StepDone, StepFailed
from .request import RequestActor
from .scheduler import SchedulerActor
from .step_calls import run_in_step_thread
from .statistics import EngineStatistics, OverloadStatistics, SchedulerActorStatistics

DEFAULT_MAX_BUFFERED_OUTPUTS = 64


class RequestStream:
    """The output stream of a request queued by ``generate_nowait``.

    Iterate it (``async for``) and close it: ``async with`` or ``aclose()``,
    or iterate to the end. A cancel or error inside an iteration closes it,
    which aborts the request. A stream dropped unclosed is closed by the
    engine at its next call (its request is aborted then).
    """

    def __init__(self, actor: RequestActor, orphans: collections.deque[RequestActor]) -> None:
        self._actor = actor
        self._orphans = orphans
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._actor.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            output = await self._actor.receive()
        except BaseException:
            self.close()
            raise
        if output is None:
            self.close()
            raise StopAsyncIteration
        return output

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._actor.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Only a deque append here: trio objects are not touched from a
        # finalizer. The engine closes orphans at its next step or call.
        if not getattr(self, "_closed", True):
            self._orphans.append(self._actor)


class Engine:
    """The running engine; made by ``open_engine``, not directly."""

    def __init__(
        self,
        core: EngineCore,
        admission: AdmissionQueue,
        allocator: AllocatorActor,
        executor: Executor,
        *,
        max_buffered_outputs: int,
    ) -> None:
        self.core = core
        self._admission = admission
        self._allocator = allocator
        self._executor = executor
        self._max_buffered_outputs = max_buffered_outputs
        self._scheduler: SchedulerActor | None = None
        self._control: trio.MemorySendChannel[Any] | None = None
        self._nursery: trio.Nursery | None = None
        self._scheduler_done = trio.Event()
        # Request id -> its actor; None while the actor is closed but the
        # scheduler still holds the request (the id stays reserved).
        self._live: dict[str, RequestActor | None] = {}
        self._orphans: collections.deque[RequestActor] = collections.deque()
        self._num_refused = 0
        self._num_deadline_unqueued = 0
        self._num_cancelled_unqueued = 0
        self._num_queue_timeouts_unqueued = 0
        self._num_accepted = 0
        self._degradation = Degradation(core.config.degradation)

    # -- facts the web layer needs ------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def model_config(self) -> Any:
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def closed(self) -> bool:
        """Admission is closed (``drain`` or shutdown)."""
        return self._admission.closed

    # -- requests -------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
        final_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Generate for ``prompt`` (text, token ids or chat messages); yield
        each completion's deltas as they come, coalesced when the reader is
        slower than the engine, or with ``final_only`` one cumulative output
        per completion at the end.

        Waits for room in the admission queue. ``priority``: lower runs
        first. ``deadline`` (trio time) or ``timeout`` (seconds from now):
        when it passes the request ends with finish reason ``DEADLINE``.
        Leaving the loop early, or a cancel, aborts the request. Raises
        ``InvalidRequestError`` (also ``DuplicateRequestError``,
        ``RequestTooLongError``), ``RequestFailed`` if its model step
        failed, ``EngineClosed`` once the engine stops taking requests,
        ``QueueTimeout`` if it waited longer than ``max_queue_time`` before
        any compute and ``RequestShed`` if a request of higher priority took
        its place in the queue (both before any output). Under pressure a
        low-priority request may get a smaller ``max_tokens``
        (``DegradationPolicy``).
        """
        request = self._new_request(prompt, params, request_id, priority, deadline, timeout, final_only)
        try:
            await request.submit()
            if request.submitted:
                self._num_accepted += 1
            while (output := await request.receive()) is not None:
                yield output
        finally:
            request.close()

    def generate_nowait(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
        final_only: bool = False,
    ) -> RequestStream:
        """Like ``generate``, but queue the request now or raise
        ``EngineOverloaded`` (with ``retry_after``) at once. When the queue
        is full, a request displaces a queued one of strictly lower priority
        instead of being refused; under pressure ``n > 1`` and many top
        logprobs are refused first (``ExpensiveRequestRefused``); see
        ``DegradationPolicy``."""
        request = self._new_request(prompt, params, request_id, priority, deadline, timeout, final_only)
        try:
            self._degradation.check_expensive(request.params, self._admission.pressure, self._retry_after())
            request.submit_nowait()
        except BaseException as exc:
            request.close()
            if isinstance(exc, EngineOverloaded):
                self._num_refused += 1
            raise
        self._num_accepted += 1
        return RequestStream(request, self._orphans)

    def abort(self, request_id: str) -> bool:
        """End a request: queued or live, it finishes with ``ABORT`` at the
        next step boundary. False if there is no such request."""
        self._reap()
        actor = self._live.get(request_id)
        return actor is not None and actor.abort()

    def _new_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        deadline: float | None,
        timeout: float | None,
        final_only: bool,
    ) -> RequestActor:
        self._reap()
        if self._control is None or self._admission.closed:
            raise EngineClosed("the engine is not taking requests")
        # The one validation of a request (the core and the scheduler trust it).
        request_id = uuid.uuid4().hex if request_id is None else request_id
        new = self.core.validate(request_id, prompt, params, priority=priority)
        params = self._degradation.cap(new.params, priority, self._admission.pressure)
        prompt_ids = new.prompt_token_ids
        if timeout is not None:
            after = trio.current_time() + timeout
            deadline = after if deadline is None else min(deadline, after)
        if request_id in self._live:
            raise DuplicateRequestError(request_id)
        max_queue_time = self.core.config.max_queue_time
        actor = RequestActor(
            queue_deadline=None if max_queue_time is None else trio.current_time() + max_queue_time,
            on_full=self._shed,
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            priority=priority,
            deadline=deadline,
            final_only=final_only,
            max_buffered_outputs=self._max_buffered_outputs,
            admission=self._admission,
            control=self._control,
            retry_after=self._retry_after,
            on_close=self._on_request_closed,
        )
        self._live[request_id] = actor
        return actor

    def _on_request_closed(self, actor: RequestActor) -> None:
        if actor.held:
            self._live[actor.request_id] = None
        else:
            self._live.pop(actor.request_id, None)
        # Ended while waiting for room: the scheduler never saw it.
        if actor.unqueued_reason is FinishReason.DEADLINE:
            self._num_deadline_unqueued += 1
        elif actor.unqueued_reason is FinishReason.QUEUE_TIMEOUT:
            self._num_queue_timeouts_unqueued += 1
        elif actor.unqueued_reason is not None:
            self._num_cancelled_unqueued += 1

    def _on_forget(self, request_id: str) -> None:
        if request_id in self._live and self._live[request_id] is None:
            del self._live[request_id]

    def _reap(self) -> None:
        while self._orphans:
            self._orphans.popleft().close()

    def _shed(self, message: AddRequest) -> None:
        """The queue is full: queue ``message`` in place of a request of
        lower priority, or raise ``trio.WouldBlock``."""
        victim = self._degradation.shed(self._admission, message, self._retry_after())
        self._on_forget(victim.request_id)  # its id is free if its reader had closed

    def _retry_after(self) -> float:
        """Seconds until the queue has room, estimated from its length and
        the recent completion rate (1 s before there is a rate)."""
        assert self._scheduler is not None
        rate = self._scheduler.completion_rate()
        if rate <= 0:
            return 1.0
        return min(60.0, max(0.1, (self._admission.num_queued + 1) / rate))

    # -- the engine -------------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        """Queue lengths, running, KV usage, prefix hit rate, throughput,
        and what overload control did."""
        self._reap()
        assert self._scheduler is not None
        scheduler = self._scheduler.statistics()
        return EngineStatistics(
            num_queued=self._admission.num_queued,
            num_queued_tokens=self._admission.num_queued_tokens,
            num_waiting_to_queue=self._admission.num_waiting_to_send,
            max_queued_requests=self._admission.max_requests,
            max_queued_tokens=self._admission.max_tokens,
            num_refused=self._num_refused,
            num_reserved_ids=len(self._live),
            num_deadline_unqueued=self._num_deadline_unqueued,
            num_cancelled_unqueued=self._num_cancelled_unqueued,
            num_accepted=self._num_accepted,
            scheduler=scheduler,
            allocator=self._allocator.statistics(),
            executor=self._executor.statistics(),
            overload=self._overload_statistics(scheduler),
        )

    def _overload_statistics(self, scheduler: SchedulerActorStatistics) -> OverloadStatistics:
        assert self._scheduler is not None
        concurrency = self._scheduler.concurrency
        degradation = self._degradation
        return OverloadStatistics(
            pressure=self._admission.pressure,
            concurrency_limit=self.core.scheduler.running_limit,
            tpot_p90=None if concurrency is None else concurrency.last_p90,
            num_queue_timeouts=scheduler.num_queue_timeouts + self._num_queue_timeouts_unqueued,
            num_shed=degradation.num_shed,
            num_capped=degradation.num_capped,
            num_refused_expensive=degradation.num_refused,
            num_limit_decreases=0 if concurrency is None else concurrency.num_decreases,
            num_limit_increases=0 if concurrency is None else concurrency.num_increases,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the scheduler's queues or block tables
        are inconsistent, or differ from the allocator's pool. A debugging
        aid for tests: call it while no step is being planned (the engine
        idle, or from a task between its own calls)."""
        self.core.scheduler.check_invariants()
        self._allocator.check_invariants(self.core.scheduler.block_holders())

    async def drain(self, timeout: float) -> int:
        """Stop admission; let queued and running requests finish for up to
        ``timeout`` seconds, then abort the rest. Returns how many were
        aborted. The engine serves nothing afterwards."""
        self._reap()
        self._admission.close()
        with trio.move_on_after(timeout):
            await self._scheduler_done.wait()
        if self._scheduler_done.is_set():
            return 0
        assert self._scheduler is not None
        before = self._scheduler.statistics().num_aborted
        self._abort_all()
        await self._scheduler_done.wait()  # one step at most
        return self._scheduler.statistics().num_aborted - before

    def _abort_all(self) -> None:
        if self._control is not None:
            try:
                self._control.send_nowait(AbortAll())
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.WouldBlock):
                pass  # the scheduler is gone already (or, impossibly, busy with more than it can hold)

    async def _shutdown(self, timeout: float) -> None:
        self._reap()
        self._admission.close()
        self._abort_all()
        with trio.move_on_after(timeout):
            await self._scheduler_done.wait()
        if not self._scheduler_done.is_set() and self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _run_scheduler(
        self, scheduler: SchedulerActor, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED, **channels: Any
    ) -> None:
        try:
            await scheduler.run(task_status=task_status, **channels)
        finally:
            self._scheduler_done.set()


@asynccontextmanager
async def open_engine(
    config: EngineConfig,
    *,
    loaded: LoadedModel | None = None,
    executor: Callable[[EngineCore], Executor] | None = None,
    max_buffered_outputs: int = DEFAULT_MAX_BUFFERED_OUTPUTS,
    shutdown_timeout: float = 30.0,
) -> AsyncIterator[Engine]:
    """Start an engine on ``loaded`` (else load ``config.model`` on the
    engine's step thread) and yield it; see the module docstring for start
    and shutdown.

    ``executor(core)`` makes the executor actor (default: ``ModelExecutor``
    on the core's runner; tests pass a ``FakeExecutor``).
    ``max_buffered_outputs``: outputs a request's reader may fall behind
    before its sequence is paused (preempted, output kept) until it reads.
    """
    if max_buffered_outputs < 1:
        raise ValueError("max_buffered_outputs must be >= 1")
    # Loading and every step run on this one thread: see step_thread.py.
    step_thread = StepThread(config.num_threads)
    try:
        # The core gets no pool of its own: the allocator actor owns it, and
        # the core reaches it only with KVBatch / KVResult messages.
        if loaded is None:
            make_core = functools.partial(EngineCore.from_config, config, own_pool=False)
        else:
            make_core = functools.partial(EngineCore, loaded, config, own_pool=False)
        core = await run_in_step_thread(step_thread, make_core)
        admission = AdmissionQueue(config.max_queued_requests, config.max_queued_tokens)
        allocator = AllocatorActor(core.new_block_manager())
        if executor is None:
            executor_actor: Executor = ModelExecutor(core.runner, step_thread, watchdog_timeout=config.watchdog_timeout)
        else:
            executor_actor = executor(core)
        engine = Engine(core, admission, allocator, executor_actor, max_buffered_outputs=max_buffered_outputs)
        concurrency = None
        if config.adaptive_concurrency:
            concurrency = AdaptiveConcurrency(max_limit=config.max_num_seqs, target=config.target_tpot_ms / 1000)
        scheduler = SchedulerActor(
            core,
            admission,
            max_buffered_outputs=max_buffered_outputs,
            on_forget=engine._on_forget,
            before_step=engine._reap,  # streams dropped unclosed are aborted within a step
            concurrency=concurrency,
            retry_after=engine._retry_after,
        )
        engine._scheduler = scheduler
        kv_send, kv_receive = trio.open_memory_channel[KVResult](1)
        step_send, step_receive = trio.open_memory_channel[StepDone | StepFailed](1)
        async with trio.open_nursery() as nursery:
            engine._nursery = nursery
            allocator_inbox = await nursery.start(allocator.run, kv_send)
            executor_inbox = await nursery.start(executor_actor.run, step_send)
            engine._control = await nursery.start(
                functools.partial(
                    engine._run_scheduler,
                    scheduler,
                    allocator=allocator_inbox,
                    kv_results=kv_receive,
                    executor=executor_inbox,
                    step_results=step_receive,
                )
            )
            try:
                yield engine
            except BaseException:
                admission.close()
                nursery.cancel_scope.cancel()
                raise
            await engine._shutdown(shutdown_timeout)
            engine._control.close()
    finally:
        step_thread.close()  # steps are not cancellable: none is in flight here
