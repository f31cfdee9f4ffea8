"""The actor engine on trio's autojump clock, with a fake executor.

The fake executor sleeps ``step_time`` of virtual time per step and answers
deterministic tokens, so timings here are exact and the tests run in
milliseconds. Everything else (scheduler, pool, detokenizer, tokenizer) is
real.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import pytest
import trio
import trio.testing

import actor_fixtures
from actor_fixtures import tiny_loaded
from trioserve.actors import (
    DuplicateRequestError,
    EngineClosed,
    EngineOverloaded,
    FakeExecutor,
    RequestFailed,
    open_engine,
)
from trioserve.engine.core.new_request import RequestInput
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.core.sequence import FinishReason
from trioserve.testing import engine_config

STEP = 0.01  # virtual seconds per step


def params(max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def fake_engine(*, step_time: float = STEP, **kw: Any):
    """``actor_fixtures.fake_engine`` with this module's step time."""
    return actor_fixtures.fake_engine(step_time=step_time, **kw)


async def collect(engine, prompt: Any = "hello there", p: SamplingParams | None = None, **kw: Any) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, p or params(), **kw)]


def tokens(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for out in outputs if out.index == index for t in out.new_token_ids]


async def drain_stream(stream) -> list[RequestOutput]:
    return [out async for out in stream]


def planned_ids(engine) -> list[set[str]]:
    return [{c.request_id for c in plan.chunks} for plan in engine.fake.plans]


async def test_a_request_streams_deltas_and_ends_with_its_finish_reason(autojump_clock):
    async with fake_engine() as engine:
        start = trio.current_time()
        outputs = await collect(engine, p=params(6))
        assert tokens(outputs) and len(tokens(outputs)) == 6
        assert [o.finish_reason for o in outputs][-1] is FinishReason.LENGTH
        assert all(o.finish_reason is None for o in outputs[:-1])
        # One step per token (the prompt's step samples the first).
        assert trio.current_time() - start == pytest.approx(6 * STEP)
        stats = engine.statistics()
        assert stats.scheduler.num_finished == 1 and stats.scheduler.total_generation_tokens == 6
        # One allocator round trip per step, plus the batch that frees the last blocks.
        await trio.testing.wait_all_tasks_blocked()
        assert engine.statistics().allocator.num_batches == stats.executor.num_steps + 1


async def test_final_only_yields_one_cumulative_output_per_completion(autojump_clock):
    async with fake_engine() as engine:
        streamed = await collect(engine, "same prompt", params(5, n=2, seed=3), request_id="a")
        final = await collect(engine, "same prompt", params(5, n=2, seed=3), request_id="b", final_only=True)
        assert [o.index for o in final] == [0, 1]
        for index in (0, 1):
            assert list(final[index].new_token_ids) == tokens(streamed, index)
            assert final[index].text_delta == "".join(o.text_delta for o in streamed if o.index == index)
            assert final[index].finish_reason is FinishReason.LENGTH


async def test_duplicate_request_ids_are_refused_while_live(autojump_clock):
    async with fake_engine() as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(collect, engine, "x", params(20), request_id="dup"))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(DuplicateRequestError):
                await collect(engine, "y", request_id="dup")
            with pytest.raises(DuplicateRequestError):
                engine.generate_nowait("y", request_id="dup")
        await collect(engine, "y", request_id="dup")  # free again once it ended


async def test_the_python_edge_checks_a_request_once_into_a_request_input(autojump_clock):
    async with fake_engine() as engine:
        for prompt, priority in (("", 0), ([-1], 0), ("hi", True)):
            with pytest.raises(InvalidRequestError) as info:
                engine.generate_nowait(prompt, priority=priority)
            assert info.value.field == ("priority" if priority is True else "prompt")
            with pytest.raises(InvalidRequestError):
                await collect(engine, prompt, priority=priority)
        # An edge that built its RequestInput hands it over as it is.
        request = RequestInput("hello there", params(3), priority=-1)
        async with engine.submit_nowait(request, request_id="built") as stream:
            outputs = [output async for output in stream]
        assert outputs[-1].finish_reason is FinishReason.LENGTH and stream.request_id == "built"
        outputs = [output async for output in engine.submit(request)]
        assert sum(len(o.new_token_ids) for o in outputs) == 3


