"""``trioserve bench actors``: offline throughput, ``EngineCore`` driven
directly against the same workload through the actors.

Each mode runs the same requests (greedy, ignore_eos, so both produce the
same tokens); modes alternate so drift in the machine's load hits both.
Besides tokens/s it reports the time per step spent outside
``ModelRunner.execute`` (scheduling, detokenizing; for the actors also the
channels, the callers' tasks and the hand-off to the worker thread), which
is what the actors add; it is steadier than tokens/s on a loaded machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import trio

from trioserve.actors import ModelExecutor, open_engine
from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.loading.loader import load_model
from trioserve.engine.runtime.step_thread import StepThread
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.testing import tiny_loaded

from ..arguments import positive_int

WORDS = "the quick brown fox jumps over lazy dogs while seven wizards quietly hex bright amber jugs".split()


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "actors",
        help="the engine core driven directly against the same requests through the actors",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench actors``: "),
    )
    work = p.add_argument_group("workload")
    work.add_argument("--requests", type=positive_int, default=64, help="requests of each run (default: 64)")
    work.add_argument("--max-tokens", type=positive_int, default=64, help="tokens of each request (default: 64)")
    work.add_argument("--repeats", type=positive_int, default=5, help="runs of each mode (default: 5)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", type=positive_int, default=32, help="sequences at once (default: 32)")
    engine.add_argument("--threads", type=positive_int, default=2, help="torch threads (default: 2)")
    engine.add_argument("--tiny", action="store_true", help="trioserve.testing's tiny random model (steps of a few ms)")
    p.set_defaults(func=run)
    return p


def workload(n: int, max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [(f"r{i}", " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + i % 40)), params) for i in range(n)]


class Timed:
    """A model runner that adds up the time of its steps."""

    def __init__(self, runner) -> None:
        self.runner, self.seconds, self.steps = runner, 0.0, 0

    def execute(self, plan):
        start = time.perf_counter()
        try:
            return self.runner.execute(plan)
        finally:
            self.seconds += time.perf_counter() - start
            self.steps += 1


def run_direct(loaded, config, items):
    core = EngineCore(loaded, config)
    core.runner = timed = Timed(core.runner)
    start = time.perf_counter()
    for rid, prompt, params in items:
        core.add_request(rid, prompt, params)
    tokens = 0
    while core.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in core.step())
    return tokens, time.perf_counter() - start, timed.seconds, timed.steps


async def run_actors(loaded, config, items, step_thread):
    tokens = 0
    timed = []

    def executor(core):
        timed.append(Timed(core.runner))
        return ModelExecutor(timed[0], step_thread)

    async with open_engine(config, loaded=loaded, executor=executor) as engine:

        async def one(rid, prompt, params):
            nonlocal tokens
            async for out in engine.generate(prompt, params, request_id=rid):
                tokens += len(out.new_token_ids)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for item in items:
                nursery.start_soon(one, *item)
        elapsed = time.perf_counter() - start
    return tokens, elapsed, timed[0].seconds, timed[0].steps


def run(args: argparse.Namespace) -> int:
    # Both modes run the model on this one thread, where it was loaded: one
    # OpenMP pool (see trioserve.engine.runtime.step_thread).
    with StepThread(args.threads) as step_thread:
        if args.tiny:
            loaded = step_thread.call(tiny_loaded)
        else:
            loaded = step_thread.call(lambda: load_model(None, dtype="float32", device="cpu"))
        config = EngineConfig(max_num_seqs=args.max_num_seqs, max_queued_requests=args.requests, kv_cache_memory=512 << 20)
        items = workload(args.requests, args.max_tokens)
        step_thread.call(run_direct, loaded, config, items[:4])  # warm up
        rates: dict[str, list[float]] = {"direct": [], "actors": []}
        outside: dict[str, list[float]] = {"direct": [], "actors": []}
        for _ in range(args.repeats):
            for mode in ("direct", "actors"):
                if mode == "direct":
                    tokens, seconds, busy, steps = step_thread.call(run_direct, loaded, config, items)
                else:
                    tokens, seconds, busy, steps = trio.run(run_actors, loaded, config, items, step_thread)
                rates[mode].append(tokens / seconds)
                outside[mode].append((seconds - busy) / steps * 1000)
                print(f"{mode:6s} {tokens} tokens in {seconds:6.2f} s = {tokens / seconds:6.1f} tok/s; "
                      f"{steps} steps, {busy / steps * 1000:6.1f} ms model + {outside[mode][-1]:5.2f} ms other per step",
                      flush=True)  # fmt: skip
    d, a = statistics.median(rates["direct"]), statistics.median(rates["actors"])
    print(f"median tok/s: direct {d:.1f}, actors {a:.1f}, actors/direct {a / d:.3f}")
    print(f"median ms per step outside the model: direct {statistics.median(outside['direct']):.2f}, "
          f"actors {statistics.median(outside['actors']):.2f}")  # fmt: skip
    return 0
