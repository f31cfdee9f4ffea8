"""The options of ``trioserve serve``, and the ``ServerConfig`` they describe.

``build_serve_parser`` adds them to a parser; ``server_config_from_args``
builds the config from a parsed command line, and
``server_config_from_env`` from ``TRIOSERVE_*`` environment variables (for
``hypercorn --worker-class trio 'trioserve.web.app:create_app()'``), both
from the same option definitions. The dependency runs one way: the CLI and
the app import this module, this module imports the settings and the
engine's options.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Mapping

from trioserve.engine.config import DEFAULT_WATCHDOG_TIMEOUT

from .engine_options import (
    GROUPS,
    add_engine_options,
    add_option_groups,
    add_overload_options,
    engine_config_from_args,
    option_group,
    overload_config_from_args,
)
from .parsers import REASONING_CHOICES, TOOL_CALL_CHOICES
from .slo_options import add_slo_options, slo_config_from_args, slo_profile_from_args
from .option_types import count, recording, seconds, size_in_bytes, watchdog_seconds
from .settings import (
    DEFAULT_BATCH_MAX_IN_FLIGHT,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_KEEP_ALIVE_TIMEOUT,
    DEFAULT_MAX_BODY_SIZE,
    DEFAULT_MAX_UPLOAD_SIZE,
    DEFAULT_RESPONSES_STORE_SIZE,
    DEFAULT_SEND_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT,
    ENV_PREFIX,
    ModelSpec,
    ServerConfig,
)


def build_serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of ``trioserve serve``, added to ``parser`` (default: a
    new one). ``server_config_from_env`` reads the same options."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="trioserve serve")
    _add_serve_options(parser)
    return parser


def _add_serve_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add ``trioserve serve``'s options to ``parser``, grouped by concern
    (``GROUPS``); returns them, in order."""
    add_option_groups(parser, *GROUPS)
    actions: list[argparse.Action] = []
    add = recording(option_group(parser, "server"), actions)
    add("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    add("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    add(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version",
    )
    add(
        "--max-body-size", type=size_in_bytes, default=DEFAULT_MAX_BODY_SIZE, help="largest request body, e.g. 1M (default: 1M)"
    )
    add(
        "--keep-alive-timeout",
        type=seconds,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT,
        help="seconds before closing a connection with no request under way: idle between requests, "
        f"or its request headers incomplete (default: {DEFAULT_KEEP_ALIVE_TIMEOUT:g})",
    )
    add(
        "--body-timeout",
        type=seconds,
        default=DEFAULT_BODY_TIMEOUT,
        help=f"seconds a request body may take to arrive; then 408 and the connection closes (default: {DEFAULT_BODY_TIMEOUT:g})",
    )
    add(
        "--send-timeout",
        type=seconds,
        default=DEFAULT_SEND_TIMEOUT,
        help="seconds a response may wait on a client that reads none of it before the connection is dropped "
        f"(default: {DEFAULT_SEND_TIMEOUT:g})",
    )
    add(
        "--max-connections",
        type=count,
        default=None,
        help="open connections beyond which new ones get 503 (default: 2048, less under a low file descriptor limit)",
    )
    add(
        "--plugins",
        type=_names,
        default=(),
        help="plugins to load, by entry-point name, comma-separated (docs/api.md, 'Plugins'); "
        "an unknown name stops startup (default: none)",
    )
    add(
        "--responses-store-size",
        type=count,
        default=DEFAULT_RESPONSES_STORE_SIZE,
        help="responses /v1/responses keeps for GET and previous_response_id, in memory; beyond it the least "
        f"recently used is dropped (default: {DEFAULT_RESPONSES_STORE_SIZE})",
    )
    add(
        "--reasoning-parser",
        choices=REASONING_CHOICES,
        default=None,
        help="how a reasoning model's thinking is read into reasoning_content: "
        "qwen3 (<think>), deepseek_r1, gpt_oss (harmony), none; default: from the chat template",
    )
    add(
        "--tool-call-parser",
        choices=TOOL_CALL_CHOICES,
        default=None,
        help="how the model writes tool calls: hermes, llama3_json, mistral, qwen3_coder, openai (harmony); "
        "default: from the chat template",
    )
    add(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve the gRPC API (proto/trioserve.proto) and grpc.health.v1 on --host at this port; "
        "0 picks a free one (default: no gRPC)",
    )
    add(
        "--batch-dir",
        default=None,
        help="folder of the Batch API's files and batches; batches in progress there resume at startup "
        "(default: $TRIOSERVE_BATCH_DIR, else batches in $TRIOSERVE_CACHE, else ~/.cache/trioserve/batches)",
    )
    add(
        "--max-upload-size",
        type=size_in_bytes,
        default=DEFAULT_MAX_UPLOAD_SIZE,
        help="largest file POST /v1/files takes, e.g. 100M; beyond it 413 (default: 100M)",
    )
    add(
        "--batch-max-in-flight",
        type=count,
        default=DEFAULT_BATCH_MAX_IN_FLIGHT,
        help=f"lines of one batch in the engine at once, at low priority (default: {DEFAULT_BATCH_MAX_IN_FLIGHT})",
    )

    add = recording(option_group(parser, "reliability"), actions)
    add(
        "--max-request-time", type=seconds, default=None, help="cap on every request's deadline, in seconds (default: none)"
    )
    add(
        "--shutdown-timeout",
        type=seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help=f"seconds in-flight requests may run on after SIGTERM/SIGINT (default: {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    add(
        "--max-queued-requests", type=int, default=256, help="admission queue bound; beyond it requests get 429 (default: 256)"
    )
    add("--max-queued-tokens", type=int, default=None, help="bound on queued prompt tokens (default: none)")
    actions += add_overload_options(parser)
    actions += add_slo_options(parser, option_group(parser, "reliability"))
    add(
        "--watchdog-timeout",
        type=watchdog_seconds,
        default=DEFAULT_WATCHDOG_TIMEOUT,
        help="seconds a model step may run before it is declared hung: its requests fail, the engine goes on "
        f"on a fresh step thread and /health reports it; 0 turns the watchdog off (default: {DEFAULT_WATCHDOG_TIMEOUT:g})",
    )

    add = recording(option_group(parser, "observability"), actions)
    add(
        "--log-requests", action="store_true", help="log each request's body (prompts included); off by default"
    )
    # Request ids and tracing (web/request_ids.py, web/tracing.py).
    add(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="do not log a line per response (method, path, status, size, time, X-Request-Id)",
    )
    add(
        "--otlp-traces-endpoint",
        default=None,
        help="export a span per request to this OTLP collector, e.g. http://127.0.0.1:4318 "
        "(needs the 'tracing' extra; OTEL_* variables apply; default: off)",
    )
    actions += add_engine_options(parser, several_models=True)
    return actions


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ``ServerConfig`` that ``trioserve serve``'s options describe;
    ``ValueError`` names what is wrong with them (a ``--model`` that is not
    ``NAME=PATH`` or a path, two models of one name, ...)."""
    specs = [ModelSpec.parse(text) for text in args.model or []] or [ModelSpec.from_path(None)]
    engine = engine_config_from_args(
        args,
        model=None,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        **overload_config_from_args(args),
        **slo_config_from_args(args),
        watchdog_timeout=args.watchdog_timeout or None,  # 0: off
        plugins=args.plugins,
    )
    return ServerConfig(
        engine=engine,
        models=tuple(specs),
        api_key=args.api_key,
        max_request_time=args.max_request_time,
        shutdown_timeout=args.shutdown_timeout,
        max_body_size=args.max_body_size,
        keep_alive_timeout=args.keep_alive_timeout,
        body_timeout=args.body_timeout,
        send_timeout=args.send_timeout,
        max_connections=args.max_connections,
        log_requests=args.log_requests,
        responses_store_size=args.responses_store_size,
        access_log=args.access_log,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        grpc_port=args.grpc_port,
        grpc_host=args.host,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        batch_dir=args.batch_dir,
        max_upload_size=args.max_upload_size,
        batch_max_in_flight=args.batch_max_in_flight,
        slo_profile=slo_profile_from_args(args),
    )


def server_config_from_env(environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Read ``trioserve serve``'s options from the environment (default: ``os.environ``).

    Each option ``--some-option`` is ``TRIOSERVE_SOME_OPTION``; flags
    take ``1``/``true``/``yes``/``on``; ``TRIOSERVE_MODEL`` may list several
    models separated by commas. ``TRIOSERVE_ARGS`` may hold further
    options in command-line form. ``--host`` and ``--port`` are
    hypercorn's business there and are ignored.
    """
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="trioserve serve")
    argv = shlex.split(environ.get(ENV_PREFIX + "ARGS", ""))
    for action in _add_serve_options(parser):
        option = next((s for s in action.option_strings if s.startswith("--")), None)
        if option is None:
            continue
        value = environ.get(ENV_PREFIX + option[2:].upper().replace("-", "_"))
        if value is None:
            continue
        if action.nargs == 0:  # a flag
            if value.strip().lower() in ("1", "true", "yes", "on"):
                argv.append(option)
        elif action.dest == "model":
            for item in value.split(","):
                if item.strip():
                    argv += [option, item.strip()]
        else:
            argv += [option, value]
    return server_config_from_args(parser.parse_args(argv))
