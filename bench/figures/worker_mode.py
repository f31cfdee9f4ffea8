"""``trioserve bench worker-mode``: the model step on the engine's thread
against in a worker process, side by side.

Runs the same workload through the actors (``open_engine``) with
``worker_mode="thread"`` and ``"process"``, alternating, at each
concurrency: prompts of ``--input-len`` token ids, ``--output-len`` tokens
each, greedy with ``ignore_eos``. Reports output tokens/s and the mean time
per output token (TPOT) per mode, and checks both modes produced the same
tokens. ``--tiny`` uses the test suite's tiny random model.
"""

from __future__ import annotations

import argparse
import statistics
import time

import trio

from trioserve.actors import open_engine
from trioserve.engine.config import EngineConfig
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.testing import BLOCK_SIZE, VOCAB_SIZE, tiny_loaded
from trioserve.testing.tiny_model import tiny_worker_model

from ..arguments import int_list, positive_int


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "worker-mode",
        help="the model step in the engine's thread against in a worker process, through the actors",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench worker-mode``: "),
    )
    work = p.add_argument_group("workload")
    work.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens (default: 128)")
    work.add_argument("--output-len", type=positive_int, default=128, help="tokens out (default: 128)")
    work.add_argument("--concurrency", type=int_list, default=[1, 32], help="comma-separated, at most 32 (default: 1,32)")
    work.add_argument("--repeats", type=positive_int, default=2, help="runs of each mode (default: 2)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--tiny", action="store_true", help="trioserve.testing's tiny random model")
    engine.add_argument("--num-threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(func=run)
    return p


def workload(count: int, input_len: int, vocab: int) -> list[tuple[str, list[int]]]:
    # Distinct token-id prompts, so the prefix cache does not share them.
    return [(f"r{i}", [(i * 7919 + j * 104729) % (vocab - 200) + 100 for j in range(input_len)]) for i in range(count)]


async def run_mode(config: EngineConfig, items, output_len: int, tiny: bool) -> tuple[float, float, dict]:
    kwargs = {}
    if tiny:
        kwargs = dict(loaded=tiny_loaded())
        if config.worker_mode == "process":
            kwargs["worker_model"] = tiny_worker_model
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
    return total / elapsed, statistics.mean(tpots) if tpots else float("nan"), tokens


def run(args: argparse.Namespace) -> int:
    base = dict(max_num_seqs=32, max_model_len=512, kv_cache_memory=256 << 20, num_threads=args.num_threads)
    if args.tiny:
        base.update(block_size=BLOCK_SIZE, warm_up=False)
    vocab = VOCAB_SIZE
    print(f"{'concurrency':>11} {'mode':>8} {'run':>3} {'tok/s':>8} {'TPOT ms':>8}")
    for concurrency in args.concurrency:
        items = workload(concurrency, args.input_len, vocab)
        results: dict[str, list[tuple[float, float]]] = {"thread": [], "process": []}
        outputs = {}
        for repeat in range(args.repeats):
            for mode in ("thread", "process"):
                config = EngineConfig(worker_mode=mode, **base)
                rate, tpot, tokens = trio.run(run_mode, config, items, args.output_len, args.tiny)
                outputs.setdefault(mode, tokens)
                results[mode].append((rate, tpot))
                print(f"{concurrency:>11} {mode:>8} {repeat:>3} {rate:>8.1f} {tpot * 1000:>8.2f}", flush=True)
        same = outputs["thread"] == outputs["process"]
        thread = statistics.median(r for r, _ in results["thread"])
        process = statistics.median(r for r, _ in results["process"])
        print(f"concurrency {concurrency}: process/thread tok/s (medians) {process / thread:.2f}; same tokens: {same}")
    return 0
