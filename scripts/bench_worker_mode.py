"""The model step on the engine's thread vs in a worker process, side by side.

Runs the same workload through the actors (``open_engine``) with
``worker_mode="thread"`` and ``"process"``, alternating, at concurrency 1
and 32: prompts of ``--input-len`` token ids, ``--output-len`` tokens each,
greedy with ``ignore_eos``. Reports output tokens/s and the mean time per
output token (TPOT) per mode, and checks both modes produced the same
tokens. ``--tiny`` uses the test suite's tiny random model.
"""

from __future__ import annotations

import argparse
import statistics
import time

import trio

from trioserve import testing
from trioserve.actors import open_engine
from trioserve.engine.config import EngineConfig
from trioserve.engine.sampling.sampling_params import SamplingParams


def workload(count: int, input_len: int, output_len: int, vocab: int) -> list[tuple[str, list[int]]]:
    # Distinct token-id prompts, so the prefix cache does not share them.
    return [(f"r{i}", [(i * 7919 + j * 104729) % (vocab - 200) + 100 for j in range(input_len)]) for i in range(count)]


async def run_mode(config: EngineConfig, items, output_len: int, tiny: bool) -> tuple[float, float, dict]:
    kwargs = {}
    if tiny:
        kwargs = dict(loaded=testing.tiny_loaded())
        if config.worker_mode == "process":
            kwargs["worker_model"] = testing.tiny_model.tiny_worker_model
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    tpots: list[float] = []
    async with open_engine(config, **kwargs) as engine:
        # One request first: the worker's (or thread's) kernels warm up outside the timing.
        async for _ in engine.generate(items[0][1], SamplingParams(temperature=0.0, max_tokens=4)):
            pass

        async def one(request_id: str, prompt: list[int]) -> None:
            got = tokens.setdefault(request_id, [])
            first = last = None
            async for output in engine.generate(prompt, params, request_id=request_id):
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                got.extend(output.new_token_ids)
            if len(got) > 1:
                tpots.append((last - first) / (len(got) - 1))

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for request_id, prompt in items:
                nursery.start_soon(one, request_id, prompt)
        elapsed = time.perf_counter() - start
    total = sum(len(t) for t in tokens.values())
    return total / elapsed, statistics.mean(tpots), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    base = dict(max_num_seqs=32, max_model_len=512, kv_cache_memory=256 << 20, num_threads=args.num_threads)
    if args.tiny:
        base.update(block_size=testing.BLOCK_SIZE, warm_up=False)
    vocab = testing.VOCAB_SIZE
    print(f"{'concurrency':>11} {'mode':>8} {'run':>3} {'tok/s':>8} {'TPOT ms':>8}")
    for concurrency in args.concurrency:
        items = workload(concurrency, args.input_len, args.output_len, vocab)
        results: dict[str, list[tuple[float, float]]] = {"thread": [], "process": []}
        outputs = {}
        for run in range(args.repeats):
            for mode in ("thread", "process"):
                config = EngineConfig(worker_mode=mode, **base)
                rate, tpot, tokens = trio.run(run_mode, config, items, args.output_len, args.tiny)
                outputs.setdefault(mode, tokens)
                results[mode].append((rate, tpot))
                print(f"{concurrency:>11} {mode:>8} {run:>3} {rate:>8.1f} {tpot * 1000:>8.2f}", flush=True)
        same = outputs["thread"] == outputs["process"]
        thread = statistics.median(r for r, _ in results["thread"])
        process = statistics.median(r for r, _ in results["process"])
        print(f"concurrency {concurrency}: process/thread tok/s (medians) {process / thread:.2f}; same tokens: {same}")


if __name__ == "__main__":
    main()
