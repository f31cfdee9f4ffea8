"""The actor engine, replicated or not, on a fixed set of prompts: what
``trioserve bench dp`` and ``trioserve bench offline --data-parallel-size``
measure. Prompts go in ``concurrency`` at a time; greedy, EOS ignored."""

from __future__ import annotations

import statistics
import time

import attrs
import trio

from trioserve.actors import open_engine
from trioserve.engine.config import EngineConfig
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.sampling.sampling_params import SamplingParams


@attrs.frozen
class ActorRunResult:
    layout: str  # "DP=2 x 1 thread(s)"
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    ttft_ms: float  # median over requests
    tpot_ms: float  # median over requests

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def run_actor_engine(
    config: EngineConfig,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    *,
    loaded: LoadedModel | None = None,
) -> ActorRunResult:
    """Start ``open_engine(config)``, warm each replica with a tiny request,
    then time ``prompts`` through it, ``concurrency`` at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttfts: list[float] = []
    tpots: list[float] = []
    tokens = 0
    async with open_engine(config, loaded=loaded) as engine:
        warm = [[1000 + i] * 8 for i in range(config.data_parallel_size)]  # unrelated: one per replica
        async with trio.open_nursery() as nursery:
            for prompt in warm:
                nursery.start_soon(_drain, engine.generate(prompt, SamplingParams(max_tokens=2)))
        limit = trio.CapacityLimiter(concurrency)

        async def one(index: int, prompt: list[int]) -> None:
            nonlocal tokens
            async with limit:
                start = time.perf_counter()
                first = last = None
                count = 0
                async for out in engine.generate(prompt, params, request_id=f"b{index}"):
                    now = time.perf_counter()
                    if out.new_token_ids and first is None:
                        first = now
                    last = now
                    count += len(out.new_token_ids)
                tokens += count
                assert first is not None and last is not None
                ttfts.append(first - start)
                if count > 1:
                    tpots.append((last - first) / (count - 1))

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for index, prompt in enumerate(prompts):
                nursery.start_soon(one, index, prompt)
        seconds = time.perf_counter() - start
    return ActorRunResult(
        f"DP={config.data_parallel_size} x {config.num_threads or 'default'} thread(s)",
        concurrency,
        len(prompts),
        tokens,
        seconds,
        statistics.median(ttfts) * 1000,
        statistics.median(tpots) * 1000 if tpots else float("nan"),
    )
