"""Data parallelism against threads, side by side in one run: the same cores
as N replicas of one thread each, or one engine of N threads.

For each layout (``--layouts``, default ``1x2,2x1``: replicas x threads) and
each concurrency (default 1 and 32) it starts the actor engine on the
default model, sends ``--input-len``-token random prompts for
``--output-len`` greedy tokens (EOS ignored), ``concurrency`` at a time,
and reports output tokens per second, the time to first token and the time
per output token. Layouts alternate within each round, so a machine shared
with other work slows both alike; run several rounds to see the spread.

    .venv/bin/python scripts/bench_dp.py --rounds 2
"""

from __future__ import annotations

import argparse

import trio

from trioserve.bench.offline import make_prompts
from trioserve.bench.replicated import ActorRunResult, run_actor_engine
from trioserve.engine.config import EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="1x2,2x1", help="replicas x threads, comma-separated")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--sequential-requests", type=int, default=4, help="requests at concurrency 1")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes per replica")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    results: list[tuple[int, ActorRunResult]] = []
    for round_index in range(args.rounds):
        for concurrency in levels:
            count = args.sequential_requests if concurrency == 1 else concurrency
            prompts = make_prompts(count, args.input_len, 49152, args.seed + round_index)
            for replicas, threads in layouts:
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
    print(f"\n| round | layout | concurrency | requests | out tok/s | TTFT p50 ms | TPOT p50 ms | vs {layouts[0][0]}x{layouts[0][1]} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for round_index, result in results:
        base = next(
            r for i, r in results if i == round_index and r.concurrency == result.concurrency
        )  # the first layout of that round and concurrency
        print(
            f"| {round_index} | {result.layout} | {result.concurrency} | {result.requests} | {result.tokens_per_s:.1f} | "
            f"{result.ttft_ms:.0f} | {result.tpot_ms:.1f} | {result.tokens_per_s / base.tokens_per_s:.2f}x |"
        )


if __name__ == "__main__":
    main()
