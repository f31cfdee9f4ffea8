"""SLO admission at the door (actors/slo_admission.py), on the autojump
clock with the fake executor: steps cost 10 ms plus 1 ms a token, the
latency model learns that from the engine's own steps, and a request that
cannot meet its TTFT target is refused at once, before any compute."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

import actor_fixtures
from hypothesis import given, settings
from hypothesis import strategies as st
from trioserve.actors.admission import AdmissionQueue
from trioserve.actors.messages import AddRequest
from trioserve.actors.router import ReplicaRouter
from trioserve.actors.slo_admission import SloPrediction, SloRefused, admission_order, decide
from trioserve.engine.core.latency_model import LatencyModel, StepShape
from trioserve.engine.core.new_request import NewRequest
from trioserve.engine.latency_objectives import LatencyObjectives
from trioserve.engine.core.sequence import FinishReason
from trioserve.engine.sampling.sampling_params import SamplingParams


def params(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def slo_engine(policy: str = "slo"):
    return actor_fixtures.fake_engine(step_time=0.01, token_time=0.001, scheduling_policy=policy)


PROMPT = [5 + i for i in range(200)]  # 200 tokens: a step of 0.21 s alone


async def _learn(engine) -> None:
    """A few requests, so the latency model has seen prefill and decode steps."""
    for i in range(4):
        pair = [engine.generate_nowait(PROMPT[: 30 + 40 * i + 10 * j], params(3 + 2 * j)) for j in range(2)]
        for stream in pair:
            [out async for out in stream]


def _exact_law(step_time: float, token_time: float = 0.001) -> LatencyModel:
    """A latency model that has learned the fake executor's law exactly."""
    exact = LatencyModel(forgetting=1.0)
    for prefill, decodes in [(1, 0), (8, 1), (32, 2), (64, 0), (2, 3), (16, 1), (48, 4), (200, 0), (0, 6)] * 40:
        exact.observe(StepShape(prefill, 0, decodes, 0), step_time + token_time * (prefill + decodes))
    return exact


async def _judge_now(engine, before) -> tuple[float | None, float]:
    """A 20-token request with a TTFT target, sent now, read to its end
    (then ``before``, a stream sent earlier): its measured first-token
    time and the door's prediction of it."""
    start = trio.current_time()
    stream = engine.generate_nowait([t + 4000 for t in PROMPT[:20]], params(2), objectives=LatencyObjectives(ttft=100.0))
    first = await _first_token_after(stream, start)
    [out async for out in before]
    return first, stream.slo.prediction.ttft


async def _first_token_after(stream, start: float) -> float | None:
    """Read ``stream`` to its end; its first token's time after ``start``."""
    first = None
    async for out in stream:
        if first is None and out.new_token_ids:
            first = trio.current_time() - start
    return first


async def test_a_request_that_cannot_meet_its_ttft_is_refused_at_once(autojump_clock):
    async with slo_engine() as engine:
        await _learn(engine)
        # ~1.3 s of prefill queued ahead, at a higher priority.
        streams = [engine.generate_nowait([t + 300 * (i + 1) for t in PROMPT], params(), priority=-1) for i in range(6)]
        before = trio.current_time()
        with pytest.raises(SloRefused) as refused:
            engine.generate_nowait(PROMPT[:20], params(), request_id="late", objectives=LatencyObjectives(ttft=0.3))
        assert trio.current_time() == before
        error = refused.value
        assert error.objective == "ttft_ms" and error.reason == "ttft"
        assert error.predicted > 0.6 and error.target == 0.3
        assert "ttft_ms 300" in str(error) and error.retry_after >= 1
        # Best effort is admitted, with its prediction.
        admitted = engine.generate_nowait(
            PROMPT[:20], params(), request_id="fine", objectives=LatencyObjectives(ttft=0.3, best_effort=True)
        )
        assert admitted.slo.prediction.ttft > 0.6
        # A loose target is admitted too.
        loose = engine.generate_nowait(PROMPT[:20], params(), objectives=LatencyObjectives(ttft=30.0))
        assert loose.slo is not None
        for stream in [*streams, admitted, loose]:
            [out async for out in stream]
        assert not any("late" in {c.request_id for c in plan.chunks} for plan in engine.fake.plans)
        assert engine.statistics().num_refused == 1


async def test_the_prediction_tracks_the_measured_ttft(autojump_clock):
    async with slo_engine() as engine:
        await _learn(engine)
        # Distinct prompts: no prefix cache hits between them.
        streams = [engine.generate_nowait([t + 300 * (i + 1) for t in PROMPT], params(2), priority=-1) for i in range(3)]
        start = trio.current_time()
        stream = engine.generate_nowait([t + 2000 for t in PROMPT[:40]], params(2), objectives=LatencyObjectives(ttft=100.0))
        first = await _first_token_after(stream, start)
        for other in streams:
            [out async for out in other]
        # After 20 steps of training the fit is rough; it improves with every step.
        assert stream.slo.prediction.ttft == pytest.approx(first, rel=0.5)


