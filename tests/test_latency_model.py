"""The online latency model (engine/core/latency_model.py): it learns a
step-cost law from noisy steps, and its TTFT / TPOT predictions follow."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.engine.core.latency_model import LatencyModel, StepShape
from trioserve.engine.runtime.step_plan import ScheduledChunk, StepPlan
from trioserve.engine.sampling.rows import SamplingRow
from trioserve.engine.sampling.sampling_params import SamplingParams


def _true_seconds(law: tuple[float, ...], shape: StepShape) -> float:
    base, per_prefill, per_pair, per_decode, per_context = law
    return (
        base
        + per_prefill * shape.prefill_tokens
        + per_pair * shape.prefill_pairs
        + per_decode * shape.decodes
        + per_context * shape.decode_context
    )


def _random_shape(rng: random.Random) -> StepShape:
    prefill = rng.choice([0, 0, rng.randint(1, 2048)])
    start = rng.randint(0, 1024)
    decodes = rng.randint(0 if prefill else 1, 32)
    return StepShape(prefill, prefill * (start + prefill // 2), decodes, decodes * rng.randint(1, 1024))


laws = st.tuples(
    st.floats(1e-3, 2e-2),  # per step
    st.floats(1e-6, 2e-4),  # per prefill token
    st.floats(0.0, 1e-8),  # per attention pair
    st.floats(1e-4, 5e-3),  # per decoding sequence
    st.floats(0.0, 1e-6),  # per context token
)


@settings(max_examples=25, deadline=None)
@given(law=laws, seed=st.integers(0, 2**16), noise=st.floats(0.0, 0.05))
def test_the_fit_converges_on_any_linear_law_with_noise(law, seed, noise):
    """After 300 steps of any linear cost law with up to 5% noise, the
    prediction of fresh steps is within 15% at p90."""
    rng = random.Random(seed)
    model = LatencyModel()
    for _ in range(300):
        shape = _random_shape(rng)
        model.observe(shape, _true_seconds(law, shape) * (1 + rng.uniform(-noise, noise)))
    errors = sorted(
        abs(model.step_seconds(shape) - _true_seconds(law, shape)) / _true_seconds(law, shape)
        for shape in (_random_shape(rng) for _ in range(200))
    )
    assert errors[int(0.9 * len(errors))] < 0.15
    assert model.statistics().num_steps == 300


def test_it_follows_a_machine_that_slows_down():
    rng = random.Random(1)
    law = (0.005, 5e-5, 0.0, 1e-3, 0.0)
    model = LatencyModel()
    for factor in (1.0, 2.0):
        for _ in range(600):
            shape = _random_shape(rng)
            model.observe(shape, factor * _true_seconds(law, shape))
    shape = StepShape(512, 512 * 256, 8, 8 * 100)
    assert model.step_seconds(shape) == pytest.approx(2 * _true_seconds(law, shape), rel=0.1)
    assert model.statistics().step_error_p50 < 0.05


def test_ttft_grows_with_the_queue_ahead_and_tpot_with_the_batch():
    model = LatencyModel(prior=(0.005, 0.005, 0.0, 0.001, 0.0))
    alone = model.predict_ttft(100)
    behind = model.predict_ttft(100, ahead=[(2000, 16), (2000, 16)], token_budget=512)
    assert alone == pytest.approx(0.005 + 0.1 * 0.05 / 1000 * 1000, rel=1e-6)
    # 4100 tokens in steps of 512 at most: at least 9 steps.
    assert behind > 9 * 0.005 + 4100 * 0.05e-3
    assert model.predict_ttft(100, cached_tokens=90) < alone
    # A full batch: it waits for the shortest running answer to end.
    full = model.predict_ttft(100, running=[(50, 0, 40), (50, 0, 400)], max_num_seqs=2)
    assert full > 40 * model.predict_tpot(2, 100) and full < 60 * model.predict_tpot(2, 200)
    assert model.predict_tpot(32, 32 * 100) > model.predict_tpot(1, 100)


def test_a_plan_is_read_as_prefill_and_decodes():
    row = SamplingRow("b", SamplingParams(), (), num_output_tokens=3)
    plan = StepPlan(
        chunks=(
            ScheduledChunk("a", start=10, token_ids=(1, 2, 3, 4), block_ids=(0,)),
            ScheduledChunk("b", start=20, token_ids=(5,), block_ids=(1,), sampling=row),
        )
    )
    assert StepShape.of_plan(plan) == StepShape(prefill_tokens=4, prefill_pairs=4 * (10 + 2), decodes=1, decode_context=21)


def test_a_saved_profile_seeds_the_prior():
    trained = LatencyModel()
    rng = random.Random(2)
    law = (0.01, 1e-4, 0.0, 2e-3, 0.0)
    for _ in range(200):
        shape = _random_shape(rng)
        trained.observe(shape, _true_seconds(law, shape))
    seeded = LatencyModel.from_profile(trained.to_profile())
    shape = StepShape(256, 256 * 128, 4, 400)
    assert seeded.step_seconds(shape) == pytest.approx(trained.step_seconds(shape))
    with pytest.raises(ValueError, match="coefficients"):
        LatencyModel.from_profile({**trained.to_profile(), "coefficients": [1.0]})


loads = st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 300), st.integers(1, 64)), max_size=12)
queues = st.lists(st.tuples(st.integers(1, 600), st.integers(1, 64)), max_size=12)
streams = st.lists(st.tuples(st.floats(0.0, 50.0), st.integers(1, 600), st.integers(1, 64)), max_size=3)


@settings(max_examples=40, deadline=None)
@given(
    running=loads,
    ahead=queues,
    behind=queues,
    arrivals=streams,
    horizon=st.floats(0.0, 100.0),
    prompt=st.integers(1, 600),
    seqs=st.integers(1, 8),
)
def test_the_ttft_parts_add_up_and_arrivals_only_delay_it(running, ahead, behind, arrivals, horizon, prompt, seqs):
    """The TTFT is the wait before its prompt's first step plus its own
    steps; requests of a higher class arriving while it waits, or prompts
    waiting behind it, never make it sooner, and those behind never hold
    up the steps before its own."""
    model = LatencyModel(prior=(0.005, 0.005, 0.0, 0.001, 0.0))
    kwargs = dict(ahead=ahead, running=running, token_budget=512, max_num_seqs=seqs)
    parts = model.predict_ttft_parts(prompt, arrivals=arrivals, arrivals_for=horizon, **kwargs)
    assert parts.before >= 0 and parts.own > 0
    assert parts.total == pytest.approx(model.predict_ttft(prompt, arrivals=arrivals, arrivals_for=horizon, **kwargs))
    without = model.predict_ttft_parts(prompt, **kwargs)
    assert parts.total >= without.total - 1e-12
    shared = model.predict_ttft_parts(prompt, behind=behind, **kwargs)
    assert shared.total >= without.total - 1e-12 and shared.before == pytest.approx(without.before)


def test_arrivals_of_a_higher_class_are_queued_ahead_while_it_waits():
    """A full batch of two for 40 decode steps of 7 ms: 10 arrivals a
    second, each 100 tokens and 20 out, come ahead of it while it waits;
    with a free slot they never do."""
    model = LatencyModel(prior=(0.005, 0.005, 0.0, 0.001, 0.0))  # a decode step of two: 7 ms
    full = dict(running=[(50, 0, 40), (50, 0, 40)], max_num_seqs=2)
    alone = model.predict_ttft_parts(100, **full)
    passed = model.predict_ttft_parts(100, arrivals=[(10.0, 100, 20)], **full)
    # In the 0.28 s before the slots free, two arrive: they take both, and
    # it waits for one of them to end (20 decode steps).
    assert passed.total > alone.total + 20 * model.predict_tpot(2, 200)
    # Arrivals expected for 0.1 s only: one of them, which shares its step.
    brief = model.predict_ttft_parts(100, arrivals=[(10.0, 100, 20)], arrivals_for=0.1, **full)
    assert alone.total < brief.total < passed.total
    free = dict(running=[(50, 0, 40)], max_num_seqs=2)
    assert model.predict_ttft(100, arrivals=[(10.0, 100, 20)], **free) == model.predict_ttft(100, **free)


def test_prompts_behind_it_share_its_step_only_as_far_as_the_budget_and_slots_go():
    """An interactive prompt of 32 tokens with a batch prompt of 128 waiting
    behind it: the scheduler fills the step's budget with both, so its
    first token waits for 160 tokens' step; a budget of its own tokens, or
    no slot left, keeps the batch prompt out of its step."""
    model = LatencyModel(prior=(0.005, 0.005, 0.0, 0.001, 0.0))  # 50 us a prefill token
    alone = model.predict_ttft(32)
    shared = model.predict_ttft(32, behind=[(128, 16)])
    assert shared == pytest.approx(0.005 + 160 * 0.05e-3) and alone == pytest.approx(0.005 + 32 * 0.05e-3)
    assert model.predict_ttft(32, behind=[(128, 16)], token_budget=32) == pytest.approx(alone)
    assert model.predict_ttft(32, behind=[(128, 16)], max_num_seqs=1) == pytest.approx(alone)
    # Arrivals of a higher class still go ahead of it, not behind the batch.
    full = dict(running=[(50, 0, 40), (50, 0, 40)], max_num_seqs=2)
    assert model.predict_ttft(100, arrivals=[(10.0, 100, 20)], behind=[(128, 16)], **full) == pytest.approx(
        model.predict_ttft(100, arrivals=[(10.0, 100, 20)], **full)
    )


def test_arrivals_that_fill_the_engine_are_bounded():
    """Classes ahead arriving faster than the engine serves them: the
    prediction is long, and finite."""
    model = LatencyModel(prior=(0.005, 0.005, 0.0, 0.001, 0.0))
    ttft = model.predict_ttft(100, running=[(50, 0, 40)], arrivals=[(1000.0, 500, 100)], max_num_seqs=1)
    assert 1.0 < ttft < float("inf")


def test_a_step_in_flight_is_expected_to_end_as_recent_steps_did():
    """Steps of one shape that took 1 s or 3 s: one that has run 1.5 s is
    a long one, 1.5 s from its end (not the prediction's rest: the fit on
    relative errors predicts about 1.3 s); one past every recent end has
    nothing left."""
    model = LatencyModel(forgetting=1.0)
    shape = StepShape(decodes=4, decode_context=100)
    for i in range(600):
        model.observe(shape, 1.0 if i % 2 else 3.0)
    assert 1.0 < model.step_seconds(shape) < 1.5
    assert model.seconds_left(shape, 0.0) == pytest.approx(2.0, rel=0.01)
    assert model.seconds_left(shape, 1.5) == pytest.approx(1.5, rel=0.02)
    assert model.seconds_left(shape, 2.5) == pytest.approx(0.5, abs=0.05)
    assert model.seconds_left(shape, 3.5) == 0.0


@given(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=50), st.floats(0.0, 2.0), st.floats(0.0, 2.0))
def test_a_step_that_has_run_longer_is_expected_to_end_no_sooner(durations, elapsed, later):
    """What is left is never negative, and the expected end (``elapsed``
    plus what is left) never moves earlier as the step runs on."""
    model = LatencyModel()
    shape = StepShape(prefill_tokens=64)
    for seconds in durations:
        model.observe(shape, seconds)
    early, late = sorted((elapsed, later))
    assert model.seconds_left(shape, early) >= 0.0
    assert early + model.seconds_left(shape, early) <= late + model.seconds_left(shape, late) + 1e-9


def test_one_stalled_step_does_not_stretch_every_later_overrun():
    """A step that once took fifty times its prediction counts as the
    slowest of the rest: a step a fifth past its prediction is expected to
    end as the slower steps did, not fifty times later."""
    model = LatencyModel(forgetting=1.0)
    shape = StepShape(decodes=4, decode_context=100)
    rng = random.Random(3)
    for _ in range(255):
        model.observe(shape, rng.uniform(0.9, 1.3))
    model.observe(shape, 55.0)
    predicted = model.step_seconds(shape)
    assert model.seconds_left(shape, 1.2 * predicted) < 0.2 * predicted