async def test_caller_cancel_scope_aborts_at_the_next_step_boundary(autojump_clock):
    async with fake_engine() as engine:
        got: list[RequestOutput] = []
        with trio.move_on_after(3.5 * STEP):
            async for out in engine.generate("cancel me", params(100), request_id="c"):
                got.append(out)
        assert len(tokens(got)) == 3  # steps 1-3 ended before the cancel at 3.5
        await collect(engine, "after", params(3))  # the engine serves on
        after_cancel = [i for i, ids in enumerate(planned_ids(engine)) if "c" in ids]
        assert after_cancel == [0, 1, 2, 3]  # up to the step running when the cancel landed
        stats = engine.statistics().scheduler
        assert stats.num_aborted == 1 and stats.num_finished == 1


async def test_engine_abort_ends_the_stream_with_abort(autojump_clock):
    async with fake_engine() as engine:
        outputs: list[RequestOutput] = []

        async def reader():
            outputs.extend(await collect(engine, "abort me", params(1000), request_id="victim"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(5.5 * STEP)  # mid-step: the abort does not tie with a step's end
            assert engine.abort("victim")
            assert not engine.abort("nobody")
        assert outputs[-1].finish_reason is FinishReason.ABORT
        # Steps 1-5 ended before the abort; step 6, in flight, still delivers.
        assert len(tokens(outputs)) == 6


async def test_deadline_while_running_ends_with_deadline_and_is_counted(autojump_clock):
    async with fake_engine() as engine:
        start = trio.current_time()
        outputs = await collect(engine, "slow", params(1000), timeout=10.5 * STEP)
        assert outputs[-1].finish_reason is FinishReason.DEADLINE
        assert trio.current_time() - start == pytest.approx(10.5 * STEP)
        assert len(tokens(outputs)) == 10  # steps 1-10 ended before the deadline at 10.5
        await trio.sleep(2 * STEP)  # the abort is applied at the next step boundary
        stats = engine.statistics()
        assert stats.scheduler.num_deadline_exceeded == 1
        assert stats.allocator.kv.num_free_blocks == stats.allocator.kv.num_blocks


async def test_a_stream_dropped_unclosed_is_aborted_at_the_next_step(autojump_clock):
    # A web response whose body never started (the client left first)
    # drops its stream this way; no further engine call may ever come.
    async with fake_engine() as engine:
        stream = engine.generate_nowait("orphan", params(1000), request_id="orphan")
        first = await stream.__anext__()
        assert first.new_token_ids
        del stream
        gc.collect()
        await trio.sleep(3 * STEP)
        stats = engine.statistics()
        assert stats.scheduler.num_aborted == 1
        assert stats.allocator.kv.num_free_blocks == stats.allocator.kv.num_blocks


async def test_finished_requests_do_not_pile_up_in_the_deadline_heap(autojump_clock):
    async with fake_engine() as engine:
        for i in range(40):  # one at a time: each finishes long before its deadline
            outputs = await collect(engine, f"quick {i}", params(2), timeout=1000.0)
            assert outputs[-1].finish_reason is FinishReason.LENGTH
        # A finished request's entry is stale; the heap is swept whenever
        # half of it is, so with one request at a time it ends empty.
        assert engine.statistics().scheduler.num_deadlines == 0
        # A deadline still in force works after the rebuilds.
        outputs = await collect(engine, "slow", params(1000), timeout=5.5 * STEP)
        assert outputs[-1].finish_reason is FinishReason.DEADLINE


async def test_deadline_passing_while_waiting_drops_the_request_unscheduled(autojump_clock):
    # One running sequence, one waiting in the core, one in the admission queue.
    async with fake_engine(max_num_seqs=1, max_queued_requests=1) as engine:
        results: dict[str, list[RequestOutput]] = {}

        async def run(name: str, max_tokens: int, deadline: float | None = None) -> None:
            results[name] = await collect(engine, name, params(max_tokens), request_id=name, deadline=deadline)

        async with trio.open_nursery() as nursery:
            deadline = trio.current_time() + 10 * STEP
            for name, max_tokens, deadline in [("long", 50, None), ("in-core", 5, deadline), ("in-queue", 5, deadline)]:
                nursery.start_soon(run, name, max_tokens, deadline)
                await trio.testing.wait_all_tasks_blocked()
            stats = engine.statistics()
            assert stats.num_queued == 1 and stats.scheduler.num_waiting == 1
        assert results["long"][-1].finish_reason is FinishReason.LENGTH
        for name in ("in-core", "in-queue"):
            assert results[name][-1].finish_reason is FinishReason.DEADLINE
            assert tokens(results[name]) == []
            assert not any(name in ids for ids in planned_ids(engine))  # no compute spent
        assert engine.statistics().scheduler.num_deadline_exceeded == 2


async def test_engine_side_deadline_reaches_a_stalled_reader(autojump_clock):
    async with fake_engine(max_buffered_outputs=4) as engine:  # the config's field (the next test overrides it)
        stream = engine.generate_nowait("stalled", params(1000), timeout=20 * STEP)
        await trio.sleep(40 * STEP)  # nobody reads: the request actor's timer is not running
        stats = engine.statistics().scheduler
        assert stats.num_deadline_exceeded == 1 and stats.num_live == 0
        outputs = [out async for out in stream]
        assert outputs[-1].finish_reason is FinishReason.DEADLINE
        # Paused at 4 buffered outputs; the step in flight then added one.
        assert len(tokens(outputs)) == 4 + 1


async def test_a_stalled_reader_is_paused_and_does_not_slow_the_others(autojump_clock):
    async with fake_engine(engine_kw={"max_buffered_outputs": 4}) as engine:
        reference = tokens(await collect(engine, "stall", params(40), request_id="ref"))
        start = trio.current_time()
        stalled = engine.generate_nowait("stall", params(40), request_id="stalled")
        await trio.testing.wait_all_tasks_blocked()  # step 1 runs its prompt alone
        done_at: dict[str, float] = {}

        async def other(name: str) -> None:
            await collect(engine, name, params(30), request_id=name)
            done_at[name] = trio.current_time() - start

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other, "a")
            nursery.start_soon(other, "b")
        # The others, admitted during step 1, took their 30 steps right after
        # it; the stalled one never held them up.
        assert done_at == {"a": pytest.approx(31 * STEP), "b": pytest.approx(31 * STEP)}
        stats = engine.statistics().scheduler
        assert stats.num_paused == 1 and stats.num_preemptions == 1
        steps_with_stalled = sum("stalled" in ids for ids in planned_ids(engine))
        assert steps_with_stalled == 4 + 1  # the buffered outputs' steps, and the one in flight at the pause
        # Reading again resumes it; nothing was lost, and the backlog came coalesced.
        outputs = [out async for out in stalled]
        assert tokens(outputs) == reference
        assert len(outputs) == 1 + (40 - 5)  # the 5 buffered tokens in one delta, then one a step
        assert engine.statistics().scheduler.num_paused == 0


async def test_generate_nowait_refuses_at_once_when_the_queue_is_full(autojump_clock):
    async with fake_engine(max_num_seqs=1, max_queued_requests=2, step_time=0.1) as engine:
        streams = []
        # 1 running + 1 waiting in the core (max_ready) + 2 queued.
        for i in range(4):
            streams.append(engine.generate_nowait(f"p{i}", params(3), request_id=f"r{i}"))
            await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(EngineOverloaded) as refused:
            engine.generate_nowait("one too many", params(3))
        assert refused.value.retry_after == 1.0  # no completion yet to estimate from
        stats = engine.statistics()
        assert stats.num_queued == 2 and stats.num_refused == 1
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(drain_stream, stream)
            await trio.sleep(0.35)  # the first request finished: room again
            late = engine.generate_nowait("late", params(3))
            with pytest.raises(EngineOverloaded) as again:
                engine.generate_nowait("late2", params(3))
            # Now there is a completion rate to estimate from: 1 in the 0.35 s
            # so far, and 2 queued ahead of the refused one's place.
            assert again.value.retry_after == pytest.approx((2 + 1) * 0.35)
            nursery.start_soon(drain_stream, late)


async def test_generate_waits_for_room_instead(autojump_clock):
    async with fake_engine(max_num_seqs=1, max_queued_requests=1, step_time=0.1) as engine:
        finished_at: dict[int, float] = {}

        async def run(i: int) -> None:
            await collect(engine, f"w{i}", params(2), request_id=f"w{i}")
            finished_at[i] = trio.current_time()

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(run, i)
                await trio.testing.wait_all_tasks_blocked()
            stats = engine.statistics()
            assert stats.num_queued == 1 and stats.num_waiting_to_queue == 2
        assert sorted(finished_at, key=finished_at.get) == [0, 1, 2, 3, 4]  # first come, first served


async def test_token_bound_limits_admission(autojump_clock):
    async with fake_engine(max_num_seqs=1, max_queued_requests=10, max_queued_tokens=12, step_time=0.1) as engine:
        prompt = list(range(100, 106))  # 6 tokens
        streams = [engine.generate_nowait(prompt, params(3)) for _ in range(2)]  # running + core waiting
        await trio.testing.wait_all_tasks_blocked()
        streams += [engine.generate_nowait(prompt, params(3)) for _ in range(2)]  # 12 queued tokens
        with pytest.raises(EngineOverloaded):
            engine.generate_nowait(prompt, params(3))
        assert engine.statistics().num_queued_tokens == 12
        # A prompt larger than the bound still gets in once the queue is empty.
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(drain_stream, stream)
            big = await collect(engine, list(range(100, 130)), params(2))
        assert big[-1].finish_reason is FinishReason.LENGTH


async def test_higher_priority_arrival_preempts_when_kv_runs_out(autojump_clock):
    # 8 blocks of 16 tokens; each request grows from 3 blocks to 4.
    async with fake_engine(num_blocks=8, max_num_seqs=4) as engine:
        finished: list[str] = []

        async def run(name: str, priority: int, base: int) -> None:
            # Distinct prompts of 40 tokens: no prefix-cache hits.
            await collect(engine, list(range(base, base + 40)), params(24), request_id=name, priority=priority)
            finished.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "low1", 5, 1000)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(run, "low2", 5, 2000)
            await trio.sleep(3 * STEP)
            nursery.start_soon(run, "high", 0, 3000)
        # "high" ran from the first step after it arrived, preempting the
        # latest low-priority arrival, and finished before it.
        first_high = next(i for i, ids in enumerate(planned_ids(engine)) if "high" in ids)
        assert "low2" in planned_ids(engine)[first_high - 1] and "low2" not in planned_ids(engine)[first_high]
        assert finished.index("high") < finished.index("low2")
        stats = engine.statistics().scheduler
        assert stats.num_preemptions == 1 and stats.num_finished == 3