async def test_without_the_slo_policy_targets_are_carried_not_judged(autojump_clock):
    async with slo_engine("priority") as engine:
        streams = [engine.generate_nowait(PROMPT, params()) for _ in range(6)]
        stream = engine.generate_nowait(PROMPT[:20], params(), objectives=LatencyObjectives(ttft=0.001))
        assert stream.slo is None
        for s in [*streams, stream]:
            [out async for out in s]


def test_a_tpot_refusal_may_be_admitted_shorter():
    prediction = SloPrediction(ttft=0.1, tpot=0.2)
    with pytest.raises(SloRefused, match="tpot_ms 100"):
        decide(LatencyObjectives(tpot=0.1), prediction, max_tokens=200)
    shorter = decide(LatencyObjectives(tpot=0.1, allow_shorter=True), prediction, max_tokens=200)
    assert shorter.max_tokens is not None and 16 <= shorter.max_tokens < 200
    # Degraded: the refusal says so (the web layer answers 503).
    with pytest.raises(SloRefused) as refused:
        decide(LatencyObjectives(ttft=0.01), prediction, max_tokens=None, degraded=True)
    assert refused.value.degraded


def test_the_router_sends_a_judged_request_to_the_soonest_replica():
    router = ReplicaRouter(num_replicas=3, block_size=16, max_model_len=256)
    prompt = list(range(5, 60))
    first, hashes = router.choose(prompt, [0.0, 0.0, 0.0])
    router.record("a", first, hashes, 100)
    # Without predictions, the prefix's holder; with them, the soonest.
    assert router.choose(prompt, [0.0, 0.0, 0.0])[0] == first
    soonest = (first + 1) % 3
    predicted = [5.0, 5.0, 5.0]
    predicted[soonest] = 0.5
    assert router.choose(prompt, [0.0, 0.0, 0.0], predicted)[0] == soonest
    assert router.statistics().num_by_slo == 1


async def test_replicas_are_judged_each_by_its_own_load(autojump_clock):
    async with actor_fixtures.fake_engine(
        step_time=0.01, token_time=0.001, scheduling_policy="slo", data_parallel_size=2
    ) as engine:
        # Requests sharing a prefix go to one replica by affinity: it is busy.
        streams = [engine.generate_nowait([*PROMPT, 7000 + i], params(), priority=-1) for i in range(4)]
        busy = engine.router.replica_of(streams[0].request_id)
        assert all(engine.router.replica_of(s.request_id) == busy for s in streams)
        # Affinity would send this one there too; its predictions send it to the idle one.
        judged = engine.generate_nowait([*PROMPT[:100], 9000], params(), objectives=LatencyObjectives(ttft=30.0))
        assert len(judged.slo.replica_ttfts) == 2
        assert judged.slo.replica_ttfts[busy] > judged.slo.replica_ttfts[1 - busy]
        assert engine.router.replica_of(judged.request_id) == 1 - busy
        assert engine.router.statistics().num_by_slo == 1
        for stream in [*streams, judged]:
            [out async for out in stream]


async def test_a_request_refused_for_tpot_may_run_shorter(autojump_clock):
    async with slo_engine() as engine:
        await _learn(engine)
        tight = LatencyObjectives(tpot=0.002)
        with pytest.raises(SloRefused, match="tpot_ms 2"):
            engine.generate_nowait(PROMPT[:20], params(400), objectives=tight)
        stream = engine.generate_nowait(PROMPT[:20], params(400), objectives=attrs.evolve(tight, allow_shorter=True))
        lowered = stream.slo.max_tokens
        assert lowered is not None and 16 <= lowered < 400
        outputs = [out async for out in stream]
        assert outputs[-1].num_output_tokens == lowered
        assert outputs[-1].finish_reason is FinishReason.LENGTH


async def test_a_cached_prefix_is_predicted_at_its_cost(autojump_clock):
    async with slo_engine() as engine:
        await _learn(engine)
        long = [t + 5000 for t in PROMPT]
        [out async for out in engine.generate_nowait(long, params(2))]  # its blocks stay in the prefix cache
        target = LatencyObjectives(ttft=100.0)
        predicted = {}
        # One at a time, each judged on an idle engine.
        for name, prompt, p in [
            ("cached", [*long, 1], params(2)),
            ("fresh", [t + 7000 for t in [*PROMPT, 1]], params(2)),
            # Prompt logprobs compute the whole prompt: no hit is counted for them.
            ("logprobs", [*long, 2], attrs.evolve(params(2), prompt_logprobs=1)),
        ]:
            stream = engine.generate_nowait(prompt, p, objectives=target)
            predicted[name] = stream.slo.prediction.ttft
            [out async for out in stream]
        assert predicted["cached"] < 0.5 * predicted["fresh"]
        assert predicted["logprobs"] > 2 * predicted["cached"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from([None, 0.5, 1.0, 20.0]), st.floats(0.0, 10.0)), max_size=12))
