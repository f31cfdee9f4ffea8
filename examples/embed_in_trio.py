"""Embed trioserve's actor engine in a trio program.

Two requests stream concurrently; one is bounded by a cancel scope
(``trio.move_on_after``), which aborts it inside the engine at the next step
boundary and frees its KV blocks at once. Then the engine's statistics are
printed.

    .venv/bin/python examples/embed_in_trio.py
"""

from __future__ import annotations

import sys

import trio

from trioserve.actors import open_engine
from trioserve.engine.config import EngineConfig
from trioserve.engine.sampling.sampling_params import SamplingParams


async def stream(engine, name: str, prompt, params: SamplingParams) -> int:
    """Print a request's text as it streams; return how many tokens came."""
    count = 0
    async for out in engine.generate(prompt, params, request_id=name):
        count += len(out.new_token_ids)
        sys.stdout.write(f"[{name}] {out.text_delta!r}\n")
        if out.finish_reason is not None:
            print(f"[{name}] finish_reason={out.finish_reason.value}, {count} tokens")
    return count


async def bounded(engine, seconds: float) -> None:
    tokens = 0

    async def run() -> None:
        nonlocal tokens
        tokens = await stream(engine, "bounded", "Write a very long story about a lighthouse.", SamplingParams(max_tokens=4000))

    with trio.move_on_after(seconds) as scope:
        await run()
    if scope.cancelled_caught:
        print(f"[bounded] cancelled by move_on_after({seconds}); the engine aborted it")


async def main(config: EngineConfig | None = None, *, loaded=None, bound: float = 1.0) -> None:
    config = config or EngineConfig(max_num_seqs=8)
    async with open_engine(config, loaded=loaded) as engine:
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, engine, "chat", chat, SamplingParams(temperature=0.0, max_tokens=24))
            nursery.start_soon(bounded, engine, bound)
        # Stop taking requests and let what runs finish (here: nothing
        # left), so the statistics below are final.
        await engine.drain(timeout=5.0)
        stats = engine.statistics()
        print("statistics:")
        print(f"  queued={stats.num_queued} waiting={stats.num_waiting} running={stats.num_running}")
        print(f"  finished={stats.scheduler.num_finished} aborted={stats.scheduler.num_aborted}")
        print(f"  kv_usage={stats.kv_usage:.1%} prefix_hit_rate={stats.prefix_cache_hit_rate:.1%}")
        print(f"  generation={stats.generation_tokens_per_s:.1f} tok/s prompt={stats.prompt_tokens_per_s:.1f} tok/s")


if __name__ == "__main__":
    trio.run(main)
