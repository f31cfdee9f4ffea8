"""Data parallelism: ``data_parallel_size`` engine replicas behind one ``Engine``.

Each replica is a whole engine minus the callers' side: its own
``EngineCore`` (scheduler policy, KV cache), cache-allocator actor (its own
pool and prefix cache), executor actor (on its own step thread, pinned to
its share of the cores, or on its own CUDA device; engine/placement.py) and
scheduler actor, taking requests from its own admission queue. Nothing is
shared between replicas but, on CPU, the read-only weights.

The callers' side is the one ``ReplicatedEngine`` (an ``Engine``: the same
``generate`` / ``generate_nowait`` / ``abort`` / ``statistics`` / ``drain``):

- ``ReplicatedAdmission`` is its admission queue. It holds the admission
  bound for all replicas together (``max_queued_requests`` and
  ``max_queued_tokens`` over the sum of the replicas' queues), with the
  same first-come-first-served waiting, refusal and shedding as one queue,
  and routes each request to a replica at the moment it is queued
  (``ReplicaRouter``, router.py: prefix affinity, then load).
- ``ReplicaControl`` is its control channel: an ``Abort`` or ``Resume`` goes
  to the scheduler of the replica its request was routed to, ``AbortAll`` to
  every one. Each replica's scheduler then handles priorities, deadlines,
  pauses and aborts exactly as a single engine's does.

A replica's executor is made by the same factory as a single engine's, on
the replica's core and step thread, so another executor kind (a worker
process per replica) plugs in where ``ModelExecutor`` is made here.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import trio

from trioserve.engine.config import EngineConfig
from trioserve.engine.engine_core import EngineCore
from trioserve.engine.faults import Fault
from trioserve.engine.kv_batch import KVResult
from trioserve.engine.loader import LoadedModel, load_model
from trioserve.engine.placement import ParallelConfigError, PinnedStepThread, ReplicaPlacement, plan_replicas

from .admission import AdmissionQueue
from .allocator import AllocatorActor
from .concurrency import AdaptiveConcurrency
from .engine import Engine
from .executor import Executor, ModelExecutor
from .messages import Abort, AbortAll, AddRequest, Resume, StepDone, StepFailed
from .request import RequestActor
from .router import ReplicaRouter
from .scheduler import SchedulerActor
from .statistics import (
    AllocatorStatistics,
    ExecutorStatistics,
    OverloadStatistics,
    ReplicaStatistics,
    SchedulerActorStatistics,
)
from .step_calls import run_in_step_thread

__all__ = ["Replica", "ReplicaControl", "ReplicatedAdmission", "ReplicatedEngine", "combine", "open_replicated_engine"]

T = TypeVar("T")


def combine(values: Sequence[T]) -> T:
    """Statistics values of several replicas as one: counts, rates and times
    summed, ``last_*`` figures the largest, flags any, faults the latest,
    nested values combined the same way."""
    first = values[0]
    if len(values) == 1:
        return first
    fields: dict[str, Any] = {}
    for field in attrs.fields(type(first)):
        items = [getattr(v, field.name) for v in values]
        if any(isinstance(item, Fault) for item in items) or all(item is None for item in items):
            fields[field.name] = Fault.latest(*items)
        elif isinstance(items[0], bool):
            fields[field.name] = any(items)
        elif isinstance(items[0], int | float):
            fields[field.name] = max(items) if field.name.startswith("last_") else sum(items)
        else:
            fields[field.name] = combine(items)
    return type(first)(**fields)


# -- the replicas -----------------------------------------------------------------


@attrs.define(eq=False)
class Replica:
    """One replica's actors, and where it runs."""

    placement: ReplicaPlacement
    core: EngineCore
    admission: AdmissionQueue
    scheduler: SchedulerActor
    allocator: AllocatorActor
    executor: Executor
    control: trio.MemorySendChannel[Any] | None = None  # its scheduler's, once started

    @property
    def index(self) -> int:
        return self.placement.index

    def statistics(self) -> ReplicaStatistics:
        return ReplicaStatistics(
            index=self.index,
            num_queued=self.admission.num_queued,
            scheduler=self.scheduler.statistics(),
            allocator=self.allocator.statistics(),
            executor=self.executor.statistics(),
        )