def test_the_admission_queue_hands_over_by_class_then_deadline(specs):
    queue = AdmissionQueue(64)
    queue.order = admission_order
    for i, (priority, ttft, arrival) in enumerate(specs):
        send, _ = trio.open_memory_channel(1)
        new = NewRequest(f"r{i}", (1, 2), SamplingParams(), priority, objectives=LatencyObjectives(ttft=ttft))
        queue.send_nowait(AddRequest(new, deadline=None, arrival_time=arrival, outputs=send))
    taken = [queue.receive_nowait() for _ in specs]
    keys = [admission_order(m) for m in taken]
    assert keys == sorted(keys)
    for a, b in zip(taken, taken[1:]):
        if admission_order(a) == admission_order(b):  # equals: first come, first served
            assert int(a.request_id[1:]) < int(b.request_id[1:])


async def test_the_slo_policy_orders_its_admission_queue(autojump_clock):
    async with slo_engine() as slo, slo_engine("priority") as fcfs:
        assert slo._scheduler.admission.order is admission_order
        assert fcfs._scheduler.admission.order is None



async def test_a_request_judged_during_a_step_waits_for_its_end(autojump_clock):
    """A request arriving 0.1 s into a 0.21 s prefill step starts after it,
    on the state it leaves: the door adds what is left of that step
    (``SchedulerActor.step_in_flight``) and counts its prompt as computed,
    not to compute again. With the fake executor's law learned exactly,
    the prediction is the measured TTFT."""
    exact = _exact_law(step_time=0.01)
    async with slo_engine() as engine:
        engine.latency_models()[0].adopt(exact)
        long = engine.generate_nowait([t + 3000 for t in PROMPT], params(2), priority=-1)
        await trio.testing.wait_all_tasks_blocked()  # its prefill step is running
        await trio.sleep(0.1)  # virtual time: into the step
        first, predicted = await _judge_now(engine, long)
        # 0.11 s left of the long prompt's step, then its own with the long one's decode.
        assert first == pytest.approx(0.11 + 0.031)
        assert predicted == pytest.approx(first, rel=0.05)


async def test_a_slot_freed_by_the_step_in_flight_is_predicted_free(autojump_clock):
    """The only slot's request is in the step that samples its last
    token when a request arrives: it takes the slot right after that step,
    and the door predicts so, not one more step of the leaving request
    (a third of the interactive requests' error at 10 req/s on the bench's
    mix, where every slot was busy)."""
    exact = _exact_law(step_time=0.01)
    async with actor_fixtures.fake_engine(
        step_time=0.01, token_time=0.001, scheduling_policy="slo", max_num_seqs=1
    ) as engine:
        engine.latency_models()[0].adopt(exact)
        leaving = engine.generate_nowait([t + 3000 for t in PROMPT], params(2))
        async for out in leaving:
            if out.new_token_ids:
                break  # its prompt's step is done: its last token's step is next
        await trio.testing.wait_all_tasks_blocked()  # that step is running
        await trio.sleep(0.005)  # virtual time: into it
        first, predicted = await _judge_now(engine, leaving)
        # 6 ms left of the decode step, then its own prompt's step alone.
        assert first == pytest.approx(0.006 + 0.030)
        assert predicted == pytest.approx(first, rel=0.05)


async def test_a_request_judged_while_a_step_is_planned_waits_for_that_step(autojump_clock):
    """A step is planned (the pool's answer awaited) when a request of a
    better class arrives: the step is fixed without it and its prompt runs
    in the next, after the one planned. The door predicts so, with the
    prompt that step admits running, not waiting behind it."""
    exact = _exact_law(step_time=0.1)
    async with actor_fixtures.fake_engine(step_time=0.1, token_time=0.001, scheduling_policy="slo") as engine:
        engine.latency_models()[0].adopt(exact)
        scheduler = engine._scheduler
        planned = engine.generate_nowait([t + 3000 for t in PROMPT], params(3), priority=1)
        for _ in range(1000):
            await trio.lowlevel.checkpoint()
            if scheduler._proposed is not None:
                break
        assert scheduler._proposed is not None, "never caught a step being planned"
        first, predicted = await _judge_now(engine, planned)
        # The planned prompt's step, then its own with that one's decode.
        assert first == pytest.approx(0.3 + 0.121)
        assert predicted == pytest.approx(first, rel=0.05)
