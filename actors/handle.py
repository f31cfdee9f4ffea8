"""``Engine``: the callers' handle on a running engine (``open_engine``
makes it, engine.py).

Each request runs its request actor in the caller's task, and talks to the
scheduler only through the admission queue, the control channel and the
request's output channel. Nothing in the scheduler calls back into the
``Engine``: a request id is in use while its actor is open or the engine
holds the request's output channel open (request_ids.py), and a stream
dropped unclosed is closed by its own finalizer (``RequestStream``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.core.latency_model import LatencyModel
from trioserve.engine.latency_objectives import NO_OBJECTIVES, LatencyObjectives
from trioserve.engine.core.new_request import NewRequest, RequestInput
from trioserve.engine.loading.generation_config import SamplingDefaults
from trioserve.engine.lora.adapter import LoraAdapter
from trioserve.engine.models.projections import ProjectionChoice
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.sampling.pooling import PoolingParams
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.core.sequence import FinishReason

from .admission import AdmissionQueue
from .allocator import AllocatorActor
from .degradation import Degradation
from .errors import DuplicateRequestError, EngineClosed, EngineOverloaded
from .executor import Executor
from .slo_admission import (
    SloDecision,
    SloRefused,
    arrivals_horizon,
    cached_prefix,
    decide,
    output_budget,
    predict_on,
)
from .slo_arrivals import RecentArrivals
from .messages import AbortAll, AddRequest, LoadLora, UnloadLora
from .request import RequestActor
from .stream import RequestStream
from .request_ids import RequestIds
from .scheduler import SchedulerActor
from .statistics import EngineStatistics, OverloadStatistics, ReplicaStatistics, SchedulerActorStatistics

__all__ = ["Engine"]


class Engine:
    """The running engine; made by ``open_engine``, not directly.

    ``scheduler`` is the running scheduler actor, taking requests from
    ``admission``; ``control`` is the send end of its control channel.
    ``allocator`` and ``executor`` are asked only for their statistics.
    ``sampling_defaults`` fill the sampling fields a request leaves unset
    (``SamplingParams.with_defaults``), here at the edge, once: the core
    and the scheduler see every field set.
    """

    def __init__(
        self,
        core: EngineCore,
        admission: AdmissionQueue,
        scheduler: SchedulerActor,
        control: trio.MemorySendChannel[Any],
        *,
        allocator: AllocatorActor,
        executor: Executor,
        sampling_defaults: SamplingDefaults,
    ) -> None:
        self.core = core
        self.sampling_defaults = sampling_defaults
        self._admission = admission
        self._scheduler = scheduler
        self._control = control
        self._allocator = allocator
        self._executor = executor
        self._token = trio.lowlevel.current_trio_token()  # for the finalizers of dropped streams
        self._ids = RequestIds()
        self._num_refused = 0
        self._arrivals = RecentArrivals()  # SLO admission's: the classes that will pass a waiting request
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
    def projection_choice(self) -> ProjectionChoice:
        """How the model runs its projections: with ``worker_mode="process"``
        as the worker process reported once it loaded the model (the server
        holds no weights and times no kernel), else the loaded model's."""
        return self._projection_choice_of(self._executor, self.core)

    @staticmethod
    def _projection_choice_of(executor: Any, core: EngineCore) -> ProjectionChoice:
        """What ``executor``'s worker process reported, else ``core``'s loaded model's."""
        reported = getattr(executor, "worker_projection_choice", None)
        return reported if reported is not None else core.projection_choice

    @property
    def closed(self) -> bool:
        """Admission is closed (``drain`` or shutdown)."""
        return self._admission.closed

    # -- LoRA adapters (engine/lora), changed between steps ---------------------------

    def lora_adapters(self) -> tuple[LoraAdapter, ...]:
        """The adapters loaded now, in loading order (none without LoRA)."""
        return () if self.core.lora is None else self.core.lora.adapters()

    async def load_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoraAdapter:
        """Read the PEFT adapter at ``path`` (in a worker thread) and serve
        it as ``name`` from the next step boundary on. Raises ``LoraError``
        naming the field at fault: an adapter that does not fit the base
        model, ``max_loras`` reached, the name taken; nothing changes then."""
        adapter = await trio.to_thread.run_sync(self.core.read_lora, name, path, base_model_name)
        await self._change_lora(lambda reply: LoadLora(adapter, reply))
        return adapter

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` at the next step boundary:
        ``LoraNotFound`` if it is not loaded, ``LoraInUse`` while requests
        run with it (they finish first; unload it after)."""
        await self._change_lora(lambda reply: UnloadLora(name, reply))

    async def _change_lora(self, message: Callable[[trio.MemorySendChannel[Exception | None]], Any]) -> None:
        # The scheduler applies it between steps (actors/boundary.py) and
        # answers on a channel of one, so its send never waits.
        reply_send, reply = trio.open_memory_channel[Exception | None](1)
        with reply:
            try:
                await self._control.send(message(reply_send))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                raise EngineClosed("the engine is not running") from None
            with trio.move_on_after(self.core.config.shutdown_timeout + 60) as waited:
                error = await reply.receive()
            if waited.cancelled_caught:
                raise EngineClosed("the engine stopped before it applied the adapter change")
        if error is not None:
            raise error

    # -- requests -------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int] | Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
        final_only: bool = False,
        objectives: LatencyObjectives = NO_OBJECTIVES,
    ) -> AsyncIterator[RequestOutput]:
        """Generate for ``prompt`` (text, token ids or chat messages); yield
        each completion's deltas as they come, coalesced when the reader is
        slower than the engine, or with ``final_only`` one cumulative output
        per completion at the end.

        Waits for room in the admission queue. ``priority``: lower runs
        first. The sampling fields ``params`` leaves unset take the model's
        defaults (``sampling_defaults``). ``deadline`` (trio time) or
        ``timeout`` (seconds from now):
        when it passes the request ends with finish reason ``DEADLINE``.
        Leaving the loop early, or a cancel, aborts the request. Raises
        ``InvalidRequestError`` (also ``DuplicateRequestError``,
        ``RequestTooLongError``), ``RequestFailed`` if its model step
        failed, ``EngineClosed`` once the engine stops taking requests,
        ``QueueTimeout`` if it waited longer than ``max_queue_time`` before
        any compute and ``RequestShed`` if a request of higher priority took
        its place in the queue (both before any output). Under pressure a
        low-priority request may get a smaller ``max_tokens``
        (``DegradationPolicy``). ``objectives``: its TTFT / TPOT targets
        (``LatencyObjectives``); with ``--scheduling-policy slo`` admission
        predicts against them and refuses what cannot meet them.

        The Python API's edge: the arguments become the ``RequestInput``
        whose validators judge them (``submit`` takes one built elsewhere).
        """
        request = RequestInput(prompt, SamplingParams() if params is None else params, priority, objectives=objectives)
        async with self._submitted(request, request_id, deadline, timeout, final_only) as actor:
            while (output := await actor.receive()) is not None:
                yield output

    async def embed(
        self,
        prompt: str | Sequence[int],
        *,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> tuple[float, ...]:
        """The embedding of ``prompt`` (text or token ids): its final
        hidden states pooled as the model's config says (engine/sampling/pooling.py),
        cut to ``dimensions`` where the model allows it. Only an engine
        serving embeddings (``EngineConfig.task``) takes it.

        It goes the way ``generate`` does: it waits for room in the
        admission queue, is scheduled (and batched) with the others, and a
        cancel aborts it. ``deadline`` / ``timeout`` as there; when it
        passes, ``trio.TooSlowError``. Raises what ``generate`` raises
        (``InvalidRequestError`` naming ``model`` when this engine does not
        serve embeddings, or ``dimensions``).
        """
        request = RequestInput(prompt, SamplingParams(), priority, pooling=PoolingParams(dimensions))
        async with self._submitted(request, request_id, deadline, timeout, final_only=True) as actor:
            output = None
            while (received := await actor.receive()) is not None:
                output = received
        return embedding_of(output)

    async def submit(
        self,
        request: RequestInput,
        *,
        request_id: str | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        final_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """``generate`` for a request its edge has built and checked."""
        async with self._submitted(request, request_id, deadline, timeout, final_only) as actor:
            while (output := await actor.receive()) is not None:
                yield output

    @asynccontextmanager
    async def _submitted(
        self, request: RequestInput, request_id: str | None, deadline: float | None, timeout: float | None, final_only: bool
    ) -> AsyncIterator[RequestActor]:
        """The request's actor, queued once there is room; closed on the way out."""
        await self.prepare(request.params)
        actor = self._new_request(request, request_id, deadline, timeout, final_only)
        try:
            await actor.submit()
            if actor.submitted:
                self._num_accepted += 1
            yield actor
        finally:
            actor.close()

    async def prepare(self, params: SamplingParams | None) -> None:
        """Compile ``params.structured_output``'s grammar in a worker thread
        (cached by its kind and spec), so queuing the request does not
        compile it in the event loop. ``generate`` calls it; call it before
        ``generate_nowait``. Raises ``InvalidRequestError`` naming the field
        if the schema, regex or grammar is unusable."""
        constraint = None if params is None else params.structured_output
        compiler = self.core.grammars.compiler
        if constraint is not None and compiler.cached(constraint) is None:
            await trio.to_thread.run_sync(compiler.compile, constraint)

    def generate_nowait(
        self,
        prompt: str | Sequence[int] | Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
        final_only: bool = False,
        objectives: LatencyObjectives = NO_OBJECTIVES,
    ) -> RequestStream:
        """Like ``generate``, but queue the request now or raise
        ``EngineOverloaded`` (with ``retry_after``) at once. When the queue
        is full, a request displaces a queued one of strictly lower priority
        instead of being refused; under pressure ``n > 1`` and many top
        logprobs are refused first (``ExpensiveRequestRefused``); see
        ``DegradationPolicy``. A structured output not compiled before
        (``prepare``) is compiled here, in the event loop."""
        request = RequestInput(prompt, SamplingParams() if params is None else params, priority, objectives=objectives)
        return self.submit_nowait(request, request_id=request_id, deadline=deadline, timeout=timeout, final_only=final_only)

    def submit_nowait(
        self,
        request: RequestInput,
        *,
        request_id: str | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        final_only: bool = False,
    ) -> RequestStream:
        """``generate_nowait`` for a request its edge has built and checked
        (the HTTP and gRPC APIs build theirs from the body)."""
        actor = self._new_request(request, request_id, deadline, timeout, final_only)
        try:
            self._degradation.check_expensive(actor.params, self._admission.pressure, self._scheduler.retry_after())
            actor.submit_nowait()
        except BaseException as exc:
            actor.close()
            if isinstance(exc, EngineOverloaded):
                self._num_refused += 1
            raise
        self._num_accepted += 1
        return RequestStream(actor, self._token)

    def abort(self, request_id: str) -> bool:
        """End a request: queued or live, it finishes with ``ABORT`` at the
        next step boundary. False if there is no such request."""
        actor = self._ids.get(request_id)
        return actor is not None and actor.abort()

    def _new_request(
        self,
        request: RequestInput,
        request_id: str | None,
        deadline: float | None,
        timeout: float | None,
        final_only: bool,
    ) -> RequestActor:
        if self._admission.closed:
            raise EngineClosed("the engine is not taking requests")
        # ``request`` holds the rules that need no model; these are the
        # model's (tokenizing, the vocabulary, the context). What comes out
        # the core and the scheduler take as it is.
        request_id = uuid.uuid4().hex if request_id is None else request_id
        params = self.sampling_defaults.apply(request.params)
        new = self.core.validate(request_id, request.prompt, params, priority=request.priority, pooling=request.pooling)
        capped = self._degradation.cap(new.params, new.priority, self._admission.pressure)
        if capped is not new.params:
            new = attrs.evolve(new, params=capped)
        if request.objectives is not new.objectives:
            new = attrs.evolve(new, objectives=request.objectives)
        if request.lora is not None:
            # The adapter the request names (its model field: web/lora_api.py).
            new = attrs.evolve(new, lora=self.core.lora_ref(request.lora))
        decision = self._judge(new)  # raises SloRefused: refused at the door
        if decision is not None and decision.max_tokens is not None:
            new = attrs.evolve(new, params=attrs.evolve(new.params, max_tokens=decision.max_tokens))
        if timeout is not None:
            after = trio.current_time() + timeout
            deadline = after if deadline is None else min(deadline, after)
        if self._ids.in_use(request_id):
            raise DuplicateRequestError(request_id)
        max_queue_time = self.core.config.max_queue_time
        actor = RequestActor(
            new,
            queue_deadline=None if max_queue_time is None else trio.current_time() + max_queue_time,
            on_full=self._shed,
            deadline=deadline,
            final_only=final_only,
            max_buffered_outputs=self.core.config.max_buffered_outputs,
            admission=self._admission,
            control=self._control,
            retry_after=self._scheduler.retry_after,
            on_close=self._on_request_closed,
        )
        actor.slo = decision
        self._ids.add(actor)
        return actor

    def _judge(self, new: NewRequest) -> SloDecision | None:
        """SLO admission (actors/slo_admission.py): with the slo policy, a
        request with objectives gets its prediction on the replica that
        would serve it soonest, and is admitted or refused (``SloRefused``)."""
        config = self.core.config
        if config.scheduling_policy != "slo":
            return None
        now = time.monotonic()
        # The higher classes' recent arrivals: those arriving while it waits
        # run first, expected for as long as they have been coming and at
        # least until its first token is due. With replicas each gets its
        # share of them.
        views = self._slo_views()
        arrivals = [(rate / len(views), p, o) for rate, p, o in self._arrivals.ahead_of(new.priority, now)]
        output = output_budget(new, self.core.scheduler.max_context_len)
        if new.objectives.empty:
            self._arrivals.record(now, new.priority, new.num_tokens, output)
            return None
        predictions = []
        for scheduler, queue in views:
            queued = queue.queued()
            core = scheduler.core
            prediction = predict_on(
                core.scheduler,
                scheduler.latency,
                new,
                now,
                [m.request for m in queued],
                [m.arrival_time for m in queued],
                cached_tokens=cached_prefix(core.block_manager, new),
                in_flight=scheduler.step_in_flight(),
                arrivals=arrivals,
                arrivals_for=arrivals_horizon(self._arrivals.horizon(now), new.objectives),
            )
            predictions.append(prediction)
        best = min(predictions, key=lambda prediction: prediction.ttft)
        try:
            decision = decide(new.objectives, best, max_tokens=new.params.max_tokens, degraded=self._degraded())
        except SloRefused:
            self._num_refused += 1
            raise
        # Admitted: it runs, and its like may pass a later request.
        self._arrivals.record(now, new.priority, new.num_tokens, output)
        if len(predictions) > 1:
            decision = attrs.evolve(decision, replica_ttfts=tuple(p.ttft for p in predictions))
        return decision

    def _slo_views(self) -> list[tuple[Any, Any]]:
        """Each replica's scheduler actor and admission queue (one here)."""
        return [(self._scheduler, self._admission)]

    def latency_models(self) -> list[LatencyModel]:
        """Each replica's latency model, in replica order: the live objects
        SLO admission and the slo policy predict with (web/slo_profile.py
        saves and seeds them)."""
        return [scheduler.latency for scheduler, _ in self._slo_views()]

    def _degraded(self) -> bool:
        """A hung step runs or the worker is down (as /health's ``degraded``)."""
        executor = self._executor.statistics()
        worker_down = executor.worker_state is not None and executor.worker_state != "ready"
        return executor.num_hung_steps_running > 0 or worker_down

    def _on_request_closed(self, actor: RequestActor) -> None:
        self._ids.closed(actor)
        # Ended while waiting for room: the scheduler never saw it.
        if actor.unqueued_reason is FinishReason.DEADLINE:
            self._num_deadline_unqueued += 1
        elif actor.unqueued_reason is FinishReason.QUEUE_TIMEOUT:
            self._num_queue_timeouts_unqueued += 1
        elif actor.unqueued_reason is not None:
            self._num_cancelled_unqueued += 1

    def _shed(self, message: AddRequest) -> None:
        """The queue is full: queue ``message`` in place of a request of
        lower priority (whose id is then free: its output channel is
        closed), or raise ``trio.WouldBlock``."""
        self._degradation.shed(self._admission, message, self._scheduler.retry_after())

    # -- the engine -------------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        """Queue lengths, running, KV usage, prefix hit rate, throughput,
        and what overload control did."""
        scheduler = self._scheduler.statistics()
        replicas = self._replica_statistics()
        return EngineStatistics(
            num_queued=self._admission.num_queued,
            num_queued_tokens=self._admission.num_queued_tokens,
            num_waiting_to_queue=self._admission.num_waiting_to_send,
            max_queued_requests=self._admission.max_requests,
            max_queued_tokens=self._admission.max_tokens,
            num_refused=self._num_refused,
            num_reserved_ids=len(self._ids),
            num_deadline_unqueued=self._num_deadline_unqueued,
            num_cancelled_unqueued=self._num_cancelled_unqueued,
            num_accepted=self._num_accepted,
            scheduler=scheduler,
            allocator=self._allocator.statistics(),
            executor=self._executor.statistics(),
            overload=self._overload_statistics(scheduler),
            replicas=replicas,
        )

    def _replica_statistics(self) -> tuple[ReplicaStatistics, ...]:
        # One replica: the engine itself (ReplicatedEngine has several).
        return (
            ReplicaStatistics(
                index=0,
                num_queued=self._admission.num_queued,
                scheduler=self._scheduler.statistics(),
                allocator=self._allocator.statistics(),
                executor=self._executor.statistics(),
            ),
        )

    def _overload_statistics(self, scheduler: SchedulerActorStatistics) -> OverloadStatistics:
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
        self._admission.close()
        with trio.move_on_after(timeout):
            await self._scheduler.wait_stopped()
        if self._scheduler.stopped:
            return 0
        before = self._scheduler.statistics().num_aborted
        try:
            self._control.send_nowait(AbortAll())
        except (trio.ClosedResourceError, trio.BrokenResourceError, trio.WouldBlock):
            pass  # the scheduler is gone already (or, impossibly, busy with more than it can hold)
        await self._scheduler.wait_stopped()  # one step at most
        return self._scheduler.statistics().num_aborted - before


def embedding_of(output: RequestOutput | None) -> tuple[float, ...]:
    """An embedding request's vector from its final output (``final_only``);
    ``trio.TooSlowError`` when its deadline ended it first, ``EngineClosed``
    when it was aborted."""
    assert output is not None and output.finished, "an embedding request ended without its final output"
    if output.embedding is None:
        if output.finish_reason is FinishReason.DEADLINE:
            raise trio.TooSlowError(f"embedding request {output.request_id!r} ran past its deadline")
        # An abort: the engine draining, or ``abort(request_id)``.
        raise EngineClosed(f"embedding request {output.request_id!r} was aborted before its vector was computed")
    return output.embedding