class ReplicatedAdmission:
    """The admission queue of a replicated engine: the one bound over every
    replica's queue, and the routing of each request into one of them.

    The senders' side of ``AdmissionQueue`` (``send``, ``send_nowait``,
    ``displace_nowait``, ``close``, the figures). Each replica's scheduler
    receives from its own queue in ``queues``; a take there wakes the
    senders waiting here. A request that displaces a queued one (shedding)
    takes the displaced request's place in that replica's queue.
    """

    def __init__(
        self,
        max_requests: int,
        max_tokens: int | None,
        router: ReplicaRouter,
        kv_usage: Callable[[], Sequence[float]],
    ) -> None:
        if max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._router = router
        self._kv_usage = kv_usage
        self._fifo = trio.Lock()  # senders waiting for room, in order; the holder waits on _room
        self._room = trio.lowlevel.ParkingLot()
        self._closed = False
        # Each queue may hold the whole bound: this object keeps their sum under it.
        self.queues = tuple(
            AdmissionQueue(max_requests, max_tokens, on_room=self._room.unpark_all)
            for _ in range(router.num_replicas)
        )

    def _fits(self, num_tokens: int) -> bool:
        if self.num_queued >= self.max_requests:
            return False
        tokens = self.num_queued_tokens
        return self.max_tokens is None or tokens == 0 or tokens + num_tokens <= self.max_tokens

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the admission queue is closed")

    async def send(self, message: AddRequest) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self.send_nowait(message)
        except trio.WouldBlock:
            pass
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        async with self._fifo:
            while not self._closed and not self._fits(message.num_tokens):
                await self._room.park()
            self._put(message)

    def send_nowait(self, message: AddRequest) -> None:
        self._check_open()
        if self._fifo.locked() or not self._fits(message.num_tokens):
            raise trio.WouldBlock
        self._put(message)

    def _put(self, message: AddRequest) -> None:
        self._check_open()
        replica, hashes = self._router.choose(message.prompt_token_ids, self._kv_usage())
        # Raises if that replica's scheduler is gone (BrokenResourceError).
        self.queues[replica].send_nowait(message)
        self._router.record(message.request_id, replica, hashes, self._router.cost(message.prompt_token_ids, message.params))

    def displace_nowait(self, message: AddRequest) -> AddRequest:
        """As ``AdmissionQueue.displace_nowait``, over every replica's queue:
        the victim is the lowest priority queued anywhere (the latest
        arrival among equals); ``message`` takes its place in its queue."""
        self._check_open()
        best: tuple[int, AddRequest] | None = None
        for index, queue in enumerate(self.queues):
            victim = queue.lowest_priority()
            if victim is not None and (
                best is None or (victim.priority, victim.arrival_time) > (best[1].priority, best[1].arrival_time)
            ):
                best = (index, victim)
        if best is None or best[1].priority <= message.priority:
            raise trio.WouldBlock
        index, victim = best
        tokens = self.num_queued_tokens - victim.num_tokens
        if self.max_tokens is not None and tokens and tokens + message.num_tokens > self.max_tokens:
            raise trio.WouldBlock
        taken = self.queues[index].displace_nowait(message)
        assert taken is victim
        self._router.release(victim.request_id)
        self._router.record(message.request_id, index, (), self._router.cost(message.prompt_token_ids, message.params))
        return victim

    def close(self) -> None:
        """Stop admission everywhere: waiting and later senders get
        ``ClosedResourceError``; each scheduler takes what its queue holds."""
        self._closed = True
        for queue in self.queues:
            queue.close()
        self._room.unpark_all()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_queued(self) -> int:
        return sum(queue.num_queued for queue in self.queues)

    @property
    def num_queued_tokens(self) -> int:
        return sum(queue.num_queued_tokens for queue in self.queues)

    @property
    def num_waiting_to_send(self) -> int:
        return self._fifo.statistics().tasks_waiting + (1 if self._fifo.locked() else 0)

    @property
    def pressure(self) -> float:
        """As ``AdmissionQueue.pressure``, of the bound over all replicas."""
        if self._fifo.locked():
            return 1.0
        fill = self.num_queued / self.max_requests
        if self.max_tokens is not None:
            fill = max(fill, self.num_queued_tokens / self.max_tokens)
        return min(1.0, fill)


@attrs.define(eq=False)
class ReplicaControl:
    """The control channel of a replicated engine: each message to the
    scheduler of the replica its request went to; ``AbortAll`` to all."""

    controls: Sequence[trio.MemorySendChannel[Any]]
    router: ReplicaRouter

    def send_nowait(self, message: Abort | Resume | AbortAll) -> None:
        if isinstance(message, AbortAll):
            full = False
            for control in self.controls:  # every replica, whatever one of them answers
                try:
                    control.send_nowait(message)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    pass  # that scheduler has stopped already
                except trio.WouldBlock:
                    full = True
            if full:
                raise trio.WouldBlock
            return
        replica = self.router.replica_of(message.request_id)
        # A request is routed when it is queued and released when its actor
        # closes, which sends nothing after: an unrouted id was never queued.
        if replica is not None:
            self.controls[replica].send_nowait(message)

    def close(self) -> None:
        for control in self.controls:
            control.close()


