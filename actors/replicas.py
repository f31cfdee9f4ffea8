"""Data parallelism: ``data_parallel_size`` engine replicas behind one ``Engine``.

Each replica is a whole engine minus the callers' side: its own
``EngineCore`` (scheduler policy, KV cache), cache-allocator actor (its own
pool and prefix cache), executor actor (on its own step thread, pinned to
its share of the cores, or on its own CUDA device; engine/parallel/placement.py) and
scheduler actor, taking requests from its own admission queue. Nothing is
shared between replicas but, on CPU, the read-only weights.

The callers' side is the one ``ReplicatedEngine`` (an ``Engine``: the same
``generate`` / ``generate_nowait`` / ``abort`` / ``statistics`` / ``drain``):

- ``ReplicatedAdmission`` (replica_admission.py) is its admission queue. It holds the admission
  bound for all replicas together (``max_queued_requests`` and
  ``max_queued_tokens`` over the sum of the replicas' queues), with the
  same first-come-first-served waiting, refusal and shedding as one queue,
  and routes each request to a replica at the moment it is queued
  (``ReplicaRouter``, router.py: prefix affinity, then load).
- ``ReplicaControl`` is its control channel: an ``Abort`` or ``Resume`` goes
  to the scheduler of the replica its request was routed to, ``AbortAll`` to
  every one. Each replica's scheduler then handles priorities, deadlines,
  pauses and aborts exactly as a single engine's does.

A replica's executor is the same kind as a single engine's: a
``ModelExecutor`` on the replica's pinned step thread, or with
``worker_mode="process"`` a worker process of its own, pinned to the
replica's cores (or on its CUDA device), which loads its own weights.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import trio

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.runtime.build import kv_dtype_choice
from trioserve.engine.faults import Fault
from trioserve.engine.loading.generation_config import SamplingDefaults
from trioserve.engine.core.kv_batch import KVResult
from trioserve.engine.kernels.kv_dtype_choice import KVDtypeChoice
from trioserve.engine.loading.loader import LoadedModel, load_model_for
from trioserve.engine.models.projections import ProjectionChoice
from trioserve.engine.parallel.placement import ParallelConfigError, PinnedStepThread, ReplicaPlacement, plan_replicas

from .admission import AdmissionQueue
from .allocator import AllocatorActor
from .handle import Engine
from .executor import Executor
from .process_executor import engine_executor, worker_core
from .messages import StepDone, StepFailed
from .replica_admission import ReplicaControl, ReplicatedAdmission
from .request import RequestActor
from .router import ReplicaRouter
from .scheduler import SchedulerActor
from .statistics import OverloadStatistics, ReplicaStatistics, SchedulerActorStatistics, estimate_retry_after
from .step_calls import run_in_step_thread

__all__ = ["Replica", "ReplicaControl", "ReplicatedAdmission", "ReplicatedEngine", "combine", "open_replicated_engine"]

T = TypeVar("T")

# ExecutorStatistics.worker_state values, least healthy first.
_WORKER_STATES = ("failed", "restarting", "starting", "stopped", "ready")


def combine(values: Sequence[T]) -> T:
    """Statistics values of several replicas as one: counts, rates and times
    summed, ``last_*`` figures the largest, flags any, faults the latest, a
    worker's state the least healthy, a worker's pid none (each replica's is
    in ``statistics().replicas``), nested values combined the same way."""
    first = values[0]
    if len(values) == 1:
        return first
    fields: dict[str, Any] = {}
    for field in attrs.fields(type(first)):
        items = [getattr(v, field.name) for v in values]
        if field.name == "worker_pid":
            fields[field.name] = None
        elif field.name == "worker_state":
            fields[field.name] = min(items, key=lambda state: _WORKER_STATES.index(state) if state in _WORKER_STATES else 0)
        elif any(isinstance(item, Fault) for item in items) or all(item is None for item in items):
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
        return estimate_retry_after(self._admission.num_queued, sum(actor.statistics().requests_per_s for actor in self.actors))

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

    def __init__(
        self,
        replicas: Sequence[Replica],
        admission: ReplicatedAdmission,
        router: ReplicaRouter,
        *,
        sampling_defaults: SamplingDefaults,
    ) -> None:
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
            sampling_defaults=sampling_defaults,
        )

    @property
    def projection_choice(self) -> ProjectionChoice:
        """The first replica's (every replica loads the same model on the same CPU)."""
        return self._projection_choice_of(self.replicas[0].executor, self.replicas[0].core)

    def _on_request_closed(self, actor: RequestActor) -> None:
        super()._on_request_closed(actor)
        self.router.release(actor.request_id)

    def _replica_statistics(self) -> tuple[ReplicaStatistics, ...]:
        return tuple(replica.statistics() for replica in self.replicas)

    def _slo_views(self) -> list[tuple[Any, Any]]:
        # Each replica with its own queue and latency model: admission
        # judges a request by the replica that would serve it soonest.
        return [(replica.scheduler, queue) for replica, queue in zip(self.replicas, self._admission.queues, strict=True)]

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


