"""The scheduler actor's bound and the slo policy (actors/scheduler.py,
``max_urgent``): with ``2 * max_num_seqs`` loose requests held (every slot
running, as many waiting), a request with a tight TTFT target that arrives
is handed over past the bound, so the policy sees it and takes a slot from
a running request with slack; without it, it would wait in the admission
queue for a request to end. Real actors on a fake executor and the
autojump clock; the admission queue's bound still holds the rest back."""

from __future__ import annotations

import trio

import actor_fixtures
from trioserve.engine.latency_objectives import LatencyObjectives
from trioserve.engine.sampling.sampling_params import SamplingParams

MAX_NUM_SEQS = 4
LOOSE = LatencyObjectives(ttft=30.0, tpot=1.0)
TIGHT_TTFT = 1.0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def _drain(stream, started: trio.Event, first_tokens: dict[int, float], i: int) -> None:
    async for out in stream:
        if out.new_token_ids:
            first_tokens.setdefault(i, trio.current_time())
        if out.num_output_tokens >= 10:
            started.set()


async def _hold_the_bound(engine, nursery: trio.Nursery) -> dict[int, float]:
    """2 * MAX_NUM_SEQS + 2 loose requests, each holding a slot for ~2 s once
    running (a request waiting for a slot misses 1 s), drained in
    ``nursery``; returns once the scheduler holds its bound (every slot
    running, as many waiting, the rest in the admission queue), with the
    dict their first tokens' times fill in, by their index."""
    prompts = [[11 + 7 * i + j for j in range(40)] for i in range(2 * MAX_NUM_SEQS + 2)]
    loose = [engine.generate_nowait(p, greedy(150), priority=1, objectives=LOOSE) for p in prompts]
    started = [trio.Event() for _ in loose]
    first_tokens: dict[int, float] = {}
    for i, (stream, event) in enumerate(zip(loose, started, strict=True)):
        nursery.start_soon(_drain, stream, event, first_tokens, i)
    for event in started[:MAX_NUM_SEQS]:
        await event.wait()
    stats = engine.statistics()
    assert (stats.scheduler.num_running, stats.scheduler.num_waiting) == (MAX_NUM_SEQS, MAX_NUM_SEQS)
    assert stats.scheduler.num_live == 2 * MAX_NUM_SEQS and stats.num_queued == 2
    return first_tokens


async def _first_token_at(stream) -> float:
    first = None
    async for out in stream:
        if first is None and out.new_token_ids:
            first = trio.current_time()
    assert first is not None
    return first


async def test_a_tight_ttft_request_behind_the_held_bound_gets_its_first_token_in_time(autojump_clock):
    async with actor_fixtures.fake_engine(
        step_time=0.01, token_time=0.001, scheduling_policy="slo", max_num_seqs=MAX_NUM_SEQS
    ) as engine:
        async with trio.open_nursery() as nursery:
            await _hold_the_bound(engine, nursery)
            start = trio.current_time()
            chat = engine.generate_nowait([900 + i for i in range(20)], greedy(4), objectives=LatencyObjectives(ttft=TIGHT_TTFT))
            assert await _first_token_at(chat) - start <= TIGHT_TTFT
            # Taken past the bound, it took a slot. The preempted request's next
            # token is due after the queued ones' first (30 s + 1 s a token),
            # so the policy runs those first and they may be taken too: within
            # the bound's urgent share, and with no further preemption.
            assert engine.core.scheduler.statistics().num_preemptions == 1
            assert engine.statistics().scheduler.num_live <= 3 * MAX_NUM_SEQS


async def test_a_better_class_is_taken_past_the_bound_and_runs_before_those_held(autojump_clock):
    """With the bound held by loose requests, a request of a better class
    whose target is far off (nothing at risk, nothing preempted) is taken
    into the core all the same, so the next free slot is its: held in the
    admission queue, a loose request waiting in the core would take it."""
    async with actor_fixtures.fake_engine(
        step_time=0.01, token_time=0.001, scheduling_policy="slo", max_num_seqs=MAX_NUM_SEQS
    ) as engine:
        async with trio.open_nursery() as nursery:
            first_tokens = await _hold_the_bound(engine, nursery)
            chat = engine.generate_nowait([900 + i for i in range(20)], greedy(4), priority=0, objectives=LOOSE)
            first = await _first_token_at(chat)
            assert engine.core.scheduler.statistics().num_preemptions == 0
            # No request held waiting when it came started before it (the
            # running ones end together: it shares their successors' step),
            # and it took one of the slots they left.
            assert all(first <= t for i, t in first_tokens.items() if i >= MAX_NUM_SEQS)
            assert len([i for i in first_tokens if i >= MAX_NUM_SEQS]) < MAX_NUM_SEQS