class _Combined:
    """Several replicas' actors of one kind, as one for ``Engine``."""

    def __init__(self, actors: Sequence[Any]) -> None:
        self.actors = tuple(actors)

    def statistics(self) -> Any:
        return combine([actor.statistics() for actor in self.actors])


class _Schedulers(_Combined):
    """The replicas' schedulers, for ``Engine``: statistics, retry-after, stopping."""

    def __init__(self, schedulers: Sequence[SchedulerActor], admission: ReplicatedAdmission) -> None:
        super().__init__(schedulers)
        self._admission = admission

    def statistics(self) -> SchedulerActorStatistics:
        return combine([actor.statistics() for actor in self.actors])

    def retry_after(self) -> float:
        """As ``SchedulerActor.retry_after``, over the whole bound and every
        replica's completion rate."""
        rate = sum(actor.statistics().requests_per_s for actor in self.actors)
        if rate <= 0:
            return 1.0
        return min(60.0, max(0.1, (self._admission.num_queued + 1) / rate))

    @property
    def stopped(self) -> bool:
        return all(actor.stopped for actor in self.actors)

    async def wait_stopped(self) -> None:
        for actor in self.actors:
            await actor.wait_stopped()


class ReplicatedEngine(Engine):
    """An ``Engine`` over several replicas; made by ``open_engine`` when
    ``data_parallel_size > 1``. ``replicas`` and ``router`` are for
    inspection; ``statistics().replicas`` has each replica's figures."""

    def __init__(self, replicas: Sequence[Replica], admission: ReplicatedAdmission, router: ReplicaRouter) -> None:
        self.replicas = tuple(replicas)
        self.router = router
        controls = [replica.control for replica in self.replicas]
        assert all(control is not None for control in controls)
        # Requests are validated against the smallest pool, so any replica can hold them.
        core = min((replica.core for replica in self.replicas), key=lambda c: c.num_blocks)
        super().__init__(
            core,
            admission,  # type: ignore[arg-type]  # the senders' side of AdmissionQueue
            _Schedulers([replica.scheduler for replica in self.replicas], admission),  # type: ignore[arg-type]
            ReplicaControl(controls, router),  # type: ignore[arg-type]
            allocator=_Combined([replica.allocator for replica in self.replicas]),  # type: ignore[arg-type]
            executor=_Combined([replica.executor for replica in self.replicas]),  # type: ignore[arg-type]
        )

    def _on_request_closed(self, actor: RequestActor) -> None:
        super()._on_request_closed(actor)
        self.router.release(actor.request_id)

    def _replica_statistics(self) -> tuple[ReplicaStatistics, ...]:
        return tuple(replica.statistics() for replica in self.replicas)

    def _overload_statistics(self, scheduler: SchedulerActorStatistics) -> OverloadStatistics:
        concurrencies = [r.scheduler.concurrency for r in self.replicas if r.scheduler.concurrency is not None]
        p90s = [c.last_p90 for c in concurrencies if c.last_p90 is not None]
        degradation = self._degradation
        return OverloadStatistics(
            pressure=self._admission.pressure,
            concurrency_limit=sum(replica.core.scheduler.running_limit for replica in self.replicas),
            tpot_p90=max(p90s) if p90s else None,
            num_queue_timeouts=scheduler.num_queue_timeouts + self._num_queue_timeouts_unqueued,
            num_shed=degradation.num_shed,
            num_capped=degradation.num_capped,
            num_refused_expensive=degradation.num_refused,
            num_limit_decreases=sum(c.num_decreases for c in concurrencies),
            num_limit_increases=sum(c.num_increases for c in concurrencies),
        )

    def check_invariants(self) -> None:
        """``Engine.check_invariants`` for every replica."""
        for replica in self.replicas:
            replica.core.scheduler.check_invariants()
            replica.allocator.check_invariants(replica.core.scheduler.block_holders())


# -- starting and stopping ----------------------------------------------------------


