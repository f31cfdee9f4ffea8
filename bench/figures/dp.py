"""``trioserve bench dp``: data parallelism against threads, side by side in
one run: the same cores as N replicas of one thread each, or one engine of
N threads.

For each layout (``--layouts``, default ``1x2,2x1``: replicas x threads) and
each concurrency (default 1 and 32) it starts the actor engine on the
default model, sends ``--input-len``-token random prompts for
``--output-len`` greedy tokens (EOS ignored), ``concurrency`` at a time,
and reports output tokens per second, the time to first token and the time
per output token. Layouts alternate within each round, so a machine shared
with other work slows both alike; run several rounds to see the spread.
"""

from __future__ import annotations

import argparse

import trio

from trioserve.engine.config import EngineConfig

from ..arguments import int_list, positive_int
from ..offline import make_prompts
from ..replicated import ActorRunResult, run_actor_engine


def _layouts(text: str) -> list[tuple[int, int]]:
    try:
        layouts = [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        layouts = []
    if not layouts or any(len(layout) != 2 or min(layout) < 1 for layout in layouts):
        raise argparse.ArgumentTypeError(f"expected replicas x threads like 1x2,2x1, got {text!r}")
    return layouts  # type: ignore[return-value]


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "dp",
        help="data-parallel replicas against one engine of as many threads, through the actors",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench dp``: "),
    )
    work = p.add_argument_group("workload")
    work.add_argument("--layouts", type=_layouts, default=[(1, 2), (2, 1)],
                      help="replicas x threads, comma-separated (default: 1x2,2x1)")  # fmt: skip
    work.add_argument("--concurrency", type=int_list, default=[1, 32], help="comma-separated (default: 1,32)")
    work.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens (default: 128)")
    work.add_argument("--output-len", type=positive_int, default=128, help="tokens out (default: 128)")
    work.add_argument("--sequential-requests", type=positive_int, default=4, help="requests at concurrency 1 (default: 4)")
    work.add_argument("--rounds", type=positive_int, default=1, help="rounds of every layout (default: 1)")
    work.add_argument("--seed", type=int, default=0, help="seeds the prompts (default: 0)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--kv-cache-memory", type=positive_int, default=512 << 20, help="bytes per replica (default: 512 MiB)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    results: list[tuple[int, ActorRunResult]] = []
    for round_index in range(args.rounds):
        for concurrency in args.concurrency:
            count = args.sequential_requests if concurrency == 1 else concurrency
            prompts = make_prompts(count, args.input_len, 49152, args.seed + round_index)
            for replicas, threads in args.layouts:
                config = EngineConfig(
                    data_parallel_size=replicas,
                    num_threads=threads,
                    device="cpu",
                    max_model_len=args.input_len + args.output_len + 16,
                    max_num_seqs=max(concurrency, 1),
                    kv_cache_memory=args.kv_cache_memory,
                )
                result = trio.run(run_actor_engine, config, prompts, args.output_len, concurrency)
                results.append((round_index, result))
                print(
                    f"round {round_index}: {result.layout:22} c={concurrency:<3} {result.tokens_per_s:7.1f} out tok/s "
                    f"TTFT {result.ttft_ms:7.0f} ms  TPOT {result.tpot_ms:6.1f} ms  ({result.seconds:.1f} s)",
                    flush=True,
                )
    first = "x".join(map(str, args.layouts[0]))
    print(f"\n| round | layout | concurrency | requests | out tok/s | TTFT p50 ms | TPOT p50 ms | vs {first} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for round_index, result in results:
        # The first layout of that round and concurrency.
        base = next(r for i, r in results if i == round_index and r.concurrency == result.concurrency)
        print(
            f"| {round_index} | {result.layout} | {result.concurrency} | {result.requests} | {result.tokens_per_s:.1f} | "
            f"{result.ttft_ms:.0f} | {result.tpot_ms:.1f} | {result.tokens_per_s / base.tokens_per_s:.2f}x |"
        )
    return 0