def _build_core(
    config: EngineConfig,
    placement: ReplicaPlacement,
    shared: LoadedModel | None,
    in_process: bool,
    worker_model: Callable[[], LoadedModel] | None,
    kv_dtype: KVDtypeChoice | None,
) -> EngineCore:
    # Runs on the replica's step thread: its KV cache and kernels are made there.
    replica_config = placement.engine_config(config)
    if in_process:
        # The replica's worker process loads the weights and holds the KV cache.
        return worker_core(replica_config, shared, worker_model, kv_dtype)
    if shared is None:
        loaded = load_model_for(replica_config)
    else:
        loaded = shared
    return EngineCore(loaded, replica_config, kv_dtype=kv_dtype)


@asynccontextmanager
async def open_replicated_engine(
    config: EngineConfig,
    *,
    loaded: LoadedModel | None = None,
    executor: Callable[[EngineCore], Executor] | None = None,
    worker_model: Callable[[], LoadedModel] | None = None,
    sampling_defaults: SamplingDefaults | None = None,
) -> AsyncIterator[ReplicatedEngine]:
    """``open_engine`` for ``config.data_parallel_size > 1``: plan the
    replicas (refusing a layout the machine lacks before anything loads),
    build their cores concurrently, each on its own step thread, start their
    actors, and yield the ``ReplicatedEngine``; shut down as ``open_engine``
    does, every replica together.

    On CPU the replicas share one copy of the weights (``loaded``, else
    loaded once); on CUDA each replica loads its own onto its device. With
    ``worker_mode="process"`` each replica's worker process loads its own
    (``worker_model`` as for ``open_engine``; ``loaded``, when given, only
    lends its config and tokenizer). ``sampling_defaults``: as
    ``open_engine`` read them (default: built-in).
    """
    placements = plan_replicas(config)
    on_cuda = placements[0].device is not None and placements[0].device.startswith("cuda")
    if loaded is not None and loaded.device.type == "cuda":
        raise ParallelConfigError(
            "data_parallel_size > 1 on CUDA loads one copy of the model per device; pass no preloaded model"
        )
    threads = [PinnedStepThread(p.num_threads, p.cpus, name=f"trioserve-step-{p.index}") for p in placements]
    try:
        in_process = config.worker_mode == "process" and executor is None
        if loaded is None and not on_cuda and not in_process:
            loaded = await run_in_step_thread(threads[0], load_model_for, config)
        # Replicas sharing one model store their caches in one dtype: "auto"
        # measures, and each replica measuring for itself could tip two of
        # them apart, and with them a near tie in their greedy tokens.
        kv_dtype = None if loaded is None else await run_in_step_thread(threads[0], kv_dtype_choice, config, loaded)
        cores: list[EngineCore | None] = [None] * len(placements)

        async def build(index: int) -> None:
            cores[index] = await run_in_step_thread(
                threads[index], _build_core, config, placements[index], loaded, in_process, worker_model, kv_dtype
            )

        async with trio.open_nursery() as builders:
            for index in range(len(placements)):
                builders.start_soon(build, index)
        built = [core for core in cores if core is not None]
        assert len(built) == len(placements)
        # One grammar cache for all: ``Engine.prepare`` compiles a request's
        # grammar before it is routed, so any replica must find it compiled.
        for core in built[1:]:
            core.grammars.compiler = built[0].grammars.compiler

        router = ReplicaRouter(
            num_replicas=len(placements),
            block_size=config.block_size,
            max_model_len=min(core.max_model_len for core in built),
            affinity_slack=max(1, config.max_num_seqs // 2),
        )
        allocators = [AllocatorActor(core.block_manager) for core in built]
        admission = ReplicatedAdmission(
            config.max_queued_requests,
            config.max_queued_tokens,
            router,
            lambda: [allocator.statistics().kv.usage for allocator in allocators],
        )
        replicas = []
        for placement, core, thread, allocator, queue in zip(placements, built, threads, allocators, admission.queues):
            # A worker process is pinned to the replica's cores; the step thread already is.
            executor_actor = engine_executor(
                core, placement.engine_config(config), thread, executor=executor, worker_model=worker_model, cpus=placement.cpus
            )
            scheduler = SchedulerActor.from_config(core, queue)
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
            engine = ReplicatedEngine(
                replicas, admission, router, sampling_defaults=sampling_defaults or SamplingDefaults.built_in()
            )
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