def _build_core(config: EngineConfig, placement: ReplicaPlacement, shared: LoadedModel | None) -> EngineCore:
    # Runs on the replica's step thread: its KV cache and kernels are made there.
    replica_config = placement.engine_config(config)
    if shared is None:
        loaded = load_model(replica_config.model, dtype=replica_config.dtype, device=replica_config.device)
    else:
        loaded = shared
    return EngineCore(loaded, replica_config, own_pool=False)


@asynccontextmanager
async def open_replicated_engine(
    config: EngineConfig,
    *,
    loaded: LoadedModel | None = None,
    executor: Callable[[EngineCore], Executor] | None = None,
) -> AsyncIterator[ReplicatedEngine]:
    """``open_engine`` for ``config.data_parallel_size > 1``: plan the
    replicas (refusing a layout the machine lacks before anything loads),
    build their cores concurrently, each on its own step thread, start their
    actors, and yield the ``ReplicatedEngine``; shut down as ``open_engine``
    does, every replica together.

    On CPU the replicas share one copy of the weights (``loaded``, else
    loaded once); on CUDA each replica loads its own onto its device.
    """
    placements = plan_replicas(config)
    on_cuda = placements[0].device is not None and placements[0].device.startswith("cuda")
    if loaded is not None and loaded.device.type == "cuda":
        raise ParallelConfigError(
            "data_parallel_size > 1 on CUDA loads one copy of the model per device; pass no preloaded model"
        )
    threads = [PinnedStepThread(p.num_threads, p.cpus, name=f"trioserve-step-{p.index}") for p in placements]
    try:
        if loaded is None and not on_cuda:
            loaded = await run_in_step_thread(
                threads[0], functools.partial(load_model, config.model, dtype=config.dtype, device=config.device)
            )
        cores: list[EngineCore | None] = [None] * len(placements)

        async def build(index: int) -> None:
            cores[index] = await run_in_step_thread(threads[index], _build_core, config, placements[index], loaded)

        async with trio.open_nursery() as builders:
            for index in range(len(placements)):
                builders.start_soon(build, index)
        built = [core for core in cores if core is not None]
        assert len(built) == len(placements)

        router = ReplicaRouter(
            num_replicas=len(placements),
            block_size=config.block_size,
            max_model_len=min(core.max_model_len for core in built),
            affinity_slack=max(1, config.max_num_seqs // 2),
        )
        allocators = [AllocatorActor(core.new_block_manager()) for core in built]
        admission = ReplicatedAdmission(
            config.max_queued_requests,
            config.max_queued_tokens,
            router,
            lambda: [allocator.statistics().kv.usage for allocator in allocators],
        )
        replicas = []
        for placement, core, thread, allocator, queue in zip(placements, built, threads, allocators, admission.queues):
            if executor is None:
                # The executor open_engine makes for one engine, on this
                # replica's core and thread: another kind (a worker process
                # per replica) is chosen here the same way.
                executor_actor: Executor = ModelExecutor(core.runner, thread, watchdog_timeout=config.watchdog_timeout)
            else:
                executor_actor = executor(core)
            concurrency = None
            if config.adaptive_concurrency:
                concurrency = AdaptiveConcurrency(max_limit=config.max_num_seqs, target=config.target_tpot_ms / 1000)
            scheduler = SchedulerActor(core, queue, concurrency=concurrency)
            replicas.append(Replica(placement, core, queue, scheduler, allocator, executor_actor))

        async with trio.open_nursery() as nursery:
            for replica in replicas:
                kv_send, kv_receive = trio.open_memory_channel[KVResult](1)
                step_send, step_receive = trio.open_memory_channel[StepDone | StepFailed](1)
                allocator_inbox = await nursery.start(replica.allocator.run, kv_send)
                executor_inbox = await nursery.start(replica.executor.run, step_send)
                replica.control = await nursery.start(
                    functools.partial(
                        replica.scheduler.run,
                        allocator=allocator_inbox,
                        kv_results=kv_receive,
                        executor=executor_inbox,
                        step_results=step_receive,
                    )
                )
            engine = ReplicatedEngine(replicas, admission, router)
            try:
                yield engine
            except BaseException:
                admission.close()
                nursery.cancel_scope.cancel()
                raise
            with trio.move_on_after(config.shutdown_timeout):
                await engine.drain(0)  # abort what is left; the steps in flight finish
            if not all(replica.scheduler.stopped for replica in replicas):
                nursery.cancel_scope.cancel()
            for replica in replicas:
                assert replica.control is not None
                replica.control.close()
    finally:
        for thread in threads:
            thread.close()  # steps are not cancellable: none is in flight here

