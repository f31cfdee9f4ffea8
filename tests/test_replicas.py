"""Data parallelism: several engine replicas behind one ``Engine``.

On trio's autojump clock with ``FakeExecutor`` where the routing, the
admission bound, aborts and deadlines are what is tested; on the tiny random
model with the real executor (one step thread per replica) where the tokens
themselves are."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from actor_fixtures import tiny_loaded
from trioserve.actors import EngineOverloaded, FakeExecutor, RequestShed, open_engine
from trioserve.actors.replicas import ReplicatedEngine
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.core.sequence import FinishReason
from trioserve.testing import engine_config

STEP = 0.01


def params(max_tokens: int = 4, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def long_context_loaded(max_positions: int = 2048) -> LoadedModel:
    """The tiny model claiming a longer context: fine for ``FakeExecutor``,
    which never runs the model, and needed for 512-token shared prefixes."""
    loaded = tiny_loaded()
    return attrs.evolve(loaded, model_config=attrs.evolve(loaded.model_config, max_position_embeddings=max_positions))


def assert_clean(engine: Any) -> None:
    """Every replica's pool is free again, and no replica holds a request."""
    for replica in engine.statistics().replicas:
        kv = replica.allocator.kv
        assert kv.num_free_blocks == kv.num_blocks, f"replica {replica.index}: {kv.num_used_blocks} blocks held"
        assert replica.scheduler.num_running == replica.scheduler.num_waiting == replica.scheduler.num_live == 0
    engine.check_invariants()
    assert engine.statistics().num_reserved_ids == 0


@asynccontextmanager
async def fake_dp(
    dp: int, *, loaded: LoadedModel | None = None, step_time: float = STEP, **config: Any
) -> AsyncIterator[Any]:
    """An engine of ``dp`` replicas on FakeExecutors (``engine.fakes``, by replica)."""
    fakes: list[FakeExecutor] = []

    def make(core: EngineCore) -> FakeExecutor:
        fakes.append(FakeExecutor.for_core(core, step_time=step_time))
        return fakes[-1]

    cfg = engine_config(data_parallel_size=dp, **config)
    async with open_engine(cfg, loaded=loaded or tiny_loaded(), executor=make) as engine:
        engine.fakes = fakes
        yield engine
    assert_clean(engine)


async def run_all(engine: Any, requests: list[tuple[Any, SamplingParams]]) -> list[list[int]]:
    """Run ``requests`` (prompt, params) concurrently; their tokens, in order."""
    results: list[list[int]] = [[] for _ in requests]

    async def one(i: int, prompt: Any, p: SamplingParams) -> None:
        async for out in engine.generate(prompt, p, request_id=f"r{i}"):
            results[i].extend(out.new_token_ids)

    async with trio.open_nursery() as nursery:
        for i, (prompt, p) in enumerate(requests):
            nursery.start_soon(one, i, prompt, p)
    return results


def finished_per_replica(engine: Any) -> list[int]:
    return [r.scheduler.num_finished for r in engine.statistics().replicas]


# -- routing ---------------------------------------------------------------------


async def test_unrelated_requests_spread_over_both_replicas_by_load(autojump_clock):
    prompts = [[100 + i] * 3 + [7, 8, 9] for i in range(8)]  # no shared full block
    async with fake_dp(2) as engine:
        assert isinstance(engine, ReplicatedEngine) and len(engine.replicas) == 2
        await run_all(engine, [(p, params()) for p in prompts])
        assert finished_per_replica(engine) == [4, 4]
        assert all(len(fake.plans) > 0 for fake in engine.fakes)
        stats = engine.router.statistics()
        assert stats.num_by_load == 8 and stats.num_by_affinity == 0
        assert stats.outstanding_requests == (0, 0) and stats.outstanding_tokens == (0, 0)


