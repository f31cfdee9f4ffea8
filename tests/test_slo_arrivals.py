"""The door's recent arrivals (actors/slo_arrivals.py): the rates of the
classes that will pass a waiting request."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.actors.slo_admission import arrivals_horizon
from trioserve.actors.slo_arrivals import MIN_ARRIVALS, RecentArrivals
from trioserve.engine.core.latency_model import LatencyModel
from trioserve.engine.latency_objectives import LatencyObjectives

arrivals = st.lists(
    st.tuples(st.floats(0.0, 10.0), st.integers(-2, 2), st.integers(1, 500), st.integers(1, 100)), max_size=80
)


@settings(max_examples=50, deadline=None)
@given(arrivals=arrivals, priority=st.integers(-2, 3), size=st.integers(1, 64))
def test_only_classes_that_outrank_it_at_their_recent_rate(arrivals, priority, size):
    recent = RecentArrivals(size, window=20.0)
    times = sorted(t for t, *_ in arrivals)
    for time, (_, p, prefill, output) in zip(times, arrivals):
        recent.record(time, p, prefill, output)
    now = 11.0
    kept = [(time, a) for time, a in zip(times, arrivals)][-size:]
    streams = recent.ahead_of(priority, now)
    expected = {}
    for _, (_, p, prefill, output) in kept:
        if p < priority:
            expected.setdefault(p, []).append((prefill, output))
    expected = {p: a for p, a in expected.items() if len(a) >= MIN_ARRIVALS}
    assert len(streams) == len(expected)
    span = now - kept[0][0] if kept else None
    for rate, prefill, output in streams:
        matches = [a for a in expected.values() if rate == pytest.approx(len(a) / span)]
        assert matches
        assert any(min(p for p, _ in a) <= prefill <= max(p for p, _ in a) for a in matches)
        assert any(min(o for _, o in a) <= output <= max(o for _, o in a) for a in matches)


def test_the_rate_falls_once_arrivals_stop():
    recent = RecentArrivals(8)
    for i in range(8):
        recent.record(i * 0.1, 0, 32, 16)
    (rate, prefill, output), = recent.ahead_of(1, 0.8)
    assert rate == pytest.approx(10.0) and (prefill, output) == (32, 16)
    assert recent.horizon(0.8) == pytest.approx(0.8)
    (later, _, _), = recent.ahead_of(1, 8.0)
    assert later == pytest.approx(1.0)
    # Past the window they are forgotten.
    assert recent.ahead_of(1, 10.65) == [] and recent.horizon(10.65) == pytest.approx(10.65)
    assert recent.horizon(11.0) == 0.0
    assert RecentArrivals().horizon(3.0) == 0.0
    assert recent.ahead_of(0, 8.0) == []  # the same class does not pass it
    with pytest.raises(ValueError, match="size"):
        RecentArrivals(0)
    with pytest.raises(ValueError, match="window"):
        RecentArrivals(window=0.0)


def test_the_horizon_is_the_runs_length_not_the_kept_arrivals_span():
    recent = RecentArrivals(8, window=10.0)
    for i in range(200):  # 20 a second for 10 s, 8 kept
        recent.record(i * 0.05, 0, 32, 16)
    (rate, _, _), = recent.ahead_of(1, 10.0)
    assert rate == pytest.approx(8 / 0.4)
    assert recent.horizon(10.0) == pytest.approx(10.0)
    # A gap of a window ends the run: the next one starts its own.
    recent.record(25.0, 0, 32, 16)
    assert recent.horizon(26.0) == pytest.approx(1.0)


def test_a_steady_stream_s_rate_is_read_within_a_sixth_at_p10_and_p90():
    # Poisson arrivals at 15 a second, half of them of the class that passes
    # a batch request: the rate the door reads at each batch arrival. A
    # batch request's wait for that class scales with it.
    rng = random.Random(0)
    recent = RecentArrivals()
    now, reads = 0.0, []
    for _ in range(3000):
        now += rng.expovariate(15.0)
        priority = rng.randrange(2)
        recent.record(now, priority, 32, 16)
        if priority == 1 and now > 20.0:
            (rate, _, _), = recent.ahead_of(1, now)
            reads.append(rate / 7.5)
    reads.sort()
    assert 0.84 < reads[len(reads) // 10] and reads[9 * len(reads) // 10] < 1.17


def test_a_request_the_load_would_hold_past_its_target_is_not_promised_it():
    """Interactive requests seen arriving for 2 s at 25 a second, more than
    two slots serve: a batch request with a 10 s target waits for as long
    as they come. Expected for the 2 s seen, it would be predicted in 3 s
    and admitted to miss; the door expects them until its token is due,
    and predicts it past the target."""
    model = LatencyModel(prior=(0.005, 0.005, 0.0, 0.001, 0.0))
    load = dict(running=[(50, 0, 40), (50, 0, 40)], max_num_seqs=2, arrivals=[(25.0, 32, 16)])
    objectives = LatencyObjectives(ttft=10.0)
    seen_only = model.predict_ttft(128, arrivals_for=2.0, **load)
    at_door = model.predict_ttft(128, arrivals_for=arrivals_horizon(2.0, objectives), **load)
    assert seen_only < 5.0 < objectives.ttft < at_door
    # Without a target, as long as they were seen; never less than that.
    assert arrivals_horizon(2.0, LatencyObjectives()) == 2.0
    assert arrivals_horizon(30.0, objectives) == 30.0
