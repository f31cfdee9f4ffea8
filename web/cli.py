"""The ``trioserve`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from trioserve.engine.errors import TrioserveError


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that starts an engine."""
    parser.add_argument("--model", default=None, help="checkpoint folder, .gguf file, or NAME=PATH (default: SmolLM2-135M-Instruct)")
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
    try:
        return args.func(args)
    except TrioserveError as exc:
        print(f"trioserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