async def test_requests_sharing_a_prefix_go_to_the_replica_that_has_it(autojump_clock):
    block = 16
    first = [11] * (2 * block)
    second = [22] * (2 * block)
    # Interleaved: by load alone each group would be split over both replicas.
    prompts = [(first if i % 2 == 0 else second) + [i + 1] for i in range(8)]
    async with fake_dp(2) as engine:
        results = await run_all(engine, [(p, params()) for p in prompts])
        assert all(len(r) == 4 for r in results)
        assert finished_per_replica(engine) == [4, 4]
        # Each group on one replica: every sequence a replica planned shares its prefix.
        for fake in engine.fakes:
            starts = {tuple(c.token_ids[:block]) for plan in fake.plans for c in plan.chunks if c.start == 0}
            assert len(starts) == 1
        assert engine.router.statistics().num_by_affinity == 6


async def test_affinity_is_bounded_so_one_prefix_cannot_overload_a_replica(autojump_clock):
    shared = [5] * 32
    # max_num_seqs=4: affinity may put a replica at most 2 requests ahead.
    async with fake_dp(2, max_num_seqs=4) as engine:
        await run_all(engine, [(shared + [i + 1], params()) for i in range(12)])
        per_replica = finished_per_replica(engine)
        assert sum(per_replica) == 12 and min(per_replica) >= 5, per_replica
        assert engine.router.statistics().num_spilled >= 1


async def test_a_shared_512_token_prefix_hits_the_cache_as_often_as_on_one_replica(autojump_clock):
    shared = [(i * 37) % 1000 + 10 for i in range(512)]
    requests = [(shared + [2000 + i, 3000 + i], params(4)) for i in range(32)]
    rates = {}
    for dp in (1, 2):
        async with fake_dp(dp, loaded=long_context_loaded(), max_model_len=1024, max_num_seqs=64,
                           max_num_batched_tokens=2048, num_blocks=3000) as engine:
            results = await run_all(engine, requests)
            assert all(len(r) == 4 for r in results)
            kvs = [r.allocator.kv for r in engine.statistics().replicas]
            rates[dp] = sum(kv.prefix_cache_hits for kv in kvs) / sum(kv.prefix_cache_queries for kv in kvs)
            if dp == 2:
                # Within the affinity bound (max_num_seqs // 2 = 32 requests
                # ahead) every request follows the prefix: the first by load.
                router = engine.router.statistics()
                assert (router.num_by_load, router.num_by_affinity, router.num_spilled) == (1, 31, 0)
    assert rates[1] > 0.5
    assert abs(rates[2] - rates[1]) <= 0.1 * rates[1], rates


# -- backpressure, aborts, deadlines ---------------------------------------------


async def test_the_admission_bound_covers_every_replica_together(autojump_clock):
    # One running and one waiting request per replica; the queue bound is 3 in all.
    async with fake_dp(2, max_num_seqs=1, max_queued_requests=3) as engine:
        streams = []
        with pytest.raises(EngineOverloaded) as refused:
            for i in range(50):
                streams.append(engine.generate_nowait([300 + i, 1, 2], params(50), request_id=f"q{i}"))
                await trio.testing.wait_all_tasks_blocked()
        stats = engine.statistics()
        assert refused.value.retry_after > 0
        assert stats.num_queued == 3 == sum(r.num_queued for r in stats.replicas)
        # Each replica took what it can hold (2 live requests) before the queue filled.
        assert [r.scheduler.num_live for r in stats.replicas] == [2, 2]
        assert len(streams) == 2 * 2 + 3
        assert stats.num_refused == 1
        for stream in streams:
            await stream.aclose()
        await trio.testing.wait_all_tasks_blocked()


