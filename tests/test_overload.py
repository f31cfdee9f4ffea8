"""Overload control on the actor engine: the queue-time bound, adaptive
concurrency and the degradation policy (docs/reliability.md, "Overload
control").

The engine runs on trio's autojump clock with the fake executor, so every
time below is exact: a step takes ``STEP`` virtual seconds (plus
``token_time`` per batched token where the test says so). Times are binary
fractions, so sums of steps land exactly on the deadlines they are compared
with.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
import trio.testing

import actor_fixtures
from trioserve.actors import (
    EngineOverloaded,
    ExpensiveRequestRefused,
    QueueTimeout,
    RequestShed,
)
from trioserve.engine.config import DegradationPolicy
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.core.sequence import FinishReason
from trioserve.testing import engine_config

STEP = 1 / 64  # virtual seconds per step


def params(max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def fake_engine(*, step_time: float = STEP, **kw: Any):
    """``actor_fixtures.fake_engine`` with this module's step time."""
    return actor_fixtures.fake_engine(step_time=step_time, **kw)


async def collect(engine, prompt: Any = "hello there", p: SamplingParams | None = None, **kw: Any) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, p or params(), **kw)]


async def drain(stream) -> list[RequestOutput]:
    async with stream:
        return [out async for out in stream]


def tokens(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for out in outputs if out.index == index for t in out.new_token_ids]


def planned_ids(engine) -> set[str]:
    return {c.request_id for plan in engine.fake.plans for c in plan.chunks}


def nowait(engine, name: str, p: SamplingParams | None = None, **kw: Any):
    return engine.generate_nowait(name, p or params(), request_id=name, **kw)


async def in_turn(engine, names: tuple[str, ...], p: SamplingParams | None = None, **kw: Any) -> list:
    """Queue requests one by one, letting the scheduler take each it has room for."""
    streams = []
    for name in names:
        streams.append(nowait(engine, name, p, **kw))
        await trio.testing.wait_all_tasks_blocked()
    return streams


# -- the queue-time bound -----------------------------------------------------------


async def test_a_request_waiting_unscheduled_past_max_queue_time_is_dropped_before_any_compute(autojump_clock):
    async with fake_engine(max_num_seqs=1, max_queue_time=5 * STEP) as engine:
        long = nowait(engine, "long", params(20))
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        with pytest.raises(QueueTimeout) as dropped:
            await collect(engine, "late", params(5), request_id="late")
        # Dropped at the first step boundary at or after its queue deadline.
        assert trio.current_time() - start == pytest.approx(5 * STEP)
        error = dropped.value
        assert error.request_id == "late" and error.retry_after > 0
        assert error.finish_reason is FinishReason.QUEUE_TIMEOUT
        assert "max_queue_time (0.078125 s)" in str(error)
        assert "late" not in planned_ids(engine)
        stats = engine.statistics()
        assert stats.overload.num_queue_timeouts == stats.scheduler.num_queue_timeouts == 1
        # The running request is untouched.
        outputs = await drain(long)
        assert len(tokens(outputs)) == 20 and outputs[-1].finish_reason is FinishReason.LENGTH


async def test_requests_still_in_the_admission_queue_time_out_too(autojump_clock):
    # One running, one waiting in the core (max_ready = max_num_seqs = 1), three queued.
    async with fake_engine(max_num_seqs=1, max_queued_requests=4, max_queue_time=8 * STEP) as engine:
        long = nowait(engine, "long", params(30))
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        streams = [nowait(engine, f"q{i}", params(3)) for i in range(4)]
        await trio.testing.wait_all_tasks_blocked()
        assert engine.statistics().num_queued == 3
        for stream in streams:
            with pytest.raises(QueueTimeout):
                await drain(stream)
        assert trio.current_time() - start == pytest.approx(8 * STEP)
        assert not planned_ids(engine) & {f"q{i}" for i in range(4)}
        stats = engine.statistics()
        assert stats.num_queued == 0 and stats.overload.num_queue_timeouts == 4
        await drain(long)


