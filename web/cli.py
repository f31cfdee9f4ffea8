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

    from .settings import DEFAULT_MAX_BODY_SIZE, DEFAULT_SHUTDOWN_TIMEOUT

    if parser is None:
        parser = argparse.ArgumentParser(prog="trioserve serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize")
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
        "--max-queued-requests", type=int, default=256, help="admission queue bound; beyond it requests get 429 (default: 256)"
    )
    parser.add_argument("--max-queued-tokens", type=int, default=None, help="bound on queued prompt tokens (default: none)")
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
        watchdog_timeout=args.watchdog_timeout or None,  # 0: off
    )
    return ServerConfig(
        engine=engine,
        models=tuple(specs),
        api_key=args.api_key,
        max_request_time=args.max_request_time,
        shutdown_timeout=args.shutdown_timeout,
        max_body_size=args.max_body_size,
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

    from trioserve.web.bench.cli import add_bench_serve_parser
    from trioserve.web.bench.offline import add_bench_offline_parser

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
