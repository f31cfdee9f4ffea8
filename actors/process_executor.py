"""The executor actor with its model step in a worker process, and that process's supervisor.

``ProcessExecutor`` speaks to the scheduler exactly as ``ModelExecutor``
does (``RunStep`` in, ``StepDone`` / ``StepFailed`` out); only where the step
runs differs. The worker (``trioserve.engine.parallel.worker_process``) is started
with ``torch.multiprocessing``'s spawn context and loads the weights itself;
plans go to it and outputs come back as length-prefixed pickles over a
socket pair, which trio reads without blocking the event loop. A plan that
``awaits_mask`` is followed by its ``TokenMask`` once the scheduler has
filled it: the worker runs the forward meanwhile and reads the mask before
it samples.

Faults (docs/reliability.md, "Worker processes"):

- a step that raises in the worker is ``StepFailed`` with the step's error,
  as in a thread; the worker goes on;
- a worker that dies (killed, crashed, exited) takes the KV cache with it:
  the step in flight, or the next step if it died between steps, fails with
  ``WorkerLost``, and the scheduler preempts every running request to
  recompute it on the restarted worker (their streams just pause);
- a step past ``watchdog_timeout`` is answered ``StepHung`` as in a thread,
  and the worker is killed (a process, unlike a thread, can be), so the
  hung step's blocks are released at once;
- the supervisor restarts a dead worker after an exponential backoff; more
  than ``max_restarts`` deaths within ``restart_window`` seconds, or a
  worker that cannot start, and it gives up: steps then fail with
  ``WorkerUnavailable``.

Shutdown sends the stop message and joins the worker; one that does not
exit within ``stop_timeout`` is killed. A server killed outright leaves no
worker behind either: the worker exits at its socket's end, and on Linux the
kernel kills it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import pickle
import signal
import socket
from collections.abc import Callable
from typing import Any

import attrs
import trio

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.kernels.kv_dtype_choice import KVDtypeChoice
from trioserve.engine.loading.loader import LoadedModel, describe_model
from trioserve.engine.models.projections import ProjectionChoice
from trioserve.engine.runtime.model_runner import RunnerOutput
from trioserve.engine.runtime.step_plan import StepPlan
from trioserve.engine.runtime.step_thread import StepThread
from trioserve.engine.parallel.worker_process import (
    HEADER,
    StopWorker,
    WorkerReady,
    WorkerSpec,
    WorkerStartFailed,
    WorkerStepError,
    encode,
    worker_main,
)

from .errors import WorkerLost, WorkerUnavailable
from .executor import Executor, MaskNotSent, Masks, ModelExecutor
from .messages import StepDone, StepFailed
from .statistics import ExecutorStatistics

log = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"  # given up: restarts exhausted or a start failed
    STOPPED = "stopped"


class FrameLink:
    """Length-prefixed pickles over a trio stream (the worker's socket)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._buffer = bytearray()

    async def send(self, message: Any) -> None:
        await self.stream.send_all(encode(message))

    async def _fill(self, size: int) -> None:
        while len(self._buffer) < size:
            data = await self.stream.receive_some(1 << 20)
            if not data:
                raise EOFError("the worker closed its socket")
            self._buffer += data

    async def receive(self) -> Any:
        """The next message; ``EOFError`` when the worker is gone."""
        await self._fill(HEADER.size)
        (size,) = HEADER.unpack_from(self._buffer)
        await self._fill(HEADER.size + size)
        payload = bytes(self._buffer[HEADER.size : HEADER.size + size])
        del self._buffer[: HEADER.size + size]
        return pickle.loads(payload)


@attrs.define(eq=False)
class _Worker:
    """One incarnation of the worker process."""

    process: Any  # torch.multiprocessing's spawn Process
    link: FrameLink
    generation: int
    pid: int


def describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class ProcessExecutor(Executor):
    """Runs each step in a worker process built from ``spec``.

    ``max_restarts`` deaths within ``restart_window`` seconds are restarted
    (after ``backoff`` seconds, doubling with each recent restart up to
    ``max_backoff``); the next one gives up. ``start_timeout``: seconds a
    worker may take to build its runner. ``stop_timeout``: seconds it may
    take to exit after the stop message before it is killed.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        watchdog_timeout: float | None = None,
        max_restarts: int = 5,
        restart_window: float = 60.0,
        backoff: float = 0.25,
        max_backoff: float = 8.0,
        start_timeout: float = 600.0,
        stop_timeout: float = 10.0,
    ) -> None:
        super().__init__(watchdog_timeout=watchdog_timeout)
        self.spec = spec
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.state = WorkerState.STARTING
        self._worker: _Worker | None = None
        self._generation = 0  # of the last worker started
        # The worker whose cache the scheduler's plans describe: a step
        # sent to any other first fails with WorkerLost (its cache is new).
        self._known_generation = 1
        self._ready = trio.Event()  # a worker is ready, or the supervisor gave up
        self._deaths: collections.deque[float] = collections.deque()
        self._num_worker_restarts = 0
        self._stopping = False
        self._supervisor = trio.CancelScope()
        self._last_exit: str | None = None
        # How the latest ready worker's model runs its projections (its report).
        self.worker_projection_choice: ProjectionChoice | None = None

    # -- the actor ------------------------------------------------------------------

    async def run(self, replies: trio.MemorySendChannel[StepDone | StepFailed], **kwargs: Any) -> None:
        """Start the worker (its start failure is raised: nothing is served
        without one), supervise it, and serve steps until the scheduler
        closes the inbox; then stop the worker."""
        try:
            async with trio.open_nursery() as nursery:
                await self._start()
                nursery.start_soon(self._supervise)
                try:
                    await super().run(replies, **kwargs)
                finally:
                    # The supervisor first, so it restarts nothing, then the worker.
                    self._stopping = True
                    self._supervisor.cancel()
                    with trio.CancelScope(shield=True):
                        await self._stop()
        finally:
            with trio.CancelScope(shield=True):
                await self._stop()  # a failed first start, or a crash before the supervisor

    async def _start(self) -> None:
        """Start a worker and wait until its runner is built."""
        import torch.multiprocessing

        parent, child = socket.socketpair()
        context = torch.multiprocessing.get_context("spawn")
        process = context.Process(target=worker_main, args=(self.spec, child), name="trioserve-worker", daemon=True)
        try:
            # Started from the event loop's thread, which lives as long as
            # the engine: PR_SET_PDEATHSIG fires when the *thread* that
            # forked the worker ends, so a worker thread would not do.
            process.start()
        finally:
            child.close()
        link = FrameLink(trio.SocketStream(trio.socket.from_stdlib_socket(parent)))
        ready = False
        try:
            with trio.fail_after(self.start_timeout):
                try:
                    message = await link.receive()
                except (EOFError, trio.BrokenResourceError, ConnectionError):
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(process.join)
                    raise WorkerUnavailable(
                        f"the worker process exited with {describe_exit(process.exitcode)} while starting"
                    ) from None
            if isinstance(message, WorkerStartFailed):
                raise message.error
            assert isinstance(message, WorkerReady), f"unexpected message {type(message).__name__}"
            ready = True
            self.worker_projection_choice = message.projection_choice
        except trio.TooSlowError:
            raise WorkerUnavailable(f"the worker process did not start within {self.start_timeout:g} s") from None
        finally:
            if not ready:
                with trio.CancelScope(shield=True):
                    await self._reap(process, link, kill=True)
        self._generation += 1
        self._worker = _Worker(process, link, self._generation, process.pid)
        self.state = WorkerState.READY
        self._ready.set()
        log.info("worker process %d ready (generation %d)", process.pid, self._generation)

    async def _supervise(self) -> None:
        """Wait for the worker to die; restart it with backoff, or give up.
        Cancelled (``_supervisor``) before the worker is stopped."""
        with self._supervisor:
            await self._watch()

    async def _watch(self) -> None:
        while True:
            worker = self._worker
            assert worker is not None
            await trio.lowlevel.wait_readable(worker.process.sentinel)
            # No checkpoint until both are set: a step waits for the next worker.
            self._ready = trio.Event()
            self._worker = None
            self.state = WorkerState.RESTARTING
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(worker.process.join)
                await worker.link.stream.aclose()
            self._last_exit = describe_exit(worker.process.exitcode)
            self._fault("worker_died", f"the worker process {worker.pid} died ({self._last_exit})")
            worker.process.close()
            while True:
                delay = self._next_backoff()
                if delay is None:
                    self._give_up(f"it died {len(self._deaths)} times within {self.restart_window:g} s")
                    return
                await trio.sleep(delay)
                try:
                    await self._start()
                except Exception as exc:
                    log.error("the worker process could not be restarted: %s", exc)
                    continue
                self._num_worker_restarts += 1
                break

    def _next_backoff(self) -> float | None:
        now = trio.current_time()
        self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - self.restart_window:
            self._deaths.popleft()
        if len(self._deaths) > self.max_restarts:
            return None
        return min(self.max_backoff, self.backoff * 2 ** (len(self._deaths) - 1))

    def _give_up(self, why: str) -> None:
        self.state = WorkerState.FAILED
        self._fault("worker_failed", f"the worker process is not restarted again: {why}")
        self._ready.set()

    async def _stop(self) -> None:
        """The stop message, then join; kill what does not exit in time."""
        self._stopping = True
        worker, self._worker = self._worker, None
        if worker is not None:
            try:
                with trio.move_on_after(self.stop_timeout):
                    await worker.link.send(StopWorker())
            except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
                pass  # dead already
            await self._reap(worker.process, worker.link, kill=False)
        if self.state is not WorkerState.FAILED:
            self.state = WorkerState.STOPPED

    async def _reap(self, process: Any, link: FrameLink, *, kill: bool) -> None:
        if not kill:
            await trio.to_thread.run_sync(process.join, self.stop_timeout)
        if process.exitcode is None:
            if not kill:
                log.warning("worker process %d did not stop within %g s: killed", process.pid, self.stop_timeout)
            process.kill()
            await trio.to_thread.run_sync(process.join)
        await link.stream.aclose()
        process.close()

    # -- steps -------------------------------------------------------------------------

    async def execute(self, plan: StepPlan, masks: Masks | None = None) -> RunnerOutput:
        while (worker := self._worker) is None:
            if self.state is WorkerState.FAILED or self._stopping:
                raise WorkerUnavailable(
                    f"the model worker process is down ({self._last_exit or 'not running'}) and not restarted"
                )
            await self._ready.wait()
        if worker.generation != self._known_generation:
            self._known_generation = worker.generation
            raise WorkerLost(f"the worker process was restarted after it died ({self._last_exit}); its KV cache is gone")
        try:
            await worker.link.send(plan)
            if masks is not None:
                # The worker runs the forward meanwhile, then reads the mask.
                with masks:
                    try:
                        token_mask = await masks.receive()
                    except trio.EndOfChannel:
                        # Shutdown: the stop message comes next, and the worker takes it in the mask's place.
                        raise MaskNotSent("the scheduler ended before the step's token mask came") from None
                await worker.link.send(token_mask)
            reply = await worker.link.receive()
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            if self._known_generation == worker.generation:
                self._known_generation = worker.generation + 1  # this failure tells the scheduler
            raise WorkerLost(f"the worker process {worker.pid} died during the step") from None
        if isinstance(reply, WorkerStepError):
            log.error("the step raised in worker process %d:\n%s", worker.pid, reply.traceback)
            raise reply.error
        assert isinstance(reply, RunnerOutput), f"unexpected reply {type(reply).__name__}"
        return reply

    def step_hung(self) -> None:
        worker = self._worker
        if worker is not None and worker.process.exitcode is None:
            log.error("killing worker process %d: its step is hung", worker.pid)
            self._known_generation = -1  # the next step tells the scheduler the cache is gone
            worker.process.kill()

    # -- introspection -------------------------------------------------------------

    @property
    def worker_pid(self) -> int | None:
        """The live worker's process id (None while there is none)."""
        return None if self._worker is None else self._worker.pid

    async def wait_ready(self) -> None:
        """Wait until a worker is ready or the supervisor has given up."""
        await self._ready.wait()

    def statistics(self) -> ExecutorStatistics:
        return attrs.evolve(
            super().statistics(),
            worker_state=self.state.value,
            worker_pid=self.worker_pid,
            num_worker_restarts=self._num_worker_restarts,
        )


def worker_core(
    config: EngineConfig,
    loaded: LoadedModel | None,
    worker_model: Callable[[], LoadedModel] | None,
    kv_dtype: KVDtypeChoice | None = None,
) -> EngineCore:
    """The server's engine core for ``worker_mode="process"``: no runner and
    no KV tensors here (the worker has them), and no weights unless
    ``loaded`` was given (its model config and tokenizer are used);
    ``kv_dtype`` as for ``EngineCore``."""
    if loaded is not None and worker_model is None:
        raise ValueError("worker_mode='process' with a loaded model needs worker_model: how the worker process gets it")
    if loaded is None:
        loaded = describe_model(config.model, dtype=config.dtype, device=config.device)
    return EngineCore(loaded, config, runner=False, kv_dtype=kv_dtype)


def process_executor(
    core: EngineCore,
    config: EngineConfig,
    worker_model: Callable[[], LoadedModel] | None,
    *,
    cpus: frozenset[int] | None = None,
) -> ProcessExecutor:
    """The executor of ``core`` with its worker built from ``config``,
    pinned to ``cpus`` when given (a data-parallel replica's share)."""
    # The worker stores the cache in the dtype chosen here, which the pool was sized for.
    config = attrs.evolve(config, kv_cache_dtype=core.kv_dtype.name)
    spec = WorkerSpec(config=config, num_blocks=core.num_blocks, parent_pid=os.getpid(), model=worker_model, cpus=cpus)
    return ProcessExecutor(
        spec,
        watchdog_timeout=config.watchdog_timeout,
        max_restarts=config.max_worker_restarts,
        restart_window=config.worker_restart_window,
        stop_timeout=config.shutdown_timeout,
    )


def engine_executor(
    core: EngineCore,
    config: EngineConfig,
    step_thread: StepThread,
    *,
    executor: Callable[[EngineCore], Executor] | None,
    worker_model: Callable[[], LoadedModel] | None,
    cpus: frozenset[int] | None = None,
) -> Executor:
    """The executor actor of one engine (or one replica): a worker process
    when ``config.worker_mode`` is ``process`` and no ``executor`` factory is
    given, else ``executor(core)``, else the step on ``step_thread``."""
    if config.worker_mode == "process" and executor is None:
        return process_executor(core, config, worker_model, cpus=cpus)
    if executor is not None:
        return executor(core)
    assert core.runner is not None
    return ModelExecutor(core.runner, step_thread, watchdog_timeout=config.watchdog_timeout)