async def test_generate_waiting_for_room_times_out_on_the_callers_side_at_once(autojump_clock):
    async with fake_engine(max_num_seqs=1, max_queued_requests=1, step_time=0.125, max_queue_time=0.3125) as engine:
        long = nowait(engine, "long", params(10))
        await trio.testing.wait_all_tasks_blocked()
        waiting = nowait(engine, "waiting", params(3))
        await trio.testing.wait_all_tasks_blocked()  # taken into the core
        queued = nowait(engine, "queued", params(3))
        start = trio.current_time()
        with pytest.raises(QueueTimeout) as dropped:
            await collect(engine, "blocked", params(3), request_id="blocked")
        # Not rounded to a step boundary: the caller's own timer ended it.
        assert trio.current_time() - start == pytest.approx(0.3125)
        assert "waited for room" in str(dropped.value)
        assert engine.statistics().overload.num_queue_timeouts == 1
        # The two that arrived with it reach their bound at the next boundary (3 steps).
        for stream in (waiting, queued):
            with pytest.raises(QueueTimeout):
                await drain(stream)
        assert trio.current_time() - start == pytest.approx(0.375)
        assert engine.statistics().overload.num_queue_timeouts == 3
        await drain(long)


async def test_a_request_that_has_started_is_never_dropped_by_its_queue_time(autojump_clock):
    # n=2 with one sequence at a time: the second completion waits 20 steps
    # for the first, far past the bound, but the request has started.
    async with fake_engine(max_num_seqs=1, max_queue_time=3 * STEP) as engine:
        outputs = await collect(engine, "started", params(20, n=2))
        for index in (0, 1):
            assert len(tokens(outputs, index)) == 20
        assert {o.finish_reason for o in outputs if o.finished} == {FinishReason.LENGTH}
        assert engine.statistics().overload.num_queue_timeouts == 0


async def test_a_queue_deadline_wakes_an_idle_scheduler(autojump_clock):
    # Two readers that never read fill max_live (2 * max_num_seqs) with
    # paused requests; the engine has nothing to run, and a third request
    # waits in the admission queue. Its queue deadline still ends it on time.
    async with fake_engine(max_num_seqs=1, max_queue_time=0.5, engine_kw={"max_buffered_outputs": 2}) as engine:
        stalled = [nowait(engine, name, params(100)) for name in ("s1", "s2")]
        await trio.sleep(0.2)
        stats = engine.statistics()
        assert stats.scheduler.num_paused == 2 and stats.scheduler.num_running == 0
        start = trio.current_time()
        third = nowait(engine, "third", params(3))
        with pytest.raises(QueueTimeout):
            await drain(third)
        assert trio.current_time() - start == pytest.approx(0.5)
        for stream in stalled:
            stream.close()


async def test_max_queue_time_is_validated():
    for bad in (0, -1.0, math.nan, math.inf, "2"):
        with pytest.raises(ValueError, match="max_queue_time"):
            engine_config(max_queue_time=bad)
    for bad in (0, math.nan):
        with pytest.raises(ValueError, match="target_tpot_ms"):
            engine_config(target_tpot_ms=bad)


# -- adaptive concurrency ---------------------------------------------------------------


async def test_adaptive_concurrency_lowers_the_running_limit_without_preempting(autojump_clock):
    # A step takes (10 + batched tokens) / 1024 s: k sequences decode at
    # (10 + k) / 1024 s per token, so the target of 20 / 1024 s fits 10.
    async with fake_engine(
        step_time=10 / 1024,
        token_time=1 / 1024,
        max_num_seqs=16,
        max_queued_requests=64,
        adaptive_concurrency=True,
        target_tpot_ms=1000 * 20 / 1024,
    ) as engine:
        assert engine.statistics().overload.concurrency_limit == 16
        streams = [nowait(engine, f"r{i}", params(30)) for i in range(48)]
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(drain, stream)
        # Each wave of requests starts together and ends together (30 tokens
        # each); the number starting at once is the limit at the time.
        seen: set[str] = set()
        waves = []
        for plan in engine.fake.plans:
            new = {c.request_id for c in plan.chunks} - seen
            if new:
                waves.append(len(new))
                seen |= new
        # 16 at (10 + 16) / 1024 s a token: cut to 12, but the 16 ran on,
        # unpreempted, to their end. 12 at 22 / 1024: cut to 9 for the next
        # wave. 9 at 19 / 1024, within the target: one more may start, and so on.
        assert waves[:3] == [16, 12, 9]
        assert max(len(plan.chunks) for plan in engine.fake.plans[30:]) <= 12  # after the first wave's 30 steps
        stats = engine.statistics()
        assert stats.scheduler.num_preemptions == 0 and stats.scheduler.num_finished == 48
        overload = stats.overload
        assert overload.num_limit_decreases >= 3 and overload.num_limit_increases >= 1
        assert 1 <= overload.concurrency_limit <= 10
        assert overload.tpot_p90 is not None


