"""``trioserve bench invariance``: what batch invariance costs, the default
model batch-invariant against ``--no-batch-invariant`` (the same kernels,
prompts on wider arithmetic), in one process, taking turns.

Prints, per mode and round: one stream's time per output token (c=1),
``--concurrency`` streams' output tokens per second, and their prompts'
prefill time; then the medians and the ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.loading.loader import load_model
from trioserve.engine.sampling.sampling_params import SamplingParams

from ..arguments import positive_int, usage_error


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "invariance",
        help="the batch-invariant default against --no-batch-invariant, on the engine core",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench invariance``: "),
    )
    work = p.add_argument_group("workload")
    work.add_argument("--rounds", type=positive_int, default=3, help="turns each mode takes (default: 3)")
    work.add_argument("--input-len", type=positive_int, default=128, help="tokens of each prompt (default: 128)")
    work.add_argument("--output-len", type=int, default=64, help="tokens each request generates, >= 2 (default: 64)")
    work.add_argument("--concurrency", type=positive_int, default=32, help="streams of the batched run (default: 32)")
    p.set_defaults(func=run)
    return p


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(count)]


def _run(core: EngineCore, prompts: list[list[int]], output_len: int) -> tuple[float, float, float]:
    """(seconds to the last first token, seconds of the whole run, seconds
    a token after the first, averaged over requests)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    firsts: dict[str, float] = {}
    lasts: dict[str, float] = {}
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    while core.has_unfinished():
        for output in core.step():
            now = time.perf_counter()
            firsts.setdefault(output.request_id, now)
            lasts[output.request_id] = now
    end = time.perf_counter()
    tpot = statistics.mean((lasts[r] - firsts[r]) / (output_len - 1) for r in firsts)
    return max(firsts.values()) - start, end - start, tpot


def run(args: argparse.Namespace) -> int:
    if args.output_len < 2:
        return usage_error("invariance", "--output-len must be >= 2 (TPOT needs two tokens)")
    modes = {"invariant": True, "fast": False}
    loaded = {name: load_model(None, quantization="auto", batch_invariant=flag) for name, flag in modes.items()}
    for name, model in loaded.items():
        print(f"{name}: {model.projection_choice.invariance}")
    vocab = next(iter(loaded.values())).model_config.vocab_size
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in modes}
    for round_ in range(args.rounds):
        for name, flag in modes.items():
            config = EngineConfig(kv_cache_memory=512 << 20, enable_prefix_caching=False, batch_invariant=flag)
            one = _run(EngineCore(loaded[name], config), _prompts(1, args.input_len, vocab, round_), args.output_len)
            many = _run(
                EngineCore(loaded[name], config),
                _prompts(args.concurrency, args.input_len, vocab, 100 + round_),
                args.output_len,
            )
            throughput = args.concurrency * args.output_len / many[1]
            results[name].append((one[2] * 1e3, throughput, many[0]))
            print(
                f"round {round_} {name:9s}: c=1 TPOT {one[2] * 1e3:6.2f} ms, c={args.concurrency} "
                f"{throughput:7.1f} tok/s, prefill of {args.concurrency} x {args.input_len} {many[0]:5.2f} s",
                flush=True,
            )
    for name, rows in results.items():
        tpot, tput, prefill = (statistics.median(col) for col in zip(*rows))
        print(f"median {name:9s}: c=1 TPOT {tpot:6.2f} ms, c={args.concurrency} {tput:7.1f} tok/s, prefill {prefill:5.2f} s")
    inv, fast = (tuple(statistics.median(c) for c in zip(*results[n])) for n in modes)
    print(
        f"invariant / fast: TPOT {inv[0] / fast[0]:.3f}x, throughput {inv[1] / fast[1]:.3f}x, "
        f"prefill {inv[2] / fast[2]:.3f}x"
    )
    return 0
