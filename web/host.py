"""The served models' engines, their lifecycle, and the metrics they feed.

``ModelHost.run`` runs as a task of the app's serving nursery: it loads each
model (in a worker thread, so ``/health`` answers 503 meanwhile), opens one
engine per model with ``open_engine``, and keeps them open until
``begin_drain()``. Then it drains every engine at once, giving in-flight
requests ``shutdown_timeout`` seconds before aborting them, and closes them.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Mapping

import attrs
import trio
from quart import current_app

from trioserve.actors import open_engine
from trioserve.engine.core.latency_model import LatencyProfileError
from trioserve.engine.errors import TrioserveError
from trioserve.engine.loading.loader import LoadedModel

from .errors import NotFoundError, ServiceUnavailable
from .health import TaskCountCollector
from .lora_models import served_adapter
from .metrics import Metrics
from .responses_store import ResponsesStore
from .scopes import cancel_after
from .served import ServedModel
from .settings import ServerConfig
from .slo_profile import save_engine, seed_engine

log = logging.getLogger(__name__)

# The key of the host in ``app.extensions``.
EXTENSION = "trioserve"
# Before the model is loaded the context limit is unknown; the metrics'
# token histograms then top out here.
DEFAULT_METRICS_MAX_MODEL_LEN = 8192
# Seconds a client told "loading" should wait before asking again.
LOADING_RETRY_AFTER = 5.0


class HostState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


@attrs.define(eq=False)
class ModelHost:
    """The engines of every served model, and the server's shared state.

    ``preloaded`` maps served names to models already in memory (tests, or a
    caller that loaded them); the others are loaded from their paths.
    """

    config: ServerConfig
    preloaded: Mapping[str, LoadedModel] = attrs.field(factory=dict)
    metrics: Metrics = attrs.field(init=False)
    state: HostState = attrs.field(default=HostState.LOADING, init=False)
    error: BaseException | None = attrs.field(default=None, init=False)
    models: dict[str, ServedModel] = attrs.field(factory=dict, init=False)
    started: int = attrs.field(factory=lambda: int(time.time()), init=False)
    # What /v1/responses stores (web/openai_responses_api.py).
    responses: ResponsesStore = attrs.field(init=False)
    _ready: trio.Event = attrs.field(factory=trio.Event, init=False)
    _stopped: trio.Event = attrs.field(factory=trio.Event, init=False)
    _drain_requested: trio.Event = attrs.field(factory=trio.Event, init=False)
    _abort_now: trio.Event = attrs.field(factory=trio.Event, init=False)

    def __attrs_post_init__(self) -> None:
        unknown = set(self.preloaded) - set(self.config.model_names)
        if unknown:
            raise ValueError(f"preloaded models {sorted(unknown)} are not among the served {list(self.config.model_names)}")
        limits = [m.model_config.max_context_len for m in self.preloaded.values()]
        if self.config.engine.max_model_len is not None:
            limits = [min([self.config.engine.max_model_len, *limits])]
        self.responses = ResponsesStore(self.config.responses_store_size)
        self.metrics = Metrics(max_model_len=max(limits, default=DEFAULT_METRICS_MAX_MODEL_LEN))
        self.metrics.registry.register(TaskCountCollector())
        for name in self.config.model_names:
            self.metrics.add_model(name)

    # -- requests --------------------------------------------------------------

    @property
    def default_name(self) -> str:
        return self.config.model_names[0]

    def get(self, name: str | None) -> ServedModel:
        """The model a request names (None: the first); raises
        ``NotFoundError`` for an unknown name and ``ServiceUnavailable``
        unless the host is ready."""
        if name is not None and name not in self.config.model_names:
            adapter = served_adapter(self.models.values(), name)  # a LoRA adapter's name (web/lora_api.py)
            if adapter is None:
                raise NotFoundError.model(name, self.config.model_names)
            self.raise_unless_ready()
            return adapter
        self.raise_unless_ready()
        return self.models[self.default_name if name is None else name]

    def raise_unless_ready(self) -> None:
        if self.state is HostState.LOADING:
            raise ServiceUnavailable.loading(retry_after=LOADING_RETRY_AFTER)
        if self.state is HostState.FAILED:
            raise ServiceUnavailable(f"the server's engine failed: {self.error}", code="failed")
        if self.state is not HostState.READY:
            raise ServiceUnavailable.draining()

    # -- lifecycle -------------------------------------------------------------

    async def wait_ready(self) -> None:
        """Return once the engines serve; raise if loading failed or the host stopped first."""
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_after, self._ready.wait, scope)
                nursery.start_soon(cancel_after, self._stopped.wait, scope)
        if self.state is not HostState.READY:
            self.raise_unless_ready()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def wait_draining(self) -> None:
        """Return once ``begin_drain`` has been called (the gRPC health service's cue)."""
        await self._drain_requested.wait()

    def begin_drain(self) -> None:
        """Stop taking requests; in-flight ones get ``shutdown_timeout`` seconds."""
        if self.state in (HostState.LOADING, HostState.READY):
            self.state = HostState.DRAINING
        self._drain_requested.set()

    def abort_all(self) -> None:
        """Drain, and abort what is in flight now rather than after the timeout."""
        self.begin_drain()
        self._abort_now.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load, serve until ``begin_drain``, drain, close. A failure to load
        or start is logged and kept in ``error`` (the state is then
        ``FAILED``), so that a server under hypercorn's own command line
        keeps answering ``/health`` with 503 instead of losing its lifespan."""
        task_status.started()
        try:
            async with contextlib.AsyncExitStack() as stack:
                for spec in self.config.models:
                    if self._drain_requested.is_set():
                        break
                    if spec.name not in self.preloaded:
                        # open_engine loads it, on the engine's step thread.
                        log.info("loading %s from %s", spec.name, spec.path or "the default model")
                    engine = await stack.enter_async_context(
                        open_engine(
                            self.config.engine_config(spec),
                            loaded=self.preloaded.get(spec.name),
                            shutdown_timeout=self.config.shutdown_timeout,
                        )
                    )
                    self.models[spec.name] = ServedModel(spec.name, engine, self.metrics)
                    if self.config.slo_profile is not None:
                        # Before any request, so admission predicts from it at once.
                        seed_engine(engine, self.config.slo_profile)
                    log.info(
                        "serving %s (max_model_len %d; %s)",
                        spec.name,
                        engine.max_model_len,
                        engine.projection_choice.summary,
                    )
                if not self._drain_requested.is_set():
                    self.state = HostState.READY
                    self._ready.set()
                    await self._drain_requested.wait()
                await self._drain()
                if self.config.slo_profile is not None:
                    # Drained: every step the engines will take is learned from.
                    for model in self.models.values():
                        save_engine(model.engine, self.config.slo_profile)
        except Exception as exc:
            if isinstance(exc, TrioserveError | LatencyProfileError):  # precise already: no traceback
                log.error("cannot serve: %s", exc)
            else:
                log.exception("the engines failed")
            self.error = exc
            self.state = HostState.FAILED
        finally:
            if self.state is not HostState.FAILED:
                self.state = HostState.STOPPED
            self._stopped.set()

    async def _drain(self) -> None:
        async def drain(model: ServedModel, timeout: float) -> None:
            aborted = await model.engine.drain(timeout)
            if aborted:
                log.info("%s: aborted %d request(s) still running at shutdown", model.name, aborted)

        async with trio.open_nursery() as watcher:
            with trio.CancelScope() as graceful:
                watcher.start_soon(cancel_after, self._abort_now.wait, graceful)
                async with trio.open_nursery() as drains:
                    for model in self.models.values():
                        drains.start_soon(drain, model, self.config.shutdown_timeout)
            if graceful.cancelled_caught:
                # Asked to stop at once: abort what is left now.
                async with trio.open_nursery() as drains:
                    for model in self.models.values():
                        drains.start_soon(drain, model, 0)
            watcher.cancel_scope.cancel()


def current_host() -> ModelHost:
    """The host of the app handling the current request."""
    return current_app.extensions[EXTENSION]
