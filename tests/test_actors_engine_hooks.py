"""The scheduler hooks the actors need: pause/resume (a reader fell behind),
priority preemption by arrivals, and aging against starvation."""

from __future__ import annotations

import pytest

from factories import FakeRunner, make_request, make_scheduler, next_token, run_to_completion, step

from trioserve.engine.plugins import PriorityPolicy
from trioserve.engine.core.scheduler import Scheduler
from trioserve.engine.core.sequence import FinishReason, RequestStatus


def ids(output) -> set[str]:
    return {c.request_id for c in output.chunks}


def greedy_reference(prompt: list[int], max_tokens: int, vocab_size: int = 1000) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(next_token(prompt + out, vocab_size))
    return out


def check(scheduler: Scheduler, bm) -> None:
    scheduler.check_invariants()
    bm.check_invariants(scheduler.block_holders())


def test_pause_preempts_a_running_request_and_resume_loses_nothing():
    scheduler, bm = make_scheduler(num_blocks=32, block_size=4)
    runner = FakeRunner(4)
    paused = make_request("p", prompt_len=10, max_tokens=12)
    scheduler.add_request(paused)
    scheduler.add_request(make_request("other", prompt_len=6, max_tokens=20))
    for _ in range(4):
        step(scheduler, bm, runner)
    held_before = len(bm.block_table("p"))
    assert held_before > 0 and paused.num_output_tokens == 4

    assert scheduler.pause("p") and not scheduler.pause("p")
    assert paused.status is RequestStatus.PREEMPTED and scheduler.statistics().num_paused == 1
    check(scheduler, bm)
    free_before = bm.statistics().num_free_blocks
    for _ in range(5):
        assert "p" not in ids(step(scheduler, bm, runner))
        check(scheduler, bm)
    assert bm.block_table("p") == () and bm.statistics().num_free_blocks >= free_before  # freed by the next batch
    assert paused.num_output_tokens == 4  # output kept

    assert scheduler.resume("p") and not scheduler.resume("p")
    first = step(scheduler, bm, runner)
    chunk = next(c for c in first.chunks if c.request_id == "p")
    assert chunk.start >= 8  # its committed full blocks came back from the prefix cache
    run_to_completion(scheduler, bm, runner)
    assert paused.output_token_ids == greedy_reference(paused.prompt_token_ids, 12)
    assert bm.statistics().num_free_blocks == 32


def test_a_paused_waiting_request_is_skipped_until_resumed():
    scheduler, bm = make_scheduler(num_blocks=32)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("w", prompt_len=5, max_tokens=3))
    assert scheduler.pause("w")
    assert scheduler.statistics().num_waiting == 0
    assert step(scheduler, bm, runner).is_empty
    check(scheduler, bm)
    scheduler.resume("w")
    run_to_completion(scheduler, bm, runner)
    assert not scheduler.has_unfinished()


def test_a_paused_request_can_be_aborted_and_frees_everything():
    scheduler, bm = make_scheduler(num_blocks=32)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("x", prompt_len=9, max_tokens=30))
    step(scheduler, bm, runner)
    step(scheduler, bm, runner)
    scheduler.pause("x")
    assert scheduler.finish_request("x", FinishReason.DEADLINE) is not None
    output = step(scheduler, bm, runner)
    assert [r.request_id for r in output.finished] == ["x"]
    assert output.finished[0].finish_reason is FinishReason.DEADLINE
    check(scheduler, bm)
    assert bm.statistics().num_free_blocks == 32 and scheduler.statistics().num_paused == 0


def test_pause_refuses_unknown_requests_and_a_batch_in_flight():
    scheduler, bm = make_scheduler()
    assert not scheduler.pause("nobody") and not scheduler.resume("nobody")
    scheduler.add_request(make_request("r"))
    scheduler.propose()
    with pytest.raises(RuntimeError, match="in flight"):
        scheduler.pause("r")


def test_a_higher_priority_arrival_preempts_lower_priority_running_requests():
    # 6 blocks of 4 tokens: two low-priority requests of 8-token prompts fill 4.
    scheduler, bm = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("low1", prompt_len=8, max_tokens=6, priority=5))
    scheduler.add_request(make_request("low2", prompt_len=8, max_tokens=6, priority=5))
    step(scheduler, bm, runner)
    scheduler.add_request(make_request("high", prompt_len=12, max_tokens=2, priority=0))
    output = step(scheduler, bm, runner)
    assert output.preempted == ("low2",) and "high" in ids(output) and "low1" in ids(output)
    check(scheduler, bm)
    run_to_completion(scheduler, bm, runner)


def test_equal_priority_arrivals_never_preempt():
    scheduler, bm = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", prompt_len=8, max_tokens=6, priority=1))
    scheduler.add_request(make_request("b", prompt_len=8, max_tokens=6, priority=1))
    step(scheduler, bm, runner)
    scheduler.add_request(make_request("c", prompt_len=12, max_tokens=2, priority=1))
    output = step(scheduler, bm, runner)
    assert output.preempted == () and "c" not in ids(output)


def test_no_preemption_when_it_would_not_make_room():
    scheduler, bm = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_model_len=24)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("low", prompt_len=4, max_tokens=6, priority=5))
    scheduler.add_request(make_request("mid", prompt_len=12, max_tokens=6, priority=0))
    step(scheduler, bm, runner)
    # Preempting "low" frees 1 block; "high" needs 5 of the 2 free: no use.
    scheduler.add_request(make_request("high", prompt_len=20, max_tokens=1, priority=0))
    output = step(scheduler, bm, runner)
    assert output.preempted == () and "low" in ids(output)


def _starve(aging_interval: int | None, steps: int) -> int | None:
    """A priority-5 request waits while a priority-0 request arrives every
    step; return the step it first runs at (None: never)."""
    scheduler, bm = make_scheduler(max_num_seqs=1, num_blocks=32)
    scheduler.aging_interval = aging_interval
    scheduler.policy = PriorityPolicy(aging_interval)  # the built-in policy ages by its own interval
    runner = FakeRunner(4)
    scheduler.add_request(make_request("busy", prompt_len=4, max_tokens=1, priority=0))
    scheduler.add_request(make_request("low", prompt_len=4, max_tokens=1, priority=5))
    for i in range(steps):
        scheduler.add_request(make_request(f"high{i}", prompt_len=4, max_tokens=1, priority=0))
        if "low" in ids(step(scheduler, bm, runner)):
            return i
        check(scheduler, bm)
    return None


def test_without_aging_a_low_priority_request_starves():
    assert _starve(None, 40) is None


def test_aging_lets_a_low_priority_request_run():
    ran_at = _starve(2, 40)
    # Five levels behind, two steps a level: it outranks newer arrivals after ten steps.
    assert ran_at is not None and 9 <= ran_at <= 12


def test_an_aged_running_request_is_not_preempted_by_newer_arrivals_of_its_old_level():
    scheduler, bm = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4)
    scheduler.aging_interval = 1
    scheduler.policy = PriorityPolicy(1)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("old", prompt_len=8, max_tokens=20, priority=2))
    for _ in range(4):
        step(scheduler, bm, runner)  # "old" ages to effective priority -2 as it runs
    scheduler.add_request(make_request("new", prompt_len=16, max_tokens=2, priority=0))
    output = step(scheduler, bm, runner)
    assert output.preempted == () and "old" in ids(output)


def test_aging_interval_is_validated():
    with pytest.raises(ValueError, match="aging_interval"):
        Scheduler(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16, num_blocks=4, block_size=4, aging_interval=0)
