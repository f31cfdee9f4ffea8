"""``trioserve bench structured``: structured output's cost, side by side in
one run on the embedded engine: TPOT at concurrency 1 and output throughput
at concurrency 32, every request constrained by a mid-size JSON schema
against the same run unconstrained; the mask time per step (all constrained
rows of a step, in one batch) and the compile time of the schema.

Unconstrained requests use ``ignore_eos`` and constrained ones are asked for
a long enough schema, so both runs decode about ``--max-tokens`` per request.

``--masks``: ``overlapped`` (the engine's way) fills a step's mask in a
worker thread while the step's forward runs; ``sequential`` fills it in the
scheduler before the plan goes out, as the engine did at first; ``both``
runs the constrained runs both ways, side by side in one process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import attrs
import trio

from trioserve.actors.engine import open_engine
from trioserve.engine.config import EngineConfig
from trioserve.engine.sampling.grammar import FilledMask, GrammarCompiler, MaskFill
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.sampling.structured_output import StructuredOutput

from ..arguments import positive_int


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


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "structured",
        help="JSON-schema-constrained requests against free ones, through the actors",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench structured``: "),
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    work = p.add_argument_group("workload")
    work.add_argument("--requests", type=positive_int, default=32, help="requests at concurrency 32 (default: 32)")
    work.add_argument("--max-tokens", type=positive_int, default=64, help="tokens of each request (default: 64)")
    work.add_argument("--c1-requests", type=positive_int, default=3,
                      help="requests run one at a time for TPOT at concurrency 1 (default: 3)")  # fmt: skip
    work.add_argument("--masks", choices=["overlapped", "sequential", "both"], default="overlapped",
                      help="fill each step's mask beside its forward (the engine's way), before the plan goes out, "
                           "or both side by side (default: overlapped)")  # fmt: skip
    work.add_argument("--rounds", type=positive_int, default=1,
                      help="repeat the runs this many times, alternating their order (default: 1)")  # fmt: skip
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    trio.run(measure, args)
    return 0


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


@attrs.frozen(eq=False)
class _TimedFill:
    """A ``MaskFill`` that records (rows, seconds) of its run."""

    fill: MaskFill
    record: list

    def run(self) -> FilledMask:
        start = time.perf_counter()
        out = self.fill.run()
        self.record.append((len(self.fill.rows), time.perf_counter() - start))
        return out


def _time_masks(engine, masks: list, mode: str) -> None:
    """Record every step's mask fill. ``overlapped``: the engine's way;
    ``sequential``: filled in the event loop before the plan goes out (the
    scheduler actor's plan step, wrapped)."""
    core, actor = engine.core, engine._scheduler
    actor.__dict__.pop("_plan", None)
    core.__dict__.pop("mask_fill", None)
    mask_fill = core.mask_fill

    def timed_fill(plan):
        fill = mask_fill(plan)
        return None if fill is None else _TimedFill(fill, masks)

    core.mask_fill = timed_fill
    if mode == "overlapped":
        return
    plan_step = actor._plan

    async def plan_with_masks(allocator, kv_results):
        plan, fill = await plan_step(allocator, kv_results)
        if fill is None:
            return plan, None
        step = attrs.evolve(plan.plan, awaits_mask=False, token_mask=core.mask_filled(fill.run()))
        return attrs.evolve(plan, plan=step), None

    actor._plan = plan_with_masks


async def measure(args: argparse.Namespace) -> None:
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
        modes = ("overlapped", "sequential") if args.masks == "both" else (args.masks,)
        print(f"engine up; tokenizer info {tokenizer_s:.2f} s, compile {compile_ms:.1f} ms", flush=True)
        await engine.prepare(constrained)
        await _run(engine, free, 4, 4)  # warm-up
        rounds = []
        for round_index in range(args.rounds):
            results = {}
            for concurrency, requests in ((1, args.c1_requests), (32, args.requests)):
                runs = [("free", free, modes[0])] + [(f"json {mode}", constrained, mode) for mode in modes]
                # Free first in even rounds, last in odd ones: drift between runs cancels out.
                for name, params, mode in runs if round_index % 2 == 0 else runs[::-1]:
                    _time_masks(engine, masks, mode)
                    masks.clear()
                    results[(concurrency, name)] = await _run(engine, params, concurrency, requests) + (list(masks),)
                    print(f"round {round_index} c={concurrency} {name}: done", flush=True)
            rounds.append(results)
    print(f"tokenizer info for xgrammar: {tokenizer_s:.2f} s once; schema compile {compile_ms:.1f} ms cold, {cached_us:.0f} us cached")
    for round_index, results in enumerate(rounds):
        print(f"round {round_index}:")
        _report(results, modes)
    if len(rounds) > 1:
        for concurrency in (1, 32):
            for mode in modes:
                name = f"json {mode}"
                tpot = [r[(concurrency, name)][0] / r[(concurrency, "free")][0] for r in rounds]
                rate = [r[(concurrency, name)][1] / r[(concurrency, "free")][1] for r in rounds]
                print(
                    f"c={concurrency} masks {mode}, {len(rounds)} rounds: constrained/free TPOT median "
                    f"{statistics.median(tpot):.3f} (each {', '.join(f'{x:.3f}' for x in tpot)}); "
                    f"throughput median {statistics.median(rate):.3f} (each {', '.join(f'{x:.3f}' for x in rate)})"
                )


def _report(results, modes) -> None:
    for concurrency in (1, 32):
        free_r = results[(concurrency, "free")]
        for mode in modes:
            json_r = results[(concurrency, f"json {mode}")]
            line = (
                f"c={concurrency} masks {mode}: TPOT median free {free_r[0]:.1f} ms, json {json_r[0]:.1f} ms "
                f"({json_r[0] / free_r[0] - 1:+.1%}); output tok/s free {free_r[1]:.1f}, json {json_r[1]:.1f} "
                f"({json_r[1] / free_r[1] - 1:+.1%}); tokens free {free_r[2]}, json {json_r[2]}"
            )
            mask_times = json_r[3]
            if mask_times:
                per_step = [t * 1000 for _, t in mask_times]
                rows = statistics.mean(n for n, _ in mask_times)
                line += f"; mask per step median {statistics.median(per_step):.2f} ms (mean {rows:.1f} rows)"
            print(line)
