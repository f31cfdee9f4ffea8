"""The ``trioserve`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib import metadata
from typing import Any

from trioserve.engine.config import EngineConfig
from trioserve.engine.errors import TrioserveError

from .engine_options import (
    add_engine_options,
    add_option_groups,
    add_tensor_parallel_options,
    engine_config_from_args,
    option_group,
)
from .request_ids import RequestIdFilter
from .run_batch import build_run_batch_parser
from .serve_options import build_serve_parser, server_config_from_args

# Entry points that add a command to ``trioserve`` (``trioserve bench``).
COMMANDS_GROUP = "trioserve.commands"
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


def cmd_run_batch(args: argparse.Namespace) -> int:
    from .run_batch import cmd_run_batch as run

    return run(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from trioserve.engine.errors import InvalidRequestError
    from trioserve.engine.core.generate import generate
    from trioserve.engine.sampling.sampling_params import SamplingParams

    try:
        config = engine_config_from_args(args)
        # Greedy unless asked to sample; sampling leaves what the flags do not
        # set to the model's defaults (--generation-config).
        temperature = args.temperature if args.temperature is not None else (None if args.sample else 0.0)
        params = SamplingParams(temperature=temperature, seed=args.seed, max_tokens=args.max_tokens)
    except (ValueError, InvalidRequestError) as exc:
        print(f"trioserve generate: error: {exc}", file=sys.stderr)
        return 2
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    if config.data_parallel_size > 1 or config.worker_mode == "process":
        import trio

        return trio.run(_generate_with_actors, config, prompt, params)
    for delta in generate(config, prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


async def _generate_with_actors(config: EngineConfig, prompt: Any, params: Any) -> int:
    """``generate`` through the actor engine, which owns what the synchronous
    core has not: several replicas (every one started; the prompt runs on
    one) or the model step in a worker process."""
    from trioserve.actors import open_engine

    async with open_engine(config) as engine:
        async for output in engine.generate(prompt, params):
            sys.stdout.write(output.text_delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from trioserve.engine.parallel.tp_runner import run_worker

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


def package_version() -> str:
    """The installed package's version; in a checkout that is not
    installed, pyproject.toml's."""
    from importlib import metadata

    try:
        return metadata.version("trioserve")
    except metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def build_parser(*, installed: bool = True) -> argparse.ArgumentParser:
    """The command line's parser, with the installed commands (``bench``)
    unless ``installed`` is False."""
    parser = argparse.ArgumentParser(prog="trioserve", description="trioserve: an LLM serving engine on trio")
    option_group(parser, "general").add_argument(
        "--version", action="version", version=f"trioserve {package_version()}", help="print the version and exit"
    )
    option_group(parser, "observability").add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="the least severe log records printed, on stderr (default: INFO)",
    )
    commands = parser.add_subparsers(
        title="commands", dest="command", required=True, metavar="COMMAND", help="what to run; COMMAND -h tells more"
    )

    gen = commands.add_parser(
        "generate",
        help="print a continuation of a prompt, greedy unless asked to sample",
        description="Load the model, continue the prompt and print the text as it comes: greedy by default, "
        "or sampled (--sample, --temperature) with the model's sampling defaults for what is not set.",
    )
    add_option_groups(gen, "generation", "model", "engine", "scale-out")
    group = option_group(gen, "generation")
    group.add_argument("prompt", help="the text to continue (with --chat, the user's message)")
    group.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    group.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    group.add_argument(
        "--sample",
        action="store_true",
        help="sample with the model's sampling defaults (--generation-config) instead of greedy decoding",
    )
    group.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sample at this temperature (0: greedy); top_p, top_k and min_p follow the model's defaults "
        "(default: greedy, or with --sample the model's)",
    )
    group.add_argument("--seed", type=int, default=None, help="seed the sampling, for the same text again (default: none)")
    add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)

    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible API",
        description="Serve models over the OpenAI-compatible HTTP API (docs/api.md) until SIGTERM or SIGINT.",
    )
    build_serve_parser(serve)
    serve.set_defaults(func=cmd_serve)

    run_batch = commands.add_parser(
        "run-batch",
        help="run a file of OpenAI batch lines offline, as vLLM's run_batch",
        description="Load the model and run every line of an OpenAI batch file (docs/api.md, 'Batch API') "
        "through the server's handlers without a listener, writing each line's result, errors included, to "
        "the output file. Takes serve's options for the model and engine.",
    )
    build_run_batch_parser(run_batch)
    run_batch.set_defaults(func=cmd_run_batch)

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
    option_group(worker, "scale-out").add_argument(
        "--node-rank",
        type=int,
        required=not node_rank.isdigit(),
        default=int(node_rank) if node_rank.isdigit() else None,
        help="this machine's index, 1 .. nnodes-1 (default: $NODE_RANK, else torchrun's $GROUP_RANK)",
    )
    engine = option_group(worker, "engine")
    engine.add_argument("--num-threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    engine.add_argument("--device", default=None, help="cpu or cuda, as on node 0 (default: cuda when present)")
    worker.set_defaults(func=cmd_worker)

    if installed:
        add_installed_commands(commands)
    return parser


def add_installed_commands(commands) -> None:
    """Add the commands other packages offer in the ``COMMANDS_GROUP`` entry
    points: each is ``add(commands)``, adding its parser to ``commands``.
    trioserve's own ``bench`` is one (pyproject.toml): web/ imports nothing
    of bench/, which uses web/'s engine options."""
    for entry_point in sorted(metadata.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        entry_point.load()(commands)


def command_named(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is neither an option
    nor ``--log-level``'s value."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser ``argv`` needs: without the installed commands where it
    names one of the built-in ones (loading them imports what they are
    made of: bench's figures, 0.2 s of a 2 s start), else with them."""
    built_in = build_parser(installed=False)
    commands = next(a for a in built_in._actions if isinstance(a, argparse._SubParsersAction))
    return built_in if command_named(argv) in commands.choices else build_parser()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser_for(argv).parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
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
