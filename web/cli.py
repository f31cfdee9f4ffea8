"""The ``trioserve`` command line."""

from __future__ import annotations

import argparse
import logging
import math
import sys

from trioserve.engine.errors import TrioserveError


def add_engine_options(parser: argparse.ArgumentParser, *, several_models: bool = False) -> None:
    """Options shared by every command that starts an engine; with
    ``several_models``, ``--model`` may repeat (``args.model`` is a list)."""
    if several_models:
        parser.add_argument(
            "--model",
            action="append",
            default=None,
            help="checkpoint folder, .gguf file, or NAME=PATH; repeat to serve several models, "
            "requests pick one by their model field (default: SmolLM2-135M-Instruct)",
        )
    else:
        parser.add_argument("--model", default=None, help="checkpoint folder, .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when present)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default=None, help="bytes (e.g. 2G) or a fraction of free memory (e.g. 0.5)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads for the model step")


def parse_memory(text: str | None) -> int | float | None:
    """``'2G'`` -> bytes, ``'0.5'`` -> a fraction, ``None`` -> None."""
    if text is None:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    value = float(text)
    return value if value <= 1.0 else int(value)


def engine_config_from_args(args: argparse.Namespace, **overrides):
    from trioserve.engine.config import EngineConfig

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


def add_overload_options(parser: argparse.ArgumentParser) -> None:
    """Overload control (docs/reliability.md, "Overload control")."""
    from trioserve.engine.config import DegradationPolicy, EngineConfig

    engine, policy = EngineConfig(), DegradationPolicy()
    group = parser.add_argument_group("overload control")
    group.add_argument(
        "--max-queue-time",
        type=_seconds,
        default=None,
        help="drop a request that waited this long (seconds) before any compute, with 503 (default: no bound)",
    )
    group.add_argument(
        "--adaptive-concurrency",
        action="store_true",
        help="lower the running-sequence limit while TPOT p90 is above --target-tpot-ms, raise it while below",
    )
    group.add_argument(
        "--target-tpot-ms",
        type=_seconds,  # any finite number > 0
        default=engine.target_tpot_ms,
        help=f"the TPOT p90 adaptive concurrency steers to, in ms (default: {engine.target_tpot_ms:g})",
    )
    group.add_argument(
        "--no-priority-shedding",
        action="store_true",
        help="a full queue refuses a new request instead of dropping a queued one of lower priority",
    )
    group.add_argument(
        "--low-priority",
        type=int,
        default=policy.low_priority,
        help=f"priority values from this one up count as low priority (default: {policy.low_priority})",
    )
    group.add_argument(
        "--cap-low-priority-at",
        type=_fraction_or_off,
        default=policy.cap_at,
        metavar="FRACTION|off",
        help=f"queue fill from which new low-priority requests get max_tokens capped (default: {policy.cap_at:g})",
    )
    group.add_argument(
        "--low-priority-max-tokens",
        type=int,
        default=policy.low_priority_max_tokens,
        help=f"that cap (default: {policy.low_priority_max_tokens})",
    )
    group.add_argument(
        "--refuse-expensive-at",
        type=_fraction_or_off,
        default=policy.refuse_expensive_at,
        metavar="FRACTION|off",
        help=f"queue fill from which n > 1 and many top logprobs get 429 (default: {policy.refuse_expensive_at:g})",
    )
    group.add_argument(
        "--expensive-logprobs",
        type=int,
        default=policy.expensive_logprobs,
        help=f"more top logprobs than this count as expensive (default: {policy.expensive_logprobs})",
    )


def overload_config_from_args(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields that ``add_overload_options`` set."""
    from trioserve.engine.config import DegradationPolicy

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


def _model_spec(text: str):
    from .settings import ModelSpec

    try:
        return ModelSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of ``trioserve serve``, added to ``parser`` (default: a
    new one). ``ServerConfig.from_env`` reads the same options."""
    from trioserve.engine.config import DEFAULT_WATCHDOG_TIMEOUT

    from .settings import (
        DEFAULT_BODY_TIMEOUT,
        DEFAULT_KEEP_ALIVE_TIMEOUT,
        DEFAULT_MAX_BODY_SIZE,
        DEFAULT_SEND_TIMEOUT,
        DEFAULT_SHUTDOWN_TIMEOUT,
    )

    if parser is None:
        parser = argparse.ArgumentParser(prog="trioserve serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version",
    )
    parser.add_argument(
        "--max-request-time", type=_seconds, default=None, help="cap on every request's deadline, in seconds (default: none)"
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help=f"seconds in-flight requests may run on after SIGTERM/SIGINT (default: {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    parser.add_argument(
        "--max-body-size", type=_bytes, default=DEFAULT_MAX_BODY_SIZE, help="largest request body, e.g. 1M (default: 1M)"
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=_seconds,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT,
        help="seconds before closing a connection with no request under way: idle between requests, "
        f"or its request headers incomplete (default: {DEFAULT_KEEP_ALIVE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=_seconds,
        default=DEFAULT_BODY_TIMEOUT,
        help=f"seconds a request body may take to arrive; then 408 and the connection closes (default: {DEFAULT_BODY_TIMEOUT:g})",
    )
    parser.add_argument(
        "--send-timeout",
        type=_seconds,
        default=DEFAULT_SEND_TIMEOUT,
        help="seconds a response may wait on a client that reads none of it before the connection is dropped "
        f"(default: {DEFAULT_SEND_TIMEOUT:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=_count,
        default=None,
        help="open connections beyond which new ones get 503 (default: 2048, less under a low file descriptor limit)",
    )
    parser.add_argument(
        "--log-requests", action="store_true", help="log each request's body (prompts included); off by default"
    )
    parser.add_argument(
        "--max-queued-requests", type=int, default=256, help="admission queue bound; beyond it requests get 429 (default: 256)"
    )
    parser.add_argument("--max-queued-tokens", type=int, default=None, help="bound on queued prompt tokens (default: none)")
    add_overload_options(parser)
    parser.add_argument(
        "--watchdog-timeout",
        type=_watchdog_seconds,
        default=DEFAULT_WATCHDOG_TIMEOUT,
        help="seconds a model step may run before it is declared hung: its requests fail, the engine goes on "
        f"on a fresh step thread and /health reports it; 0 turns the watchdog off (default: {DEFAULT_WATCHDOG_TIMEOUT:g})",
    )
    add_engine_options(parser, several_models=True)
    return parser


def server_config_from_args(args: argparse.Namespace):
    """The ``ServerConfig`` that ``trioserve serve``'s options describe."""
    from .settings import ModelSpec, ServerConfig

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


def cmd_serve(args: argparse.Namespace) -> int:
    from .app import create_app
    from .serve import run

    try:
        config = server_config_from_args(args)
    except ValueError as exc:
        print(f"trioserve serve: error: {exc}", file=sys.stderr)
        return 2
    return run(create_app(config), host=args.host, port=args.port)


def cmd_generate(args: argparse.Namespace) -> int:
    from trioserve.engine.generate import generate_greedy

    config = engine_config_from_args(args)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    for delta in generate_greedy(config, prompt, max_tokens=args.max_tokens):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trioserve", description="trioserve: an LLM serving engine on trio")
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="print a greedy continuation of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)

    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible API",
        description="Serve models over the OpenAI-compatible HTTP API (docs/api.md) until SIGTERM or SIGINT.",
    )
    build_serve_parser(serve)
    serve.set_defaults(func=cmd_serve)

    from trioserve.bench.cli import add_bench_serve_parser
    from trioserve.bench.offline import add_bench_offline_parser

    bench = commands.add_parser("bench", help="benchmarks: a running server, or the engine offline")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_serve_parser(bench_commands)
    add_bench_offline_parser(bench_commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: a benchmark would print thousands.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return args.func(args)
    except TrioserveError as exc:
        print(f"trioserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
