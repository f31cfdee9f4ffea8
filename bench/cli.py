"""``trioserve bench``: the benchmark commands, added to ``trioserve``'s
command line through the ``trioserve.commands`` entry point (pyproject.toml),
so that web/, which builds that command line, imports nothing of bench/."""

from __future__ import annotations

import argparse

from .figures import COMMANDS
from .offline import add_bench_offline_parser
from .serve import add_bench_serve_parser


def add_bench_parser(commands) -> argparse.ArgumentParser:
    """Add the ``bench`` group, with every benchmark under it, to
    ``trioserve``'s subparsers ``commands``."""
    bench = commands.add_parser(
        "bench",
        help="benchmarks: a running server, the engine offline, and the figures of docs/benchmarks.md",
        description="Benchmarks. `serve` loads any OpenAI-compatible server; `offline` runs the engine against "
        "transformers; the others measure what docs/benchmarks.md reports, each with its smallest settings "
        "in a few seconds to minutes.",
    )
    bench_commands = bench.add_subparsers(
        title="benchmarks", dest="bench_command", required=True, metavar="BENCHMARK", help="which benchmark to run"
    )
    add_bench_serve_parser(bench_commands)
    add_bench_offline_parser(bench_commands)
    for command in COMMANDS:
        command.add_parser(bench_commands)
    return bench
