"""``trioserve bench speculative``: speculative decoding (``--speculative
ngram``) against plain decoding, side by side in one run on the embedded
engine core: TPOT of one stream on prompts that ask to repeat or edit a
given text, greedy, with the acceptance rate and the speed-up, and a check
that both produce the same tokens.

The model is loaded once; each round runs every prompt without and then
with speculation, so drift on a shared machine hits both alike. The first
round builds the CPU kernels of the chunk sizes it meets and is left out of
the medians (unless it is the only one). Everything runs on one step
thread, as the server does.
"""

from __future__ import annotations

import argparse
import statistics
import time

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.loading.loader import load_model
from trioserve.engine.runtime.step_thread import StepThread
from trioserve.engine.sampling.sampling_params import SamplingParams

from ..arguments import positive_int

TEXT = (
    "The river starts high in the mountains, where snow melts slowly in the spring sun. "
    "It runs through narrow valleys and past small villages, turning old mills and feeding green fields. "
    "By the time it reaches the plain it is wide and calm, and boats carry grain, wood and stone "
    "down to the city by the sea. In the city the river splits into many canals, crossed by bridges "
    "of brick and iron, and at night the lamps on the bridges shine on the dark water."
)
PROMPTS = {
    "repeat": f"Repeat the following text exactly, without any comment:\n\n{TEXT}",
    "edit": f"Rewrite the following text, replacing every 'river' with 'stream'. Change nothing else:\n\n{TEXT}",
}


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "speculative",
        help="n-gram speculative decoding against plain decoding, one stream on the engine core",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench speculative``: "),
    )
    work = p.add_argument_group("workload")
    work.add_argument("--max-tokens", type=positive_int, default=128, help="tokens of each answer, >= 2 (default: 128)")
    work.add_argument("--rounds", type=positive_int, default=3, help="rounds of both modes (default: 3)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    engine.add_argument("--num-speculative-tokens", type=positive_int, default=4, help="tokens proposed a step (default: 4)")
    engine.add_argument("--quantization", default="auto",
                        help="as serve's --quantization (default auto: compressed for the default GGUF)")  # fmt: skip
    engine.add_argument("--num-threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(func=run)
    return p


def run_one(core: EngineCore, request_id: str, prompt: str, max_tokens: int) -> tuple[list[int], float]:
    """Run one request alone; its tokens and its TPOT in seconds."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(request_id, [{"role": "user", "content": prompt}], params)
    tokens: list[int] = []
    first = last = None
    while core.has_unfinished():
        for out in core.step():
            if out.new_token_ids:
                last = time.perf_counter()
                if first is None:
                    first = last
                tokens.extend(out.new_token_ids)
    assert first is not None and last is not None and len(tokens) > 1
    # First token to last: the decode part; the first counts as the prompt's.
    return tokens, (last - first) / (len(tokens) - 1)


def bench(args: argparse.Namespace) -> None:
    loaded = load_model(args.model, quantization=args.quantization)
    print(f"{loaded.projection_choice.summary}")
    # Kernels are built as they are first met (warm_up=False): the first round pays for them, the median drops it.
    common = dict(
        max_model_len=1024, kv_cache_memory=256 << 20, model=args.model, warm_up=False, quantization=args.quantization
    )
    plain = EngineCore(loaded, EngineConfig(**common))
    spec = EngineCore(
        loaded, EngineConfig(**common, speculative="ngram", num_speculative_tokens=args.num_speculative_tokens)
    )
    run_one(plain, "warm-plain", "Hello", 8)
    run_one(spec, "warm-spec", "Hello", 8)
    tpot: dict[tuple[str, str], list[float]] = {}
    same = True
    counts = {}
    for r in range(args.rounds):
        for name, prompt in PROMPTS.items():
            before = spec.scheduler.statistics()
            plain_tokens, plain_tpot = run_one(plain, f"p{r}{name}", prompt, args.max_tokens)
            spec_tokens, spec_tpot = run_one(spec, f"s{r}{name}", prompt, args.max_tokens)
            after = spec.scheduler.statistics()
            same &= plain_tokens == spec_tokens
            drafted = after.num_draft_tokens - before.num_draft_tokens
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            print(
                f"round {r} {name}: plain {plain_tpot * 1000:.1f} ms, ngram {spec_tpot * 1000:.1f} ms, "
                f"{accepted}/{drafted} proposed tokens accepted",
                flush=True,
            )
            if r == 0 and args.rounds > 1:
                continue  # it built the kernels of the chunk sizes it met
            tpot.setdefault((name, "plain"), []).append(plain_tpot)
            tpot.setdefault((name, "ngram"), []).append(spec_tpot)
            total = counts.get(name, (0, 0))
            counts[name] = (total[0] + drafted, total[1] + accepted)
    kept = args.rounds - 1 if args.rounds > 1 else 1
    print(f"{args.max_tokens} tokens out, greedy, one stream, median TPOT of {kept} round(s) after the first")
    print(f"{'prompt':8} {'plain ms':>9} {'ngram ms':>9} {'speed-up':>9} {'proposed':>9} {'accepted':>9} {'rate':>6}")
    for name in PROMPTS:
        p = statistics.median(tpot[(name, "plain")]) * 1000
        s = statistics.median(tpot[(name, "ngram")]) * 1000
        drafted, accepted = counts[name]
        rate = accepted / drafted if drafted else 0.0
        print(f"{name:8} {p:9.1f} {s:9.1f} {p / s:8.2f}x {drafted:9d} {accepted:9d} {rate:6.0%}")
    print("greedy tokens identical with and without speculation:", same)


def run(args: argparse.Namespace) -> int:
    with StepThread(args.num_threads) as thread:
        thread.call(bench, args)
    return 0
