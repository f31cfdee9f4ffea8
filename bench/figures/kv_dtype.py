"""``trioserve bench kv-dtype``: the KV cache's dtype (``--kv-cache-dtype``),
side by side in one run on the embedded engine core: decode TPOT at each
concurrency and the pool's bytes per dtype, the pool sized by default
(``max_num_seqs`` contexts of ``max_model_len`` tokens,
engine/core/kv_budget.py), greedy, ignore_eos.

The model is loaded once and shared by one core per cache dtype. Each round
runs every concurrency on every dtype in turn, so drift on a shared machine
hits them alike; the first round builds the CPU kernels of the batch sizes
it meets and is left out of the medians (unless it is the only one). TPOT
is the median time of the steps in which every running request decodes one
token. Everything runs on one step thread, as the server does.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.loading.loader import load_model
from trioserve.engine.runtime.step_thread import StepThread
from trioserve.engine.sampling.sampling_params import SamplingParams

from ..arguments import int_list, name_list, positive_int


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "kv-dtype",
        help="decode time and pool size of each KV cache dtype, on the engine core",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench kv-dtype``: "),
    )
    work = p.add_argument_group("workload")
    work.add_argument("--dtypes", type=name_list, default=["float32", "bfloat16"],
                      help="cache dtypes, comma-separated; the first is the baseline (default: float32,bfloat16)")  # fmt: skip
    work.add_argument("--concurrency", type=int_list, default=[1, 32], help="requests at once, comma-separated (default: 1,32)")
    work.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens (default: 128)")
    work.add_argument("--output-len", type=positive_int, default=128, help="tokens out (default: 128)")
    work.add_argument("--rounds", type=positive_int, default=3, help="rounds of every dtype (default: 3)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    engine.add_argument("--quantization", default="none", help="the weights' (docs/api.md; default: none)")
    engine.add_argument("--num-threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(func=run)
    return p


def decode_steps(core: EngineCore, tag: str, concurrency: int, input_len: int, output_len: int, vocab: int) -> list[float]:
    """Run ``concurrency`` random prompts together; the seconds of each step in which they all decoded."""
    rng = random.Random(concurrency)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(concurrency):
        core.add_request(f"{tag}-{i}", [rng.randrange(100, vocab) for _ in range(input_len)], params)
    steps = []
    while core.has_unfinished():
        plan = core.schedule()
        start = time.perf_counter()
        core.process_output(plan, core.execute(plan))
        elapsed = time.perf_counter() - start
        if len(plan.chunks) == concurrency and all(c.num_tokens == 1 for c in plan.chunks):
            steps.append(elapsed)
    return steps


def bench(args: argparse.Namespace) -> None:
    loaded = load_model(args.model, quantization=args.quantization)
    vocab = loaded.model_config.vocab_size
    common = dict(
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=max(2048, args.input_len * max(args.concurrency)),
        warm_up=False,  # kernels are built as they are met: the first round pays, the medians drop it
    )
    cores = {name: EngineCore(loaded, EngineConfig(**common, kv_cache_dtype=name)) for name in args.dtypes}
    tpot: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for concurrency in args.concurrency:
            for name, core in cores.items():
                steps = decode_steps(core, f"r{r}", concurrency, args.input_len, args.output_len, vocab)
                ms = statistics.median(steps) * 1000
                print(f"round {r} concurrency {concurrency} {name}: decode step {ms:.1f} ms", flush=True)
                if r == 0 and args.rounds > 1:
                    continue
                tpot.setdefault((name, concurrency), []).append(ms)
    kept = args.rounds - 1 if args.rounds > 1 else 1
    print()
    print(
        f"{args.input_len} in, {args.output_len} out, greedy; median decode step of {kept} round(s) after the first; "
        f"{loaded.projection_choice.summary}"
    )
    base = args.dtypes[0]
    header = f"{'kv cache':10} {'pool tokens':>12} {'pool MiB':>9} {'B/token':>8}"
    for c in args.concurrency:
        header += f" {f'TPOT@{c} ms':>12} {f'vs {base}':>9}"
    print(header)
    for name, core in cores.items():
        pool = core.kv_pool
        line = f"{name:10} {pool.tokens:12d} {pool.nbytes / 2**20:9.1f} {pool.bytes_per_block // pool.block_size:8d}"
        for c in args.concurrency:
            ms = statistics.median(tpot[(name, c)])
            line += f" {ms:12.1f} {ms / statistics.median(tpot[(base, c)]):8.2f}x"
        print(line)
    for name, core in cores.items():
        print(f"{name}: {core.kv_dtype.reason}; pool: {core.kv_pool.reason}")


def run(args: argparse.Namespace) -> int:
    with StepThread(args.num_threads) as thread:
        thread.call(bench, args)
    return 0
