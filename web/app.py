"""``create_app``: the OpenAI-compatible server as a quart-trio app.

The engines run in the app's serving nursery: ``before_serving`` starts the
``ModelHost`` there (it loads the models in a worker thread while ``/health``
answers 503), and ``after_serving`` drains them. Serve the app with
``trioserve serve`` (``web/serve.py``) or with hypercorn's own command line,
configured by ``TRIOSERVE_*`` environment variables::

    TRIOSERVE_API_KEY=secret hypercorn --worker-class trio 'trioserve.web.app:create_app()'
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from quart_trio import QuartTrio

from trioserve.engine.loading.loader import LoadedModel

from . import routes
from .asgi import TrioserveApp
from .completions import translate
from .host import EXTENSION, ModelHost
from .plugins import PLUGINS_EXTENSION, ServerPlugins
from .serve_options import server_config_from_env
from .settings import ServerConfig
from .slo_door import GrpcObjectives
from .tracing import Tracing
from .tracing import register as register_tracing

if TYPE_CHECKING:
    from trioserve.rpc.service import GrpcService

# The key of the gRPC service in ``app.extensions``.
GRPC_EXTENSION = "trioserve.grpc"
# Seconds past ``shutdown_timeout`` that the engines get to abort what is
# left and close, before quart cancels the serving nursery.
SHUTDOWN_MARGIN = 10.0


def create_app(
    config: ServerConfig | None = None,
    *,
    loaded: LoadedModel | Mapping[str, LoadedModel] | None = None,
    tracing: Tracing | None = None,
) -> QuartTrio:
    """The app serving ``config`` (default: from the ``TRIOSERVE_*`` variables).

    ``loaded`` hands over models already in memory: one ``LoadedModel`` for
    the first served model, or a mapping from served names. ``tracing``
    traces requests with a ``Tracing`` of the caller's (default: as
    ``config.otlp_traces_endpoint`` and the ``OTEL_*`` variables say; off).
    """
    if config is None:
        config = server_config_from_env()
    if isinstance(loaded, LoadedModel):
        loaded = {config.model_names[0]: loaded}
    # Plugins load before any model, so an unknown name stops startup at once.
    plugins = ServerPlugins.load(config.engine.plugins)
    host = ModelHost(config, dict(loaded or {}))
    plugins.register_metrics(host.metrics.registry)
    app = TrioserveApp(__name__)
    app.config.update(
        # A stream lasts as long as its generation; quart would cut any
        # response body after 60 s (streams also set response.timeout).
        RESPONSE_TIMEOUT=None,
        # web/body.py enforces config.max_body_size with our own 413.
        MAX_CONTENT_LENGTH=None,
        BACKGROUND_TASK_SHUTDOWN_TIMEOUT=config.shutdown_timeout + SHUTDOWN_MARGIN,
    )
    app.extensions[EXTENSION] = host
    if tracing is None:
        tracing = Tracing.from_endpoint(config.otlp_traces_endpoint)
    if tracing is not None:
        register_tracing(app, tracing)  # before the routes' hooks: refusals get spans too
    app.extensions[PLUGINS_EXTENSION] = plugins
    routes.register(app)
    grpc_service = _grpc_service(app, host)

    @app.before_serving
    async def start_engines() -> None:
        await app.nursery.start(host.run)
        if grpc_service is not None:
            await app.nursery.start(grpc_service.run)

    @app.after_serving
    async def stop_engines() -> None:
        host.begin_drain()
        await host.wait_stopped()
        if tracing is not None:
            await tracing.shutdown()  # the drained requests' spans go out too
        if grpc_service is not None:
            await grpc_service.wait_stopped()

    return app


def _grpc_service(app: QuartTrio, host: ModelHost) -> GrpcService | None:
    """The gRPC service ``host.config`` asks for (``grpc_port``), kept in ``app.extensions``."""
    if host.config.grpc_port is None:
        return None
    from trioserve.rpc.service import GrpcService, bind_address

    config = host.config
    service = GrpcService(
        host,
        bind_address(config.grpc_host, config.grpc_port),
        translate=functools.partial(translate, log_requests=config.log_requests),
        objectives=GrpcObjectives(),
        plugins=app.extensions[PLUGINS_EXTENSION],
        max_request_time=config.max_request_time,
    )
    app.extensions[GRPC_EXTENSION] = service
    return service


def app_grpc(app: QuartTrio) -> GrpcService | None:
    """The gRPC service of an app made by ``create_app`` (None without ``grpc_port``);
    its ``port`` is the bound one once serving."""
    return app.extensions.get(GRPC_EXTENSION)


def app_host(app: QuartTrio) -> ModelHost:
    """The ``ModelHost`` of an app made by ``create_app``."""
    return app.extensions[EXTENSION]
