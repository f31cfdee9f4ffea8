"""``open_engine``: start the actors of an engine and hand out its ``Engine``.

``async with open_engine(config) as engine:`` builds the engine core, starts
the allocator, executor and scheduler actors in a nursery (each with
``nursery.start``, so each is ready before the next starts), then makes the
``Engine`` (handle.py) from what they handed out, and, on exit, shuts them
down in order: admission closes, what is left is aborted, the step in flight
finishes, the scheduler closes the executor's and the allocator's inboxes,
and they end. If that takes longer than ``config.shutdown_timeout``, the
nursery is cancelled. An exception in the body, or the crash of an actor,
cancels the nursery at once; the crash propagates out of ``open_engine`` in
an exception group. With ``data_parallel_size > 1`` it is
``open_replicated_engine`` (replicas.py) that starts them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.loading.generation_config import SamplingDefaults, load_sampling_defaults
from trioserve.engine.core.kv_batch import KVResult
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.runtime.step_thread import StepThread

from .admission import AdmissionQueue
from .allocator import AllocatorActor
from .executor import Executor
from .handle import Engine
from .process_executor import engine_executor, worker_core
from .messages import StepDone, StepFailed
from .replicas import open_replicated_engine
from .stream import RequestStream
from .scheduler import SchedulerActor
from .step_calls import run_in_step_thread

__all__ = ["Engine", "RequestStream", "engine_sampling_defaults", "open_engine"]

log = logging.getLogger(__name__)


@asynccontextmanager
async def open_engine(
    config: EngineConfig,
    *,
    loaded: LoadedModel | None = None,
    executor: Callable[[EngineCore], Executor] | None = None,
    max_buffered_outputs: int | None = None,
    shutdown_timeout: float | None = None,
    worker_model: Callable[[], LoadedModel] | None = None,
) -> AsyncIterator[Engine]:
    """Start an engine on ``loaded`` (else load ``config.model`` on the
    engine's step thread) and yield it; see the module docstring for start
    and shutdown.

    ``executor(core)`` makes the executor actor (default: ``ModelExecutor``
    on the core's runner; tests pass a ``FakeExecutor``).
    ``max_buffered_outputs`` and ``shutdown_timeout``, when given, override
    the config's fields of those names (``EngineConfig`` documents them).

    With ``config.worker_mode == "process"`` the model step runs in a worker
    process (``ProcessExecutor``) that loads the model itself: this process
    reads only the model's config and tokenizer (``describe_model``), or
    uses ``loaded`` for them when given; ``worker_model`` (picklable, e.g. a
    module-level function) is how the worker gets the model, and is
    required with ``loaded`` (default: load ``config.model``).

    The engine's ``sampling_defaults`` come from ``config.generation_config``
    (engine/loading/generation_config.py), read before the model loads.
    """
    overrides = {"max_buffered_outputs": max_buffered_outputs, "shutdown_timeout": shutdown_timeout}
    config = attrs.evolve(config, **{name: value for name, value in overrides.items() if value is not None})
    # Before the model loads, so that a model's broken file stops it early.
    sampling_defaults = engine_sampling_defaults(config, loaded)
    if config.data_parallel_size > 1:
        async with open_replicated_engine(
            config, loaded=loaded, executor=executor, worker_model=worker_model, sampling_defaults=sampling_defaults
        ) as replicated:
            yield replicated
        return
    # Loading and every step run on this one thread: see step_thread.py.
    step_thread = StepThread(config.num_threads)
    core: EngineCore | None = None
    try:
        # The core's KV pool is served by the allocator actor, its only
        # writer here: the scheduler reaches it with KVBatch / KVResult messages.
        in_process = config.worker_mode == "process" and executor is None
        if in_process:
            make_core = functools.partial(worker_core, config, loaded, worker_model)
        elif loaded is None:
            make_core = functools.partial(EngineCore.from_config, config)
        else:
            make_core = functools.partial(EngineCore, loaded, config)
        core = await run_in_step_thread(step_thread, make_core)
        admission = AdmissionQueue(config.max_queued_requests, config.max_queued_tokens)
        allocator = AllocatorActor(core.block_manager)
        executor_actor = engine_executor(core, config, step_thread, executor=executor, worker_model=worker_model)
        scheduler = SchedulerActor.from_config(core, admission)
        kv_send, kv_receive = trio.open_memory_channel[KVResult](1)
        step_send, step_receive = trio.open_memory_channel[StepDone | StepFailed](1)
        async with trio.open_nursery() as nursery:
            allocator_inbox = await nursery.start(allocator.run, kv_send)
            executor_inbox = await nursery.start(executor_actor.run, step_send)
            control = await nursery.start(
                functools.partial(
                    scheduler.run,
                    allocator=allocator_inbox,
                    kv_results=kv_receive,
                    executor=executor_inbox,
                    step_results=step_receive,
                )
            )
            engine = Engine(
                core,
                admission,
                scheduler,
                control,
                allocator=allocator,
                executor=executor_actor,
                sampling_defaults=sampling_defaults,
            )
            try:
                yield engine
            except BaseException:
                admission.close()
                nursery.cancel_scope.cancel()
                raise
            with trio.move_on_after(config.shutdown_timeout):
                await engine.drain(0)  # abort what is left; the step in flight finishes
            if not scheduler.stopped:
                nursery.cancel_scope.cancel()
            control.close()
    finally:
        if core is not None:
            # Stops a tensor-parallel group's other ranks (a few seconds at most).
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(core.close)
        step_thread.close()  # steps are not cancellable: none is in flight here


def engine_sampling_defaults(config: EngineConfig, loaded: LoadedModel | None = None) -> SamplingDefaults:
    """The sampling defaults of the model ``config`` names; with no
    ``config.model`` and a model handed in ``loaded``, its folder's
    ``generation_config.json``. Logged once."""
    folder = loaded.path if loaded is not None and config.model is None else None
    defaults = load_sampling_defaults(config.generation_config, config.model, folder=folder)
    log.info("sampling defaults for the fields a request leaves out: %s", defaults)
    return defaults
