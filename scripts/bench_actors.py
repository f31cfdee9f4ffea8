"""Offline throughput: EngineCore driven directly vs the same workload through the actors.

Each mode runs the same requests (greedy, ignore_eos, so both produce the
same tokens); modes alternate so drift in the machine's load hits both.
Besides tokens/s it reports the time per step spent outside
ModelRunner.execute (scheduling, detokenizing; for the actors also the
channels, the callers' tasks and the hand-off to the worker thread), which
is what the actors add; it is steadier than tokens/s on a loaded machine.
"""
import argparse, statistics, time
import trio
from trioserve.actors import ModelExecutor, open_engine
from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.loading.loader import load_model
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.runtime.step_thread import StepThread
from trioserve.testing import tiny_loaded

WORDS = "the quick brown fox jumps over lazy dogs while seven wizards quietly hex bright amber jugs".split()


def workload(n, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [(f"r{i}", " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + i % 40)), params) for i in range(n)]


class Timed:
    def __init__(self, runner):
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
    for rid, prompt, p in items:
        core.add_request(rid, prompt, p)
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
        async def one(rid, prompt, p):
            nonlocal tokens
            async for out in engine.generate(prompt, p, request_id=rid):
                tokens += len(out.new_token_ids)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for item in items:
                nursery.start_soon(one, *item)
        elapsed = time.perf_counter() - start
    return tokens, elapsed, timed[0].seconds, timed[0].steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="trioserve.testing's tiny random model (steps of a few ms)")
    args = ap.parse_args()
    # Both modes run the model on this one thread, where it was loaded: one
    # OpenMP pool (see trioserve.engine.runtime.step_thread).
    step_thread = StepThread(args.threads)
    if args.tiny:
        loaded = step_thread.call(tiny_loaded)
    else:
        loaded = step_thread.call(lambda: load_model(None, dtype="float32", device="cpu"))
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_queued_requests=args.requests, kv_cache_memory=512 << 20)
    items = workload(args.requests, args.max_tokens)
    step_thread.call(run_direct, loaded, config, items[:4])  # warm up
    rates = {"direct": [], "actors": []}
    outside = {"direct": [], "actors": []}
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
                  flush=True)
    d, a = statistics.median(rates["direct"]), statistics.median(rates["actors"])
    print(f"median tok/s: direct {d:.1f}, actors {a:.1f}, actors/direct {a / d:.3f}")
    print(f"median ms per step outside the model: direct {statistics.median(outside['direct']):.2f}, "
          f"actors {statistics.median(outside['actors']):.2f}")


if __name__ == "__main__":
    main()
