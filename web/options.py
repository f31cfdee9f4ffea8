"""The options of the commands that start an engine, and the configs they describe.

``trioserve serve``'s options build a ``ServerConfig`` from a command line
(``server_config_from_args``) or from ``TRIOSERVE_*`` environment variables
(``server_config_from_env``, for
``hypercorn --worker-class trio 'trioserve.web.app:create_app()'``); both
read the same option definitions. The CLI imports this module, and this
module imports the settings: the dependency runs one way.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from trioserve.engine.config import DEFAULT_WATCHDOG_TIMEOUT, DegradationPolicy, EngineConfig

from .settings import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_KEEP_ALIVE_TIMEOUT,
    DEFAULT_MAX_BODY_SIZE,
    DEFAULT_SEND_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT,
    ENV_PREFIX,
    ModelSpec,
    ServerConfig,
)


def _recording(parser: Any, actions: list[argparse.Action]) -> Callable[..., argparse.Action]:
    """``parser.add_argument`` (a parser's or an argument group's) that also
    appends each option it adds to ``actions``, so the options can be read
    back without argparse's internals."""

    def add(*args, **kwargs) -> argparse.Action:
        action = parser.add_argument(*args, **kwargs)
        actions.append(action)
        return action

    return add


def add_engine_options(parser: argparse.ArgumentParser, *, several_models: bool = False) -> list[argparse.Action]:
    """Options shared by every command that starts an engine; with
    ``several_models``, ``--model`` may repeat (``args.model`` is a list).
    Returns the options added, in order."""
    actions: list[argparse.Action] = []
    add = _recording(parser, actions)
    if several_models:
        add(
            "--model",
            action="append",
            default=None,
            help="checkpoint folder, .gguf file, or NAME=PATH; repeat to serve several models, "
            "requests pick one by their model field (default: SmolLM2-135M-Instruct)",
        )
    else:
        add("--model", default=None, help="checkpoint folder, .gguf file (default: SmolLM2-135M-Instruct)")
    add("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    add("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when present)")
    add("--block-size", type=int, default=16)
    add("--kv-cache-memory", default=None, help="bytes (e.g. 2G) or a fraction of free memory (e.g. 0.5)")
    add("--max-model-len", type=int, default=None)
    add("--max-num-seqs", type=int, default=64)
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--no-prefix-caching", action="store_true")
    add("--num-threads", type=int, default=None, help="torch threads for the model step")
    return actions


def parse_memory(text: str | None) -> int | float | None:
    """``'2G'`` -> bytes, ``'0.5'`` -> a fraction, ``None`` -> None."""
    if text is None:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    value = float(text)
    return value if value <= 1.0 else int(value)


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    fields = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=parse_memory(args.kv_cache_memory),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
    )
    fields.update(overrides)
    return EngineConfig(**fields)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _watchdog_seconds(text: str) -> float:
    """Seconds > 0, or 0 for no watchdog."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no watchdog), got {text!r}")
    return value


def _bytes(text: str) -> int:
    try:
        value = parse_memory(text)
    except ValueError:
        value = None
    if not isinstance(value, int) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 1048576 or 1M, got {text!r}")
    return value


def _fraction_or_off(text: str) -> float | None:
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] or 'off', got {text!r}")
    return value


def add_overload_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Overload control (docs/reliability.md, "Overload control"); returns
    the options added, in order."""
    engine, policy = EngineConfig(), DegradationPolicy()
    group = parser.add_argument_group("overload control")
    actions: list[argparse.Action] = []
    add = _recording(group, actions)
    add(
        "--max-queue-time",
        type=_seconds,
        default=None,
        help="drop a request that waited this long (seconds) before any compute, with 503 (default: no bound)",
    )
    add(
        "--adaptive-concurrency",
        action="store_true",
        help="lower the running-sequence limit while TPOT p90 is above --target-tpot-ms, raise it while below",
    )
    add(
        "--target-tpot-ms",
        type=_seconds,  # any finite number > 0
        default=engine.target_tpot_ms,
        help=f"the TPOT p90 adaptive concurrency steers to, in ms (default: {engine.target_tpot_ms:g})",
    )
    add(
        "--no-priority-shedding",
        action="store_true",
        help="a full queue refuses a new request instead of dropping a queued one of lower priority",
    )
    add(
        "--low-priority",
        type=int,
        default=policy.low_priority,
        help=f"priority values from this one up count as low priority (default: {policy.low_priority})",
    )
    add(
        "--cap-low-priority-at",
        type=_fraction_or_off,
        default=policy.cap_at,
        metavar="FRACTION|off",
        help=f"queue fill from which new low-priority requests get max_tokens capped (default: {policy.cap_at:g})",
    )
    add(
        "--low-priority-max-tokens",
        type=int,
        default=policy.low_priority_max_tokens,
        help=f"that cap (default: {policy.low_priority_max_tokens})",
    )
    add(
        "--refuse-expensive-at",
        type=_fraction_or_off,
        default=policy.refuse_expensive_at,
        metavar="FRACTION|off",
        help=f"queue fill from which n > 1 and many top logprobs get 429 (default: {policy.refuse_expensive_at:g})",
    )
    add(
        "--expensive-logprobs",
        type=int,
        default=policy.expensive_logprobs,
        help=f"more top logprobs than this count as expensive (default: {policy.expensive_logprobs})",
    )
    return actions


