"""The ``trioserve`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from trioserve.engine.config import EngineConfig
from trioserve.engine.errors import TrioserveError

from .engine_options import add_engine_options, add_tensor_parallel_options, engine_config_from_args
from .request_ids import RequestIdFilter
from .serve_options import build_serve_parser, server_config_from_args

LOG_FORMAT = "%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s"


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

    try:
        config = engine_config_from_args(args)
    except ValueError as exc:  # a bad --generation-config, say
        print(f"trioserve generate: error: {exc}", file=sys.stderr)
        return 2
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    if config.data_parallel_size > 1 or config.worker_mode == "process":
        import trio

        return trio.run(_generate_with_actors, config, prompt, args.max_tokens)
    for delta in generate_greedy(config, prompt, max_tokens=args.max_tokens):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


async def _generate_with_actors(config: EngineConfig, prompt: Any, max_tokens: int) -> int:
    """``generate`` through the actor engine, which owns what the synchronous
    core has not: several replicas (every one started; the prompt runs on
    one) or the model step in a worker process."""
    from trioserve.actors import open_engine
    from trioserve.engine.sampling_params import SamplingParams

    async with open_engine(config) as engine:
        async for output in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)):
            sys.stdout.write(output.text_delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from trioserve.engine.tp_runner import run_worker

    try:
        return _run_worker(run_worker, args)
    except ValueError as exc:
        print(f"trioserve worker: error: {exc}", file=sys.stderr)
        return 2


def _run_worker(run_worker, args: argparse.Namespace) -> int:
    return run_worker(
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        timeout=args.distributed_timeout,
        num_threads=args.num_threads,
        device=args.device,
    )


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

    worker = commands.add_parser(
        "worker",
        help="run this machine's ranks of a tensor-parallel group led by a server on node 0",
        description="Join the tensor-parallel group of `trioserve serve --nnodes N` on node 0 and run this "
        "machine's ranks until the server stops (docs/deployment.md). The model and its settings come "
        "from node 0; the checkpoint must be at the same path here.",
    )
    add_tensor_parallel_options(worker)
    # torchrun calls a machine's index GROUP_RANK; launchers such as SLURM
    # scripts and Kubernetes indexed jobs commonly export NODE_RANK.
    node_rank = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", ""))
    worker.add_argument(
        "--node-rank",
        type=int,
        required=not node_rank.isdigit(),
        default=int(node_rank) if node_rank.isdigit() else None,
        help="this machine's index, 1 .. nnodes-1 (default: $NODE_RANK, else torchrun's $GROUP_RANK)",
    )
    worker.add_argument("--num-threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    worker.add_argument("--device", default=None, help="cpu or cuda, as on node 0 (default: cuda when present)")
    worker.set_defaults(func=cmd_worker)

    from trioserve.bench.cli import add_bench_serve_parser
    from trioserve.bench.offline import add_bench_offline_parser

    bench = commands.add_parser("bench", help="benchmarks: a running server, or the engine offline")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_serve_parser(bench_commands)
    add_bench_offline_parser(bench_commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())  # %(request_id)s: the X-Request-Id being served, or -
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