async def test_a_full_bound_sheds_the_lowest_priority_queued_on_any_replica(autojump_clock):
    async with fake_dp(2, max_num_seqs=1, max_queued_requests=2) as engine:
        def nowait(name: str, priority: int = 0, tokens: int = 5):
            return engine.generate_nowait([ord(name), 1, 2], params(tokens), request_id=name, priority=priority)

        # Two requests held by each replica (running, waiting in its core).
        held = []
        for pair in ("ab", "cd"):
            held += [nowait(name) for name in pair]
            await trio.testing.wait_all_tasks_blocked()
        assert [r.scheduler.num_live for r in engine.statistics().replicas] == [2, 2]
        low = nowait("e", priority=5)
        lower = nowait("f", priority=7)
        queued = engine.statistics().replicas
        assert [r.num_queued for r in queued] == [1, 1]  # one queued for each replica
        high = nowait("g", priority=1)  # takes f's place: the lowest priority anywhere
        with pytest.raises(RequestShed) as shed:
            async for _ in lower:
                pass
        assert shed.value.request_id == "f"
        with pytest.raises(EngineOverloaded):  # e is not of strictly lower priority than 5
            nowait("h", priority=5)
        for stream in (*held, low, high):
            outputs = [out async for out in stream]
            assert outputs[-1].finish_reason is FinishReason.LENGTH
        planned = {c.request_id for fake in engine.fakes for plan in fake.plans for c in plan.chunks}
        assert "f" not in planned and {"a", "b", "c", "d", "e", "g"} <= planned
        assert engine.statistics().overload.num_shed == 1


async def test_abort_and_deadline_free_every_block_on_both_replicas(autojump_clock):
    async with fake_dp(2, max_num_seqs=4) as engine:
        outcomes: dict[str, FinishReason | None] = {}

        async def one(i: int) -> None:
            reason = None
            timeout = 5 * STEP if i % 3 == 0 else None
            async for out in engine.generate([400 + i] * 20, params(200), request_id=f"a{i}", timeout=timeout):
                reason = out.finish_reason
            outcomes[f"a{i}"] = reason

        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(one, i)
            await trio.sleep(10 * STEP)
            for i in range(12):
                if i % 3 == 1:
                    assert engine.abort(f"a{i}")
            await trio.sleep(3 * STEP)
            nursery.cancel_scope.cancel()  # the rest: their callers go away
        # Every request ended by itself (none left for drain to abort), and
        # each scheduler sent its frees before it stopped.
        assert await engine.drain(10.0) == 0
        assert {outcomes[f"a{i}"] for i in range(0, 12, 3)} == {FinishReason.DEADLINE}
        assert {outcomes[f"a{i}"] for i in range(1, 12, 3)} == {FinishReason.ABORT}
        stats = engine.statistics()
        assert all(r.scheduler.num_steps > 0 for r in stats.replicas)
        assert stats.scheduler.num_deadline_exceeded == 4
        assert_clean(engine)


async def test_drain_waits_for_every_replica(autojump_clock):
    async with fake_dp(2) as engine:
        async with trio.open_nursery() as nursery:
            done = []

            async def one(i: int) -> None:
                async for out in engine.generate([500 + i, 1], params(6), request_id=f"d{i}"):
                    if out.finish_reason is not None:
                        done.append(out.finish_reason)

            for i in range(4):
                nursery.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
            assert await engine.drain(10.0) == 0
        assert done == [FinishReason.LENGTH] * 4
        assert finished_per_replica(engine) == [2, 2]


# -- the tokens themselves ---------------------------------------------------------


async def test_two_replicas_give_the_tokens_of_one_for_greedy_and_seeded_requests():
    words = "the quick brown fox jumps over the lazy dog".split()
    requests = []
    for i in range(6):
        prompt = " ".join(words[i:] + words[:i])
        requests.append((prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
        requests.append((prompt, SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=8, ignore_eos=True)))
    results = {}
    for dp in (1, 2):
        config = engine_config(data_parallel_size=dp, num_threads=1)
        async with open_engine(config, loaded=tiny_loaded()) as engine:
            results[dp] = await run_all(engine, requests)
            if dp == 2:  # spread by load (prompts of slightly different lengths)
                per_replica = finished_per_replica(engine)
                assert sum(per_replica) == 12 and min(per_replica) >= 4, per_replica
                # One cache dtype, chosen once for the shared model: "auto"
                # measures, and two measurements could choose apart.
                first, second = (replica.core.kv_dtype for replica in engine.replicas)
                assert first is second, (first, second)
            assert_clean(engine)
    assert results[1] == results[2]
    assert all(len(tokens) == 8 for tokens in results[1])
