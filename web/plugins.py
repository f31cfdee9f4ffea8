"""The server's side of the plugins (engine/plugins.py): request
pre-processors, output post-processors and metrics collectors.

``ServerPlugins.load(names)`` runs at ``create_app``, before any model
loads, so an unknown name stops startup at once. Each hook is isolated: a
pre-processor that raises (other than ``PluginRejection``), a
post-processor that raises or returns something other than a
``RequestOutput``, fails only its own request with a 500 whose ``code`` is
``plugin_error`` and whose message names the plugin; a collector whose
``collect`` raises is left out of that scrape, with a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import attrs
from prometheus_client import CollectorRegistry

from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.plugins import PluginError, PluginLoadError, PluginRejection, Plugins, RequestContext

from .errors import ApiError

log = logging.getLogger(__name__)

# The key of the loaded ``ServerPlugins`` in ``app.extensions``.
PLUGINS_EXTENSION = "trioserve.plugins"


@attrs.frozen
class ServerPlugins:
    """The plugins the server applies, as loaded by ``Plugins.load``."""

    plugins: Plugins = attrs.field(factory=Plugins)

    @classmethod
    def load(cls, names: Iterable[str]) -> ServerPlugins:
        return cls(Plugins.load(names))

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Let each metrics plugin register its collectors on ``registry``."""
        for name, register in self.plugins.metrics:
            try:
                register(_GuardedRegistry(registry, name))
            except Exception as exc:
                raise PluginLoadError(f"metrics plugin {name!r} failed to register: {type(exc).__name__}: {exc}") from exc

    def preprocess(self, body: Any, context: RequestContext) -> Any:
        """``body`` as the pre-processors leave it; raises ``ApiError``."""
        for name, preprocess in self.plugins.request_preprocessors:
            try:
                body = preprocess(body, context)
            except PluginRejection as rejection:
                raise ApiError(
                    rejection.status,
                    rejection.message,
                    type="invalid_request_error",
                    param=rejection.param,
                    code=rejection.code or "rejected_by_plugin",
                ) from None
            except Exception as exc:
                raise _failed(name, "request pre-processor", exc) from None
            if not isinstance(body, dict):
                raise _failed(name, "request pre-processor", TypeError(f"it returned {type(body).__name__}, not a dict"))
        return body

    def postprocessed(self, stream: Any, context: RequestContext, n: int) -> Any:
        """``stream`` with the post-processors applied to each output (itself when there are none)."""
        if not self.plugins.output_postprocessors:
            return stream
        processors = []
        for name, factory in self.plugins.output_postprocessors:
            try:
                processors.append((name, factory(context)))
            except Exception as exc:
                stream.close()
                raise _failed(name, "output post-processor", exc) from None
        return PostprocessedStream(stream, processors, n)


def current_plugins() -> ServerPlugins:
    """The plugins of the app handling the current request."""
    from quart import current_app

    return current_app.extensions[PLUGINS_EXTENSION]


def plugin_error(exc: PluginError) -> ApiError:
    """The 500 a request gets when a plugin failed on it."""
    return ApiError(500, str(exc), type="server_error", code="plugin_error")


def _failed(name: str, hook: str, exc: Exception) -> ApiError:
    error = PluginError.from_exception(name, hook, exc)
    log.error("%s: %s", error, error.detail)
    return plugin_error(error)


@attrs.define(eq=False)
class PostprocessedStream:
    """A ``RequestStream`` whose outputs pass through post-processors.

    A processor may return a changed output (``attrs.evolve``). One whose
    output has a ``finish_reason`` ends that completion there: its later
    outputs are dropped, and once every completion has ended the request
    is closed (aborted, if the engine still runs it; its blocks are freed).
    A processor that raises ends the request with ``ApiError`` (500,
    ``plugin_error``).
    """

    stream: Any
    processors: list[tuple[str, Callable[[RequestOutput], RequestOutput]]]
    n: int
    _ended: set[int] = attrs.field(factory=set, init=False)

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    def close(self) -> None:
        self.stream.close()

    def __aiter__(self) -> PostprocessedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if len(self._ended) >= self.n:
                self.close()
                raise StopAsyncIteration
            output = await self.stream.__anext__()
            if output.index in self._ended:
                continue  # a processor stopped this completion
            for name, process in self.processors:
                try:
                    output = process(output)
                    if not isinstance(output, RequestOutput):
                        raise TypeError(f"it returned {type(output).__name__}, not a RequestOutput")
                except Exception as exc:
                    self.close()
                    raise _failed(name, "output post-processor", exc) from None
            if output.finish_reason is not None:
                self._ended.add(output.index)
            return output


class _GuardedRegistry:
    """What a metrics plugin registers on: its collectors go on the app's
    registry wrapped so that a failing ``collect`` cannot break ``/metrics``."""

    def __init__(self, registry: CollectorRegistry, plugin: str) -> None:
        self._registry = registry
        self._plugin = plugin

    def register(self, collector: Any) -> None:
        self._registry.register(_GuardedCollector(collector, self._plugin))

    def unregister(self, collector: Any) -> None:
        raise NotImplementedError("plugins' collectors stay registered for the server's life")


class _GuardedCollector:
    def __init__(self, collector: Any, plugin: str) -> None:
        self._collector = collector
        self._plugin = plugin

    def describe(self) -> list[Any]:
        describe = getattr(self._collector, "describe", None)
        return list(describe()) if describe is not None else []

    def collect(self) -> list[Any]:
        try:
            return list(self._collector.collect())
        except Exception as exc:
            log.error("metrics plugin %r: collect failed (%s: %s); left out of this scrape", self._plugin, type(exc).__name__, exc)
            return []
