"""The server's configuration: which models to serve, and how.

``ServerConfig`` holds one ``EngineConfig`` (shared by every served model,
each taking its own ``model`` path) plus the HTTP side: API key, request
deadline cap, body size limit, shutdown timeout, and the connections'
timeouts and cap. ``trioserve serve``
builds it from its options, and ``hypercorn --worker-class trio
'trioserve.web.app:create_app()'`` from ``TRIOSERVE_*`` environment
variables (both in ``web/serve_options.py``).
"""

from __future__ import annotations

from pathlib import Path

import attrs

from trioserve.engine.config import EngineConfig
from trioserve.engine.loading.sources import DEFAULT_MODEL_NAME
from trioserve.engine.validators import optional_positive, positive

from .parsers import REASONING_CHOICES, TOOL_CALL_CHOICES

DEFAULT_MAX_BODY_SIZE = 1 << 20
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# Connection timeouts, in seconds (docs/api.md, "Connections"): an idle
# keep-alive connection, or one whose request headers are not in yet; a
# request body still arriving; a response the client has stopped reading.
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_SEND_TIMEOUT = 120.0
# The Batch API (web/batches_api.py): the largest file POST /v1/files takes,
# and how many of one batch's lines are in the engine at once.
DEFAULT_MAX_UPLOAD_SIZE = 100 << 20
DEFAULT_BATCH_MAX_IN_FLIGHT = 8
ENV_PREFIX = "TRIOSERVE_"
DEFAULT_RESPONSES_STORE_SIZE = 256


@attrs.frozen
class ModelSpec:
    """One served model: ``name`` is what requests put in ``model``, ``path``
    what the loader reads (None: the default model)."""

    name: str
    path: str | None

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """``NAME=PATH``, or just ``PATH`` (named as the loader names it)."""
        name, sep, path = text.partition("=")
        if sep:
            if not name or not path:
                raise ValueError(f"expected NAME=PATH with both parts, got {text!r}")
            return cls(name, None if path.lower() == DEFAULT_MODEL_NAME.lower() else path)
        return cls.from_path(text)

    @classmethod
    def from_path(cls, path: str | None) -> ModelSpec:
        """The spec the loader would name: the default model's name, a
        file's stem, or a folder's name."""
        if path is None or path.lower() == DEFAULT_MODEL_NAME.lower():
            return cls(DEFAULT_MODEL_NAME, None)
        source = Path(path).expanduser()
        return cls(source.stem if source.is_file() else source.resolve().name, path)


def _nonempty(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    # An empty key would let "Authorization: Bearer " through.
    if value is not None and not value:
        raise ValueError(f"{attribute.name} must not be empty (omit it for no key)")


def _unique_names(instance: object, attribute: attrs.Attribute, value: tuple[ModelSpec, ...]) -> None:
    if not value:
        raise ValueError("models must name at least one model")
    names = [spec.name for spec in value]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"model names must be unique; {', '.join(map(repr, duplicates))} given twice")