async def test_the_running_limit_is_off_unless_asked(autojump_clock):
    async with fake_engine(token_time=0.001, max_num_seqs=16) as engine:
        streams = [nowait(engine, f"r{i}", params(30)) for i in range(32)]
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(drain, stream)
        overload = engine.statistics().overload
        assert overload.concurrency_limit == 16 and overload.tpot_p90 is None
        assert overload.num_limit_decreases == overload.num_limit_increases == 0
        assert max(len(plan.chunks) for plan in engine.fake.plans) == 16


# -- degradation ----------------------------------------------------------------------


async def test_a_full_queue_sheds_its_lowest_priority_for_a_higher_one(autojump_clock):
    async with fake_engine(max_num_seqs=1, max_queued_requests=2, step_time=0.125) as engine:
        running = [nowait(engine, "a", params(5)), nowait(engine, "b", params(5))]  # running, waiting in the core
        await trio.testing.wait_all_tasks_blocked()
        c, d = nowait(engine, "c", priority=5), nowait(engine, "d", priority=5)
        assert engine.statistics().overload.pressure == 1.0
        e = nowait(engine, "e", priority=1)  # takes the place of d: the latest of the lowest
        with pytest.raises(RequestShed) as shed:
            await drain(d)
        assert shed.value.request_id == "d" and shed.value.retry_after > 0
        assert shed.value.finish_reason is FinishReason.SHED
        with pytest.raises(EngineOverloaded):  # c is not of strictly lower priority
            nowait(engine, "f", priority=5)
        g = nowait(engine, "g", priority=0)  # takes c's place
        h = nowait(engine, "h", priority=0)  # and then e's
        with pytest.raises(EngineOverloaded):  # equal priorities never shed each other
            nowait(engine, "i", priority=0)
        for victim in (c, e):
            with pytest.raises(RequestShed):
                await drain(victim)
        for stream in (*running, g, h):
            assert (await drain(stream))[-1].finish_reason is FinishReason.LENGTH
        assert not planned_ids(engine) & {"c", "d", "e"}  # nothing computed for them
        stats = engine.statistics()
        assert stats.overload.num_shed == 3 and stats.num_refused == 2


async def test_shedding_can_be_turned_off_and_never_applies_to_generate(autojump_clock):
    policy = DegradationPolicy(shed_lower_priority=False)
    async with fake_engine(max_num_seqs=1, max_queued_requests=1, step_time=0.125, degradation=policy) as engine:
        streams = await in_turn(engine, ("a", "b", "c"), priority=5)
        with pytest.raises(EngineOverloaded):
            nowait(engine, "urgent", priority=0)
        async with trio.open_nursery() as nursery:
            # generate() waits for room, first come first served, shedding no one.
            nursery.start_soon(collect, engine, "patient", params(2))
            await trio.testing.wait_all_tasks_blocked()
            assert engine.statistics().num_waiting_to_queue == 1
            for stream in streams:
                nursery.start_soon(drain, stream)
        assert engine.statistics().overload.num_shed == 0


async def test_low_priority_gets_max_tokens_capped_under_pressure(autojump_clock):
    policy = DegradationPolicy(cap_at=0.25, low_priority=1, low_priority_max_tokens=3)
    async with fake_engine(max_num_seqs=1, max_queued_requests=8, step_time=0.125, degradation=policy) as engine:
        early = nowait(engine, "early", params(6), priority=1)  # no pressure yet: not capped
        await trio.testing.wait_all_tasks_blocked()
        others = await in_turn(engine, ("a", "b", "c"), params(2))  # a waits in the core, b and c queue
        assert engine.statistics().overload.pressure == 0.25
        capped = nowait(engine, "capped", params(20, min_tokens=10), priority=1)
        urgent = nowait(engine, "urgent", params(20), priority=0)  # not low priority
        short = nowait(engine, "short", params(2), priority=2)  # already within the cap
        results = {}
        for name, stream in (("early", early), ("capped", capped), ("urgent", urgent), ("short", short)):
            results[name] = await drain(stream)
        for stream in others:
            await drain(stream)
        assert {name: len(tokens(out)) for name, out in results.items()} == {"early": 6, "capped": 3, "urgent": 20, "short": 2}
        assert results["capped"][-1].finish_reason is FinishReason.LENGTH
        assert engine.statistics().overload.num_capped == 1


