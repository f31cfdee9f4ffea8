"""Structured output's cost, side by side in one run on the embedded engine:
TPOT at concurrency 1 and output throughput at concurrency 32, every request
constrained by a mid-size JSON schema against the same run unconstrained;
the mask time per step (all constrained rows of a step, in one batch) and
the compile time of the schema.

    python scripts/bench_structured.py [--requests 32] [--max-tokens 64] [--c1-requests 3] [--rounds 4]

Unconstrained requests use ``ignore_eos`` and constrained ones are asked for
a long enough schema, so both runs decode about ``--max-tokens`` per request.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import attrs
import trio

from trioserve.actors.engine import open_engine
from trioserve.engine.config import EngineConfig
from trioserve.engine.grammar import GrammarCompiler
from trioserve.engine.sampling_params import SamplingParams
from trioserve.engine.structured_output import StructuredOutput

STRING = {"type": "string", "maxLength": 24}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": STRING,
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
        "tags": {"type": "array", "items": STRING, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": STRING, "city": STRING, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
        "notes": {"type": "array", "items": STRING, "minItems": 3, "maxItems": 6},
    },
    "required": ["name", "age", "email", "tags", "address", "role", "score", "active", "notes"],
}
MESSAGES = [{"role": "user", "content": "Invent a customer record as JSON."}]


async def _one(engine, params, index, gaps, counts):
    last = None
    async for output in engine.generate(MESSAGES, attrs.evolve(params, seed=index)):
        now = time.perf_counter()
        if last is not None and output.new_token_ids:
            gaps.append((now - last) / len(output.new_token_ids))
        last = now
        counts.append(len(output.new_token_ids))


async def _run(engine, params, concurrency, requests):
    gaps, counts = [], []
    start = time.perf_counter()
    limiter = trio.CapacityLimiter(concurrency)

    async def job(index):
        async with limiter:
            await _one(engine, params, index, gaps, counts)

    async with trio.open_nursery() as nursery:
        for index in range(requests):
            nursery.start_soon(job, index)
    elapsed = time.perf_counter() - start
    return statistics.median(gaps) * 1000, sum(counts) / elapsed, sum(counts)


async def main(args):
    schema = StructuredOutput.json_schema(SCHEMA)
    free = SamplingParams(temperature=0.7, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.7, max_tokens=args.max_tokens, structured_output=schema)
    config = EngineConfig(max_num_seqs=32, kv_cache_memory=512 << 20, max_model_len=1024)
    async with open_engine(config) as engine:
        core = engine.core
        compiler = core.grammars.compiler
        cold = GrammarCompiler(compiler.tokenizer, compiler.vocab_size, compiler.stop_token_ids)
        start = time.perf_counter()
        cold._backend()
        tokenizer_s = time.perf_counter() - start
        start = time.perf_counter()
        cold.compile(schema)
        compile_ms = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        cold.compile(schema)
        cached_us = (time.perf_counter() - start) * 1e6

        masks: list[tuple[int, float]] = []
        attach = core.attach_masks

        @functools.wraps(attach)
        def timed(plan):
            start = time.perf_counter()
            out = attach(plan)
            if out.plan.token_mask is not None:
                masks.append((len(out.plan.token_mask.request_ids), time.perf_counter() - start))
            return out

        core.attach_masks = timed
        print(f"engine up; tokenizer info {tokenizer_s:.2f} s, compile {compile_ms:.1f} ms", flush=True)
        await engine.prepare(constrained)
        await _run(engine, free, 4, 4)  # warm-up
        rounds = []
        for round_index in range(args.rounds):
            results = {}
            for concurrency, requests in ((1, args.c1_requests), (32, args.requests)):
                # Free first in even rounds, constrained first in odd ones.
                order = (("free", free), ("json", constrained))
                for name, params in order if round_index % 2 == 0 else order[::-1]:
                    masks.clear()
                    results[(concurrency, name)] = await _run(engine, params, concurrency, requests) + (list(masks),)
                    print(f"round {round_index} c={concurrency} {name}: done", flush=True)
            rounds.append(results)
    print(f"tokenizer info for xgrammar: {tokenizer_s:.2f} s once; schema compile {compile_ms:.1f} ms cold, {cached_us:.0f} us cached")
    for round_index, results in enumerate(rounds):
        print(f"round {round_index}:")
        _report(results)
    if len(rounds) > 1:
        for concurrency in (1, 32):
            tpot = [r[(concurrency, "json")][0] / r[(concurrency, "free")][0] for r in rounds]
            rate = [r[(concurrency, "json")][1] / r[(concurrency, "free")][1] for r in rounds]
            print(
                f"c={concurrency}, {len(rounds)} rounds: json/free TPOT ratio median {statistics.median(tpot):.3f} "
                f"(each {', '.join(f'{x:.3f}' for x in tpot)}); throughput ratio median {statistics.median(rate):.3f}"
            )


def _report(results) -> None:
    for concurrency in (1, 32):
        free_r, json_r = results[(concurrency, "free")], results[(concurrency, "json")]
        line = (
            f"c={concurrency}: TPOT median free {free_r[0]:.1f} ms, json {json_r[0]:.1f} ms ({json_r[0] / free_r[0] - 1:+.1%}); "
            f"output tok/s free {free_r[1]:.1f}, json {json_r[1]:.1f} ({json_r[1] / free_r[1] - 1:+.1%}); "
            f"tokens free {free_r[2]}, json {json_r[2]}"
        )
        mask_times = json_r[3]
        if mask_times:
            per_step = [t * 1000 for _, t in mask_times]
            rows = statistics.mean(n for n, _ in mask_times)
            line += f"; mask per step median {statistics.median(per_step):.2f} ms (mean {rows:.1f} rows)"
        print(line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--c1-requests", type=int, default=3, help="requests run one at a time for TPOT at concurrency 1")
    parser.add_argument("--rounds", type=int, default=1, help="alternate free and constrained runs this many times")
    trio.run(main, parser.parse_args())