async def test_injected_step_failure_fails_only_that_steps_requests(autojump_clock):
    def fail(index, plan):
        if any(c.request_id == "bad" for c in plan.chunks) and plan.chunks[0].start > 0:
            return RuntimeError("injected fault")
        return None

    async with fake_engine(fail=fail) as engine:
        with pytest.raises(RequestFailed, match="injected fault") as failed:
            await collect(engine, "bad request", params(10), request_id="bad")
        assert failed.value.request_id == "bad"
        good = await collect(engine, "good request", params(4), request_id="good")
        assert good[-1].finish_reason is FinishReason.LENGTH
        stats = engine.statistics()
        assert stats.scheduler.num_failed == 1 and stats.executor.num_failed_steps == 1


async def test_drain_finishes_short_requests_and_aborts_the_rest(autojump_clock):
    async with fake_engine() as engine:
        results: dict[str, list[RequestOutput]] = {}

        async def run(name: str, max_tokens: int) -> None:
            results[name] = await collect(engine, name, params(max_tokens), request_id=name)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(run, f"short{i}", 5)
                nursery.start_soon(run, f"long{i}", 1000)
            await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
            assert await engine.drain(0.5) == 3
            assert trio.current_time() - start == pytest.approx(0.5)
            with pytest.raises(EngineClosed):
                await collect(engine, "too late")
        for i in range(3):
            assert results[f"short{i}"][-1].finish_reason is FinishReason.LENGTH
            assert results[f"long{i}"][-1].finish_reason is FinishReason.ABORT