async def test_expensive_requests_are_refused_before_plain_ones(autojump_clock):
    policy = DegradationPolicy(refuse_expensive_at=0.5, expensive_logprobs=5)
    async with fake_engine(max_num_seqs=1, max_queued_requests=8, step_time=0.125, degradation=policy) as engine:
        streams = await in_turn(engine, ("a", "b", "c", "d", "e"), params(2))  # a runs, b waits, 3 queue
        streams.append(nowait(engine, "n2-early", params(2, n=2)))  # 3/8 full: still welcome
        await trio.testing.wait_all_tasks_blocked()
        assert engine.statistics().overload.pressure == 0.5
        with pytest.raises(ExpensiveRequestRefused) as refused:
            nowait(engine, "n2", params(2, n=2))
        assert refused.value.field == "n" and refused.value.retry_after > 0
        assert isinstance(refused.value, EngineOverloaded)
        with pytest.raises(ExpensiveRequestRefused) as refused:
            nowait(engine, "lp6", params(2, logprobs=6))
        assert refused.value.field == "logprobs"
        streams.append(nowait(engine, "lp5", params(2, logprobs=5)))  # at the limit: allowed
        streams.append(nowait(engine, "plain", params(2)))
        async with trio.open_nursery() as nursery:
            # generate() is never refused: it waits for room instead.
            nursery.start_soon(collect, engine, "waits", params(2, n=2))
            for stream in streams:
                nursery.start_soon(drain, stream)
        stats = engine.statistics()
        assert stats.overload.num_refused_expensive == 2 and stats.num_refused == 2
        assert stats.scheduler.num_finished == len(streams) + 1


async def test_degradation_policy_is_validated():
    for field, bad in [
        ("cap_at", 0.0),
        ("cap_at", 1.5),
        ("cap_at", math.nan),
        ("refuse_expensive_at", -0.1),
        ("low_priority_max_tokens", 0),
        ("expensive_logprobs", -1),
        ("low_priority_max_tokens", 2.5),
    ]:
        with pytest.raises(ValueError, match=field):
            DegradationPolicy(**{field: bad})
    assert DegradationPolicy(cap_at=None, refuse_expensive_at=1.0).cap_at is None


async def test_every_accepted_request_ends_exactly_once_in_the_figures(autojump_clock):
    # The chaos test's invariant, on exact cases: a shed victim whose reader
    # had already closed (its Abort waits in the scheduler), a shed victim
    # never read, a stream closed before any read (a client gone before its
    # status went out), a refusal and a generate() cancelled while waiting
    # for room (neither ever queued).
    async with fake_engine(max_num_seqs=1, max_queued_requests=2, step_time=0.125) as engine:
        running = [nowait(engine, "a", params(3)), nowait(engine, "b", params(3))]
        await trio.testing.wait_all_tasks_blocked()
        unread = nowait(engine, "d", priority=5)
        nowait(engine, "c", priority=5).close()  # gone at once: its Abort reaches the scheduler
        await trio.testing.wait_all_tasks_blocked()
        urgent = [nowait(engine, "e", priority=1)]  # sheds c, the latest of the lowest
        urgent.append(nowait(engine, "f", priority=1))  # sheds d
        with pytest.raises(EngineOverloaded):
            nowait(engine, "g", priority=1)
        with trio.move_on_after(0.0625):
            await collect(engine, "patient", params(2))  # waits for room, cancelled: never queued
        with pytest.raises(RequestShed):
            await drain(unread)
        for stream in running:
            assert (await drain(stream))[-1].finish_reason is FinishReason.LENGTH
        h = nowait(engine, "h", priority=1)
        await trio.testing.wait_all_tasks_blocked()
        h.close()  # queued or admitted, never read: aborted by the scheduler
        for stream in urgent:
            assert (await drain(stream))[-1].finish_reason is FinishReason.LENGTH
        await trio.testing.wait_all_tasks_blocked()
        stats = engine.statistics()
    s = stats.scheduler
    assert (s.num_finished, s.num_aborted, stats.overload.num_shed, stats.num_refused) == (4, 1, 2, 1)
    assert (stats.num_accepted, stats.num_cancelled_unqueued, stats.num_deadline_unqueued) == (7, 1, 0)
    ended = s.num_finished + s.num_aborted + s.num_deadline_exceeded + s.num_failed + s.num_queue_timeouts
    assert ended + stats.overload.num_shed == stats.num_accepted
