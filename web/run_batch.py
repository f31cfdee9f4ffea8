"""``trioserve run-batch -i in.jsonl -o out.jsonl``: a batch file run offline.

As vLLM's ``run_batch``: the model is loaded in this process, every line of
the input file runs through the same handlers and line runner as a batch of
the server's Batch API (web/batch_runner.py), with no listener, and each
line's result is written to the output file, in the input's order. Lines
that cannot run or that the endpoint refused go to the same output file,
as vLLM writes them, with their ``error`` or their ``response``'s error
status: one file holds every line's outcome. A progress bar counts the
lines on stderr.

The command takes ``trioserve serve``'s options, so a model is set up the
same way for both; the listener's options (``--host``, ``--port``, ...)
have nothing to do here and are ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import attrs

from .engine_options import option_group
from .serve_options import build_serve_parser, server_config_from_args
from .settings import ServerConfig

# `trioserve --help` builds this command's parser: what runs a batch (the
# app, the engine, trio, tqdm) is imported when one runs.


def build_run_batch_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``trioserve run-batch``'s options: serve's, and the files."""
    group = option_group(parser, "batch")
    group.add_argument("-i", "--input-file", required=True, help="the batch's lines: a JSONL file of OpenAI's batch format, or - for stdin")
    group.add_argument("-o", "--output-file", required=True, help="where each line's result goes, errors included, in the input's order")
    group.add_argument("--no-progress", action="store_true", help="do not show a progress bar on stderr")
    build_serve_parser(parser)
    return parser


def cmd_run_batch(args: argparse.Namespace) -> int:
    try:
        config = server_config_from_args(args)
    except ValueError as exc:
        print(f"trioserve run-batch: error: {exc}", file=sys.stderr)
        return 2
    import trio

    data = sys.stdin.buffer.read() if args.input_file == "-" else Path(args.input_file).read_bytes()
    return trio.run(run_batch, config, data, Path(args.output_file), not args.no_progress)


async def run_batch(config: ServerConfig, data: bytes, output: Path, progress: bool = True) -> int:
    """Run the batch ``data`` on the models of ``config``, writing every
    line's result to ``output``; 0 once all ran, 1 if the model failed to load."""
    import trio
    from tqdm import tqdm

    from .app import app_host, create_app
    from .batch_lines import LineError, RequestLine, read_lines
    from .batch_runner import LineRunner
    from .batch_service import served_endpoints

    app = create_app(config)
    host = app_host(app)
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)  # opens the engines (open_engine), as the server does
        try:
            await host.wait_ready()
        except Exception:
            return 1
        lines = list(read_lines(data, served_endpoints(app)))
        runner = LineRunner(
            app, priority=config.engine.degradation.low_priority, max_in_flight=config.batch_max_in_flight, api_key=config.api_key
        )
        with open(output, "w", encoding="utf-8") as out, tqdm(total=len(lines), disable=not progress, unit="line") as bar:
            writer = InOrder(out, [line.number for line in lines])
            for line in lines:
                if isinstance(line, LineError):
                    writer.put(line.number, line.output_line())
                    bar.update()

            def record(line: RequestLine, result: dict[str, Any]) -> None:
                writer.put(line.number, result)
                bar.update()

            await runner.run((line for line in lines if isinstance(line, RequestLine)), record)
        host.begin_drain()
    return 0


@attrs.define(eq=False)
class InOrder:
    """Writes results to ``out`` in the order of ``numbers`` as they come,
    holding those whose predecessors have not finished."""

    _out: Any
    _order: list[int]
    _next: int = attrs.field(default=0, init=False)
    _held: dict[int, dict[str, Any]] = attrs.field(factory=dict, init=False)

    def put(self, number: int, result: dict[str, Any]) -> None:
        self._held[number] = result
        while self._next < len(self._order) and self._order[self._next] in self._held:
            line = self._held.pop(self._order[self._next])
            self._out.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n")
            self._out.flush()
            self._next += 1