async def test_admission_overlaps_the_running_step(autojump_clock):
    async with fake_engine(step_time=1.0) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, engine, "first", params(3))
            await trio.sleep(0.5)  # step 1 is running
            assert engine.statistics().executor.step_in_flight
            nursery.start_soon(collect, engine, "second", params(3))
            await trio.testing.wait_all_tasks_blocked()
            # Admitted into the core (tokenized, validated, queued by
            # priority) while the step still runs.
            assert engine.statistics().executor.step_in_flight
            assert engine.core.scheduler.num_waiting == 1


class _CrashingExecutor(FakeExecutor):
    async def _step(self, message):
        if message.step_id == 3:
            raise RuntimeError("the executor actor itself crashed")
        return await super()._step(message)


async def test_an_actor_crash_tears_the_engine_down_through_the_nursery(autojump_clock):
    readers_ended = 0
    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="crashed")):
        async with open_engine(
            engine_config(),
            loaded=tiny_loaded(),
            executor=lambda core: _CrashingExecutor.for_core(core, step_time=STEP),
        ) as engine:
            async with trio.open_nursery() as nursery:
                for i in range(3):

                    async def reader(i=i):
                        nonlocal readers_ended
                        try:
                            await collect(engine, f"c{i}", params(100))
                        finally:
                            readers_ended += 1

                    nursery.start_soon(reader)
    assert readers_ended == 3
    with pytest.raises(EngineClosed):
        await collect(engine, "after")


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_a_stalled_reader_of_n_completions_never_overflows_its_channel(autojump_clock, n):
    # The Paused marker can go out mid-step, with up to n - 1 of that step's
    # outputs still to deliver, then the step in flight and the finals.
    for max_buffered in range(1, 8):
        async with fake_engine(engine_kw={"max_buffered_outputs": max_buffered}) as engine:
            stalled = engine.generate_nowait("stall here", params(100, n=n), request_id="s")
            timed = engine.generate_nowait("stall too", params(100, n=n), timeout=15 * STEP)
            await trio.sleep(20 * STEP)
            assert engine.statistics().scheduler.num_paused == n  # sequences: every completion of "s"
            assert engine.abort("s")
            await trio.sleep(5 * STEP)
            aborted = [out async for out in stalled]
            assert {o.index for o in aborted if o.finish_reason is FinishReason.ABORT} == set(range(n))
            expired = [out async for out in timed]
            assert {o.index for o in expired if o.finish_reason is FinishReason.DEADLINE} == set(range(n))


