"""The ``slo`` scheduling policy (engine/core/slo_policy.py): earliest
deadline first within a class, the victim with the most slack, chunked
prefill cut to running requests' TPOT targets, and, in a scheduler driven by
a fake clock, more first-token deadlines met than first come, first served."""

from __future__ import annotations

import math

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.core.scheduler import Scheduler
from trioserve.engine.core.scheduling_policy import scheduling_policy
from trioserve.engine.core.latency_model import LatencyModel, StepShape
from trioserve.engine.core.slo_policy import SloPolicy, next_token_deadline
from trioserve.engine.plugins import Plugins, PriorityPolicy

from factories import FakeRunner, slo_request


@attrs.define
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler_for(policy, clock: FakeClock, **kw) -> tuple[Scheduler, BlockManager]:
    sizes = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_blocks=64, block_size=4) | kw
    scheduler = Scheduler(**sizes, policy=policy, clock=clock)
    return scheduler, BlockManager(sizes["num_blocks"], sizes["block_size"])


def timed_step(scheduler, block_manager, runner, clock: FakeClock, *, fixed=0.01, per_token=0.001):
    """One step whose time on ``clock`` is ``fixed + per_token x tokens``."""
    output = scheduler.schedule(block_manager)
    clock.now += fixed + per_token * sum(c.num_tokens for c in output.chunks)
    scheduler.update_from_output(output, runner.execute(output, scheduler))
    scheduler.check_invariants()
    return output


targets = st.one_of(st.none(), st.floats(min_value=0.01, max_value=100.0))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.floats(0.0, 50.0), targets), min_size=1, max_size=12))
def test_waiting_order_is_by_deadline_within_class_then_by_arrival(specs):
    clock = FakeClock()
    scheduler, _ = scheduler_for(SloPolicy(), clock)
    for i, (priority, arrival, ttft) in enumerate(specs):
        scheduler.add_request(slo_request(f"r{i}", arrival=arrival, ttft=ttft, priority=priority))
    order = [scheduler.get_request(f"r{i}") for i in range(len(specs))]
    order.sort(key=scheduler._key)
    for a, b in zip(order, order[1:]):
        assert a.priority <= b.priority
        if a.priority != b.priority:
            continue
        da, db = a.objectives.first_token_deadline(a.arrival_time), b.objectives.first_token_deadline(b.arrival_time)
        if math.isinf(da) and math.isinf(db):
            assert a.arrival_index < b.arrival_index  # without targets: first come, first served
        else:
            assert da <= db  # with targets first, earliest deadline first
    scheduler.check_invariants()


def test_a_running_request_is_due_by_its_tpot_budget():
    request = slo_request("r", arrival=10.0, ttft=1.0, tpot=0.1)
    assert next_token_deadline(request) == 11.0
    request.output_token_ids.extend([1, 2, 3])
    assert next_token_deadline(request) == 10.0 + 1.0 + 0.3
    assert next_token_deadline(slo_request("n", ttft=1.0, max_tokens=4)) == 1.0
    no_tpot = slo_request("m", ttft=1.0)
    no_tpot.output_token_ids.append(1)
    assert next_token_deadline(no_tpot) == math.inf


def test_the_victim_is_the_running_request_with_the_most_slack():
    # Three prompts of 7 tokens fill the 6 blocks; the next token of each
    # needs a third block, so the scheduler must preempt.
    clock = FakeClock()
    scheduler, pool = scheduler_for(SloPolicy(), clock, num_blocks=6, max_model_len=32)
    scheduler.add_request(slo_request("tight", ttft=5.0, tpot=0.05, prompt_len=7, max_tokens=8))
    scheduler.add_request(slo_request("none", prompt_len=7, max_tokens=8))
    scheduler.add_request(slo_request("loose", ttft=5.0, tpot=2.0, prompt_len=7, max_tokens=8))
    runner = FakeRunner(block_size=4)
    timed_step(scheduler, pool, runner, clock)
    timed_step(scheduler, pool, runner, clock)
    first = timed_step(scheduler, pool, runner, clock)
    assert first.preempted == ("none",)  # no target: infinite slack
    # The two left grow until they fill the pool again.
    second = next(o for o in iter(lambda: timed_step(scheduler, pool, runner, clock), None) if o.preempted)
    assert second.preempted == ("loose",)  # more slack than "tight"
    assert scheduler.get_request("tight").status.name == "RUNNING"


def learned(fixed: float = 0.01, per_token: float = 0.001) -> LatencyModel:
    """A latency model that has seen steps of ``fixed + per_token x tokens``
    (prefill and decode tokens alike), as the scheduler actor feeds it."""
    model = LatencyModel(forgetting=1.0)
    for prefill, decodes in [(1, 0), (8, 1), (32, 2), (64, 0), (2, 3), (16, 1), (48, 4), (4, 2), (100, 0), (0, 6)] * 3:
        model.observe(StepShape(prefill, 0, decodes, 0), fixed + per_token * (prefill + decodes))
    return model


