"""The parts of overload control on their own: the AIMD limit, the
admission queue's displacement, expiry and pressure, the metrics, and the
command-line flags."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from trioserve.actors.admission import AdmissionQueue
from trioserve.actors.concurrency import AdaptiveConcurrency
from trioserve.actors.messages import AddRequest
from trioserve.actors.statistics import OverloadStatistics
from trioserve.engine.config import DegradationPolicy
from trioserve.engine.core.new_request import NewRequest
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.web.metrics import OVERLOAD_ACTIONS, Metrics
from trioserve.web.serve_options import build_serve_parser, server_config_from_args, server_config_from_env
from trioserve.web.settings import ServerConfig

from server_fixtures import metric_values

# -- the AIMD limit ---------------------------------------------------------------------

# Binary fractions: sums of gaps are exact, so "at the target" is exactly at it.
TARGET, OVER, UNDER = 1 / 32, 1 / 16, 1 / 128


def feed(limit: AdaptiveConcurrency, gap: float, count: int, *, running: int, waiting: int = 0, start: float = 0.0) -> float:
    """A busy stretch: a step ending at ``start``, then ``count`` decoding
    steps ``gap`` apart (``count`` samples); return the last end."""
    now = start
    limit.idle()
    limit.observe(now, decoding=True, num_running=running, num_waiting=waiting)
    for _ in range(count):
        now += gap
        limit.observe(now, decoding=True, num_running=running, num_waiting=waiting)
    return now


def test_a_window_over_target_cuts_the_limit_to_three_quarters_of_what_ran():
    limit = AdaptiveConcurrency(max_limit=16, target=TARGET, window=4)
    feed(limit, OVER, 3, running=16)
    assert limit.limit == 16  # three samples: no full window yet
    feed(limit, OVER, 1, running=16, start=1.0)
    assert (limit.limit, limit.num_decreases, limit.last_p90) == (12, 1, pytest.approx(OVER))
    # Fewer than the limit ran: the cut is from what ran, not from the limit.
    feed(limit, OVER, 4, running=5, start=2.0)
    assert limit.limit == 3


def test_latency_while_above_the_limit_is_not_a_reason_to_cut_again():
    limit = AdaptiveConcurrency(max_limit=16, target=TARGET, window=4)
    feed(limit, OVER, 4, running=16)
    assert limit.limit == 12
    # The 16 still run (nothing is preempted): many windows, no further cut.
    feed(limit, OVER, 40, running=16, start=1.0)
    assert (limit.limit, limit.num_decreases) == (12, 1)


def test_a_window_within_target_raises_the_limit_only_when_requests_wait_at_it():
    limit = AdaptiveConcurrency(max_limit=16, target=TARGET, window=4)
    feed(limit, OVER, 4, running=8)
    assert limit.limit == 6
    feed(limit, UNDER, 4, running=6, waiting=0)  # nobody waits: no reason to grow
    assert limit.limit == 6
    feed(limit, UNDER, 4, running=4, waiting=3, start=1.0)  # the limit is not what holds them
    assert limit.limit == 6
    feed(limit, TARGET, 4, running=6, waiting=3, start=2.0)  # at the target counts as within
    assert (limit.limit, limit.num_increases) == (7, 1)


def test_idle_time_and_prefill_only_steps_are_not_samples():
    limit = AdaptiveConcurrency(max_limit=4, target=TARGET, window=2)
    limit.observe(0.0, decoding=True, num_running=4, num_waiting=0)
    limit.idle()
    limit.observe(5.0, decoding=True, num_running=4, num_waiting=0)  # 5 s of idling: no sample
    limit.observe(5.5, decoding=False, num_running=4, num_waiting=0)  # a step of prompts only
    assert limit.last_p90 is None
    limit.observe(5.5 + UNDER, decoding=True, num_running=4, num_waiting=0)
    limit.observe(5.5 + 2 * UNDER, decoding=True, num_running=4, num_waiting=0)
    assert limit.last_p90 == UNDER and limit.limit == 4


@given(
    st.integers(1, 64),
    st.lists(
        st.tuples(st.floats(0.0, 1.0), st.booleans(), st.integers(0, 80), st.integers(0, 100), st.booleans()), max_size=300
    ),
)
def test_the_limit_stays_within_one_and_the_maximum(max_limit, steps):
    limit = AdaptiveConcurrency(max_limit=max_limit, target=0.05, window=3)
    now = 0.0
    for gap, decoding, running, waiting, idle in steps:
        now += gap
        before = limit.limit
        limit.observe(now, decoding=decoding, num_running=running, num_waiting=waiting)
        assert 1 <= limit.limit <= max_limit
        assert limit.limit in (before, before + 1) or limit.limit <= max(1, math.floor(running * 0.75))
        if idle:
            limit.idle()


def test_the_limiter_validates_its_settings():
    for kwargs, field in [
        (dict(max_limit=0), "max_limit"),
        (dict(target=0.0), "target"),
        (dict(target=math.inf), "target"),
        (dict(window=0), "window"),
        (dict(decrease=1.0), "decrease"),
        (dict(increase=0), "increase"),
    ]:
        with pytest.raises(ValueError, match=field):
            AdaptiveConcurrency(**{"max_limit": 4, "target": 0.1, **kwargs})


# -- the admission queue ------------------------------------------------------------------


def message(request_id: str, *, priority: int = 0, num_tokens: int = 1, queue_deadline: float | None = None):
    send, _ = trio.open_memory_channel(1)
    return AddRequest(
        NewRequest(request_id, tuple(range(num_tokens)), SamplingParams(), priority),
        deadline=None,
        arrival_time=0.0,
        outputs=send,
        queue_deadline=queue_deadline,
    )


async def test_displacement_takes_the_latest_of_the_lowest_priority_if_strictly_lower():
    queue = AdmissionQueue(3)
    for request_id, priority in [("a", 2), ("b", 7), ("c", 7)]:
        queue.send_nowait(message(request_id, priority=priority))
    with pytest.raises(trio.WouldBlock):
        queue.send_nowait(message("full"))
    with pytest.raises(trio.WouldBlock):
        queue.displace_nowait(message("same", priority=7))
    assert queue.displace_nowait(message("d", priority=3)).request_id == "c"
    assert queue.displace_nowait(message("e", priority=3)).request_id == "b"
    with pytest.raises(trio.WouldBlock):
        queue.displace_nowait(message("f", priority=3))  # a(2), d(3), e(3): none lower than 3
    assert [queue.receive_nowait().request_id for _ in range(3)] == ["a", "d", "e"]


async def test_displacement_respects_the_token_bound():
    queue = AdmissionQueue(4, max_tokens=10)
    queue.send_nowait(message("small", priority=5, num_tokens=2))
    queue.send_nowait(message("big", priority=0, num_tokens=7))
    assert queue.pressure == pytest.approx(0.9)  # the token fill is the larger
    with pytest.raises(trio.WouldBlock):
        queue.displace_nowait(message("huge", priority=0, num_tokens=4))  # 7 + 4 > 10 even without "small"
    assert queue.displace_nowait(message("fits", priority=0, num_tokens=3)).request_id == "small"
    assert queue.num_queued_tokens == 10 and queue.pressure == 1.0


async def test_expired_requests_leave_the_queue_and_free_room():
    queue = AdmissionQueue(3)
    for request_id, deadline in [("a", 2.0), ("b", None), ("c", 1.0)]:
        queue.send_nowait(message(request_id, queue_deadline=deadline))
    assert queue.next_queue_deadline() == 1.0
    assert [m.request_id for m in queue.remove_expired(1.5)] == ["c"]
    assert queue.num_queued == 2 and queue.next_queue_deadline() == 2.0
    queue.send_nowait(message("d"))  # room again
    assert [m.request_id for m in queue.remove_expired(10.0)] == ["a"]


async def test_pressure_is_one_while_callers_wait_for_room():
    queue = AdmissionQueue(2)
    assert queue.pressure == 0.0
    queue.send_nowait(message("a"))
    assert queue.pressure == 0.5
    queue.send_nowait(message("b"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.send, message("c"))
        await trio.testing.wait_all_tasks_blocked()
        assert queue.num_waiting_to_send == 1 and queue.pressure == 1.0
        assert queue.receive_nowait().request_id == "a"  # room: the waiting sender gets in
    assert [queue.receive_nowait().request_id for _ in range(2)] == ["b", "c"]


async def test_a_closed_receiver_fails_waiting_senders_and_ends_the_queued():
    queue = AdmissionQueue(1)
    queued = message("queued")
    queue.send_nowait(queued)
    with pytest.RaisesGroup(trio.BrokenResourceError):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(queue.send, message("waiting"))
            await trio.testing.wait_all_tasks_blocked()
            queue.close_receiver()
    with pytest.raises(trio.ClosedResourceError):
        queued.outputs.send_nowait("x")  # the scheduler is gone: its reader gets EngineClosed
    with pytest.raises(trio.BrokenResourceError):
        queue.send_nowait(message("late"))


# -- metrics --------------------------------------------------------------------------------


def overload(**counts: int) -> OverloadStatistics:
    fields = dict(
        pressure=0.5,
        concurrency_limit=12,
        tpot_p90=0.03,
        num_queue_timeouts=0,
        num_shed=0,
        num_capped=0,
        num_refused_expensive=0,
        num_limit_decreases=0,
        num_limit_increases=0,
    )
    return OverloadStatistics(**{**fields, **counts})


def test_overload_metrics_mirror_the_engine_counts():
    metrics = Metrics()
    metrics.add_model("smol")
    values = metric_values(metrics.render()[0].decode(), "smol")
    assert {values[f"trioserve:overload_actions_total{{action={a}}}"] for a in OVERLOAD_ACTIONS} == {0.0}
    metrics.update_overload("smol", overload(num_shed=2, num_queue_timeouts=5))
    metrics.update_overload("smol", overload(num_shed=3, num_queue_timeouts=5, num_limit_decreases=1))
    values = metric_values(metrics.render()[0].decode(), "smol")
    assert values["trioserve:concurrency_limit"] == 12 and values["trioserve:overload_pressure"] == 0.5
    assert values["trioserve:overload_actions_total{action=shed}"] == 3
    assert values["trioserve:overload_actions_total{action=queue_timeout}"] == 5
    assert values["trioserve:overload_actions_total{action=limit_decrease}"] == 1
    assert values["trioserve:overload_actions_total{action=cap_max_tokens}"] == 0


# -- flags --------------------------------------------------------------------------------


def parse(*argv: str) -> ServerConfig:
    return server_config_from_args(build_serve_parser().parse_args(list(argv)))


def test_the_overload_flags_reach_the_engine_config():
    default = parse().engine
    assert default.max_queue_time is None and not default.adaptive_concurrency
    assert default.degradation == DegradationPolicy()
    engine = parse(
        "--max-queue-time", "2.5",
        "--adaptive-concurrency",
        "--target-tpot-ms", "80",
        "--no-priority-shedding",
        "--low-priority", "3",
        "--cap-low-priority-at", "off",
        "--low-priority-max-tokens", "64",
        "--refuse-expensive-at", "0.9",
        "--expensive-logprobs", "2",
    ).engine  # fmt: skip
    assert (engine.max_queue_time, engine.adaptive_concurrency, engine.target_tpot_ms) == (2.5, True, 80.0)
    assert engine.degradation == DegradationPolicy(
        low_priority=3,
        cap_at=None,
        low_priority_max_tokens=64,
        refuse_expensive_at=0.9,
        expensive_logprobs=2,
        shed_lower_priority=False,
    )


def test_bad_overload_flags_are_refused(capsys):
    for argv in (["--max-queue-time", "0"], ["--cap-low-priority-at", "1.5"], ["--refuse-expensive-at", "nan"]):
        with pytest.raises(SystemExit):
            build_serve_parser().parse_args(argv)
        assert argv[0] in capsys.readouterr().err
    with pytest.raises(ValueError, match="low_priority_max_tokens"):
        parse("--low-priority-max-tokens", "0")


def test_the_overload_flags_read_from_the_environment():
    config = server_config_from_env(
        {"TRIOSERVE_MAX_QUEUE_TIME": "3", "TRIOSERVE_ADAPTIVE_CONCURRENCY": "1", "TRIOSERVE_CAP_LOW_PRIORITY_AT": "off"}
    )
    assert config.engine.max_queue_time == 3.0 and config.engine.adaptive_concurrency
    assert config.engine.degradation.cap_at is None