async def test_open_engine_options_override_the_config_and_are_checked_by_name(autojump_clock):
    config = engine_config(max_buffered_outputs=8, shutdown_timeout=60.0)
    with pytest.raises(ValueError, match="^max_buffered_outputs must be an integer >= 1, got 0$"):
        async with open_engine(config, loaded=tiny_loaded(), max_buffered_outputs=0):
            pass
    with pytest.raises(ValueError, match="^shutdown_timeout must be > 0, got -1$"):
        async with open_engine(config, loaded=tiny_loaded(), shutdown_timeout=-1):
            pass

    def make(core):
        return FakeExecutor.for_core(core, step_time=STEP)

    async with open_engine(config, loaded=tiny_loaded(), executor=make, max_buffered_outputs=2) as engine:
        assert (engine.config.max_buffered_outputs, engine.config.shutdown_timeout) == (2, 60.0)


async def test_an_id_stays_reserved_after_a_caller_side_deadline_until_the_engine_lets_go(autojump_clock):
    # n=2: completion 0 finishes a step before completion 1. The reader's
    # deadline passes first; by the time it closes, completion 0's final is
    # buffered but the engine still holds completion 1.
    async with fake_engine(step_time=1.0) as engine:

        async def keep_busy() -> None:
            await collect(engine, "keep busy", params(12))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_busy)
            start = trio.current_time()
            async for out in engine.generate("x", params(3, n=2), request_id="x", deadline=start + 2.5):
                if out.finish_reason is not None:
                    assert out.finish_reason is FinishReason.DEADLINE
                    await trio.sleep_until(start + 3.5)
            with pytest.raises(DuplicateRequestError):
                engine.generate_nowait("y", request_id="x")
        await collect(engine, "y", request_id="x")  # free again once the engine let go


async def test_streams_still_queued_when_an_actor_crashes_raise_engine_closed(autojump_clock):
    streams = []
    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="crashed")):
        async with open_engine(
            engine_config(max_num_seqs=1),
            loaded=tiny_loaded(),
            executor=lambda core: _CrashingExecutor.for_core(core, step_time=STEP),
        ) as engine:
            # One running, one waiting in the core, the rest in the admission queue.
            streams = [engine.generate_nowait(f"q{i}", params(100)) for i in range(4)]
            await trio.testing.wait_all_tasks_blocked()
            assert engine.statistics().num_queued == 2
            await trio.sleep_forever()
    for stream in streams:
        with trio.fail_after(1), pytest.raises(EngineClosed):
            async with stream:
                [out async for out in stream]