def overload_config_from_args(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields that ``add_overload_options`` set."""
    return dict(
        max_queue_time=args.max_queue_time,
        adaptive_concurrency=args.adaptive_concurrency,
        target_tpot_ms=args.target_tpot_ms,
        degradation=DegradationPolicy(
            low_priority=args.low_priority,
            cap_at=args.cap_low_priority_at,
            low_priority_max_tokens=args.low_priority_max_tokens,
            refuse_expensive_at=args.refuse_expensive_at,
            expensive_logprobs=args.expensive_logprobs,
            shed_lower_priority=not args.no_priority_shedding,
        ),
    )


def _model_spec(text: str) -> ModelSpec:
    try:
        return ModelSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of ``trioserve serve``, added to ``parser`` (default: a
    new one). ``server_config_from_env`` reads the same options."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="trioserve serve")
    _add_serve_options(parser)
    return parser


def _add_serve_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add ``trioserve serve``'s options to ``parser``; returns them, in order."""
    actions: list[argparse.Action] = []
    add = _recording(parser, actions)
    add("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    add("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    add(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version",
    )
    add(
        "--max-request-time", type=_seconds, default=None, help="cap on every request's deadline, in seconds (default: none)"
    )
    add(
        "--shutdown-timeout",
        type=_seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help=f"seconds in-flight requests may run on after SIGTERM/SIGINT (default: {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    add(
        "--max-body-size", type=_bytes, default=DEFAULT_MAX_BODY_SIZE, help="largest request body, e.g. 1M (default: 1M)"
    )
    add(
        "--keep-alive-timeout",
        type=_seconds,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT,
        help="seconds before closing a connection with no request under way: idle between requests, "
        f"or its request headers incomplete (default: {DEFAULT_KEEP_ALIVE_TIMEOUT:g})",
    )
    add(
        "--body-timeout",
        type=_seconds,
        default=DEFAULT_BODY_TIMEOUT,
        help=f"seconds a request body may take to arrive; then 408 and the connection closes (default: {DEFAULT_BODY_TIMEOUT:g})",
    )
    add(
        "--send-timeout",
        type=_seconds,
        default=DEFAULT_SEND_TIMEOUT,
        help="seconds a response may wait on a client that reads none of it before the connection is dropped "
        f"(default: {DEFAULT_SEND_TIMEOUT:g})",
    )
    add(
        "--max-connections",
        type=_count,
        default=None,
        help="open connections beyond which new ones get 503 (default: 2048, less under a low file descriptor limit)",
    )
    add(
        "--log-requests", action="store_true", help="log each request's body (prompts included); off by default"
    )
    add(
        "--max-queued-requests", type=int, default=256, help="admission queue bound; beyond it requests get 429 (default: 256)"
    )
    add("--max-queued-tokens", type=int, default=None, help="bound on queued prompt tokens (default: none)")
    actions += add_overload_options(parser)
    add(
        "--watchdog-timeout",
        type=_watchdog_seconds,
        default=DEFAULT_WATCHDOG_TIMEOUT,
        help="seconds a model step may run before it is declared hung: its requests fail, the engine goes on "
        f"on a fresh step thread and /health reports it; 0 turns the watchdog off (default: {DEFAULT_WATCHDOG_TIMEOUT:g})",
    )
    actions += add_engine_options(parser, several_models=True)
    return actions


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ``ServerConfig`` that ``trioserve serve``'s options describe."""
    specs = [_model_spec(text) for text in args.model or []] or [ModelSpec.from_path(None)]
    engine = engine_config_from_args(
        args,
        model=None,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        **overload_config_from_args(args),
        watchdog_timeout=args.watchdog_timeout or None,  # 0: off
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