def test_a_tight_tpot_target_cuts_the_prefill_chunk():
    clock = FakeClock()
    policy = SloPolicy(min_chunk=4, latency=learned())
    scheduler, pool = scheduler_for(policy, clock, max_num_batched_tokens=128, num_blocks=256)
    runner = FakeRunner(block_size=4)
    # Late already (it waited 10 s): its next token is due within one TPOT target.
    scheduler.add_request(slo_request("chat", arrival=-10.0, ttft=1.0, tpot=0.03, prompt_len=4, max_tokens=50))
    timed_step(scheduler, pool, runner, clock)  # its prompt, its first token
    scheduler.add_request(slo_request("long", ttft=10.0, prompt_len=200, max_tokens=2))
    for _ in range(4):
        output = timed_step(scheduler, pool, runner, clock)
        # Within 30 ms: 10 ms fixed + 1 ms per token -> at most 20 tokens.
        assert sum(c.num_tokens for c in output.chunks) <= 20
        assert any(c.request_id == "long" and c.num_tokens >= 4 for c in output.chunks)  # it progresses
    # Ahead of its TPOT budget (a first token long before its TTFT target),
    # a request may wait for a longer step.
    scheduler.abort("chat")
    scheduler.add_request(slo_request("ahead", arrival=clock.now, ttft=5.0, tpot=0.03, prompt_len=4, max_tokens=50))
    timed_step(scheduler, pool, runner, clock)
    scheduler.add_request(slo_request("long2", ttft=10.0, prompt_len=200, max_tokens=2))
    output = timed_step(scheduler, pool, runner, clock)
    assert sum(c.num_tokens for c in output.chunks) > 20


def test_before_enough_steps_no_chunk_is_cut():
    clock = FakeClock()
    scheduler, pool = scheduler_for(SloPolicy(min_chunk=4), clock, max_num_batched_tokens=128, num_blocks=256)
    runner = FakeRunner(block_size=4)
    scheduler.add_request(slo_request("chat", arrival=-10.0, ttft=1.0, tpot=0.03, prompt_len=4, max_tokens=50))
    timed_step(scheduler, pool, runner, clock)
    scheduler.add_request(slo_request("long", ttft=10.0, prompt_len=200, max_tokens=2))
    assert sum(c.num_tokens for c in timed_step(scheduler, pool, runner, clock).chunks) == 128


def first_token_deadlines_met(policy) -> int:
    """Batch requests with loose TTFT targets arrive first, then chat
    requests with tight ones; two run at a time. How many first tokens come
    within their TTFT target?"""
    clock = FakeClock()
    scheduler, pool = scheduler_for(policy, clock, max_num_seqs=2, num_blocks=128)
    runner = FakeRunner(block_size=4)
    arrivals = [(f"batch{i}", 0.0, 30.0, 40, 20) for i in range(6)]
    arrivals += [(f"chat{i}", 0.05 + 0.01 * i, 0.6, 8, 4) for i in range(6)]
    pending = sorted(arrivals, key=lambda a: a[1])
    first_token: dict[str, float] = {}
    while pending or scheduler.has_unfinished():
        while pending and pending[0][1] <= clock.now:
            rid, arrival, ttft, prompt_len, max_tokens = pending.pop(0)
            scheduler.add_request(slo_request(rid, arrival=arrival, ttft=ttft, prompt_len=prompt_len, max_tokens=max_tokens))
        if not scheduler.has_unfinished():
            clock.now = pending[0][1]
            continue
        output = timed_step(scheduler, pool, runner, clock)
        for chunk in output.chunks:
            if chunk.samples and chunk.request_id not in first_token:
                first_token[chunk.request_id] = clock.now
        scheduler.free_finished(pool)
    ttft_of = {rid: ttft for rid, _, ttft, _, _ in arrivals}
    arrival_of = {rid: arrival for rid, arrival, _, _, _ in arrivals}
    return sum(first_token[rid] - arrival_of[rid] <= ttft_of[rid] for rid in ttft_of)


def test_earliest_deadline_first_meets_more_first_token_deadlines_than_fcfs():
    fcfs = first_token_deadlines_met(PriorityPolicy())
    edf = first_token_deadlines_met(SloPolicy())
    assert edf == 12
    assert fcfs < edf


def test_scheduling_policy_slo_selects_the_slo_policy():
    config = EngineConfig(scheduling_policy="slo", priority_aging_steps=7)
    model = LatencyModel()
    policy = scheduling_policy(Plugins(), config, model)
    assert isinstance(policy, SloPolicy) and policy.aging_interval == 7 and policy.latency is model
    assert isinstance(scheduling_policy(Plugins(), EngineConfig(), model), PriorityPolicy)