def _optional_traces_url(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None:
        from .tracing import traces_url  # here, so that reading settings imports no quart

        traces_url(value)  # raises ValueError naming the field


def _slo_profile(instance: ServerConfig, attribute: attrs.Attribute, value: str | None) -> None:
    # The profile is the slo policy's latency model (web/slo_profile.py):
    # another policy learns none, so the flag would silently do nothing.
    if value is None:
        return
    if instance.engine.scheduling_policy != "slo":
        raise ValueError("--slo-profile needs --scheduling-policy slo (the latency model it saves is the slo policy's)")
    if len(instance.models) > 1:
        raise ValueError("--slo-profile takes one served model (each model learns its own latency model)")
    if not value:
        raise ValueError("--slo-profile must be a path, got ''")


def _optional_port(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and not (isinstance(value, int) and 0 <= value <= 65535):
        raise ValueError(f"{attribute.name} must be a port number in [0, 65535], got {value!r}")


@attrs.frozen(kw_only=True)
class ServerConfig:
    """Everything ``create_app`` needs.

    ``engine.model`` is ignored: each of ``models`` gets ``engine`` with its
    own path. The first model answers requests that name none.
    ``max_request_time`` caps every request's deadline (seconds; None: no
    cap). ``shutdown_timeout`` is how long in-flight requests may run on
    after SIGTERM before they are aborted.

    Connections: ``keep_alive_timeout`` closes a connection that has no
    request under way (idle, or its request headers still incomplete);
    ``body_timeout`` bounds the time a request body takes to arrive;
    ``send_timeout`` drops a connection whose client has read nothing of
    its response for that long; ``max_connections`` caps open connections
    (beyond it new ones get a 503; None: worked out from the process's file
    descriptor limit when serving starts). ``log_requests`` logs each
    request's body; without it no body or prompt is ever logged.
    """

    engine: EngineConfig = attrs.field(factory=EngineConfig)
    models: tuple[ModelSpec, ...] = attrs.field(
        default=(ModelSpec(DEFAULT_MODEL_NAME, None),), converter=tuple, validator=_unique_names
    )
    api_key: str | None = attrs.field(default=None, validator=_nonempty)
    max_request_time: float | None = attrs.field(default=None, validator=optional_positive)
    shutdown_timeout: float = attrs.field(default=DEFAULT_SHUTDOWN_TIMEOUT, validator=positive)
    max_body_size: int = attrs.field(default=DEFAULT_MAX_BODY_SIZE, validator=positive)
    keep_alive_timeout: float = attrs.field(default=DEFAULT_KEEP_ALIVE_TIMEOUT, validator=positive)
    body_timeout: float = attrs.field(default=DEFAULT_BODY_TIMEOUT, validator=positive)
    send_timeout: float = attrs.field(default=DEFAULT_SEND_TIMEOUT, validator=positive)
    max_connections: int | None = attrs.field(default=None, validator=optional_positive)
    log_requests: bool = False
    # Hypercorn's access log, one line per response with its X-Request-Id
    # (web/request_ids.py).
    access_log: bool = True
    # OTLP collector for request spans (web/tracing.py); None: off unless
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set.
    otlp_traces_endpoint: str | None = attrs.field(default=None, validator=_optional_traces_url)
    # gRPC (rpc/, docs/api.md "gRPC"): served on grpc_host:grpc_port beside
    # the HTTP server when grpc_port is set (0 picks a free port).
    grpc_port: int | None = attrs.field(default=None, validator=_optional_port)
    grpc_host: str = "127.0.0.1"
    # Responses /v1/responses keeps for GET and previous_response_id
    # (web/responses_store.py), the least recently used dropped beyond it.
    responses_store_size: int = attrs.field(default=DEFAULT_RESPONSES_STORE_SIZE, validator=positive)
    # How chat output is read (web/parsers.py): None or "auto" picks by
    # each model's chat template; "none" turns reasoning parsing off.
    reasoning_parser: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.in_(REASONING_CHOICES)))
    tool_call_parser: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.in_(TOOL_CALL_CHOICES)))
    # The Batch API (web/batches_api.py): where files and batches are kept
    # (None: web/batch_store.py's default_batch_dir()), the largest upload,
    # and the lines of one batch in the engine at once.
    batch_dir: str | None = None
    max_upload_size: int = attrs.field(default=DEFAULT_MAX_UPLOAD_SIZE, validator=positive)
    batch_max_in_flight: int = attrs.field(default=DEFAULT_BATCH_MAX_IN_FLIGHT, validator=positive)
    # Where the latency model is kept across restarts (web/slo_profile.py):
    # seeded from at start, written at stop; None: learned afresh each run.
    slo_profile: str | None = attrs.field(default=None, validator=_slo_profile)

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.models)

    def engine_config(self, spec: ModelSpec) -> EngineConfig:
        """The engine config of one served model."""
        return attrs.evolve(self.engine, model=spec.path)
