"""The continuous-batching scheduler over an in-process pool and a fake runner."""

from __future__ import annotations

import pytest
from factories import FakeRunner, make_request, make_scheduler, next_token, run_to_completion, step
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from trioserve.engine.errors import InvalidRequestError, RequestTooLongError
from trioserve.engine.core.scheduler import Scheduler, SchedulerOutput
from trioserve.engine.core.sequence import FinishReason, Request, RequestStatus


def chunk_sizes(output: SchedulerOutput) -> dict[str, int]:
    return {c.request_id: c.num_tokens for c in output.chunks}


def step_with(scheduler: Scheduler, bm, tokens: dict[str, int]) -> SchedulerOutput:
    """A step whose sampled tokens are given, for stop-condition tests."""
    output = scheduler.schedule(bm)
    sampled = {c.request_id: tokens[c.request_id] for c in output.chunks if c.samples}
    scheduler.update_from_output(output, sampled)
    return output


def reference_output(request: Request, *, max_context_len: int, vocab_size: int) -> list[int]:
    """What greedy decoding yields for a request run alone, never preempted."""
    params = request.sampling_params
    out: list[int] = []
    while True:
        token = next_token(request.prompt_token_ids + out, vocab_size)
        out.append(token)
        if len(out) >= params.min_tokens:
            if (not params.ignore_eos and token in request.eos_token_ids) or token in params.stop_token_ids:
                return out
        if params.max_tokens is not None and len(out) >= params.max_tokens:
            return out
        if len(request.prompt_token_ids) + len(out) >= max_context_len:
            return out


def test_budgets_are_respected_every_step():
    scheduler, bm = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10, num_blocks=40)
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", prompt_len=3 + 4 * i, max_tokens=5))
    outputs = run_to_completion(scheduler, bm, FakeRunner(4))
    for output in outputs:
        assert output.num_batched_tokens == sum(chunk_sizes(output).values()) <= 10
        assert 0 < len(output.chunks) <= 3
        assert len(chunk_sizes(output)) == len(output.chunks)  # one chunk per request
    assert max(o.num_batched_tokens for o in outputs) == 10
    assert bm.statistics().num_free_blocks == 40


def test_chunked_prefill_mixes_with_decode_in_one_step():
    scheduler, bm = make_scheduler(max_num_batched_tokens=8, num_blocks=40)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("short", prompt_len=4, max_tokens=10))
    first = step(scheduler, bm, runner)
    assert chunk_sizes(first) == {"short": 4} and first.chunks[0].samples

    scheduler.add_request(make_request("long", prompt_len=20, max_tokens=2))
    sizes = [chunk_sizes(step(scheduler, bm, runner)) for _ in range(3)]
    assert sizes == [{"short": 1, "long": 7}, {"short": 1, "long": 7}, {"short": 1, "long": 6}]
    long = scheduler.get_request("long")
    assert long.num_output_tokens == 1 and long.num_computed_tokens == 20
    assert scheduler.get_request("short").num_output_tokens == 4


def test_decodes_come_before_prefills_and_waiting_requests():
    scheduler, bm = make_scheduler(max_num_batched_tokens=4, num_blocks=40)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", prompt_len=3, max_tokens=10))
    step(scheduler, bm, runner)
    scheduler.add_request(make_request("b", prompt_len=10, max_tokens=10))
    scheduler.add_request(make_request("c", prompt_len=3, max_tokens=10))
    assert chunk_sizes(step(scheduler, bm, runner)) == {"a": 1, "b": 3}
    assert chunk_sizes(step(scheduler, bm, runner)) == {"a": 1, "b": 3}
    assert chunk_sizes(step(scheduler, bm, runner)) == {"a": 1, "b": 3}  # c still waits: the prompt comes first
    assert chunk_sizes(step(scheduler, bm, runner)) == {"a": 1, "b": 1, "c": 2}


def test_waiting_requests_run_by_priority_then_arrival():
    scheduler, bm = make_scheduler(max_num_seqs=1, num_blocks=40)
    for rid, priority in [("late-low", 5), ("high", 0), ("mid", 2), ("high2", 0)]:
        scheduler.add_request(make_request(rid, priority=priority, max_tokens=1))
    outputs = run_to_completion(scheduler, bm, FakeRunner(4))
    assert [o.chunks[0].request_id for o in outputs] == ["high", "high2", "mid", "late-low"]
    assert [scheduler.get_request(r) for r in ("high", "mid")] == [None, None]


def _fill_pool(priorities: list[int]) -> tuple[Scheduler, object, FakeRunner]:
    # 3 requests of 7 prompt tokens take 2 blocks each: the pool of 6 is full,
    # and each needs a third block once it has two output tokens.
    scheduler, bm = make_scheduler(num_blocks=6, max_model_len=24)
    runner = FakeRunner(4)
    for i, priority in enumerate(priorities):
        scheduler.add_request(make_request(f"r{i}", prompt_len=7, max_tokens=8, priority=priority))
    step(scheduler, bm, runner)
    step(scheduler, bm, runner)
    assert bm.statistics().num_free_blocks == 0 and scheduler.num_running == 3
    return scheduler, bm, runner


def test_preemption_takes_the_latest_arrival_among_equals():
    scheduler, bm, runner = _fill_pool([0, 0, 0])
    output = step(scheduler, bm, runner)
    assert output.preempted == ("r2",)
    assert chunk_sizes(output) == {"r0": 1, "r1": 1}
    victim = scheduler.get_request("r2")
    assert victim.status is RequestStatus.PREEMPTED and victim.num_preemptions == 1
    assert victim.num_computed_tokens == 0 and victim.block_ids == []
    assert victim.num_output_tokens == 2  # its output is kept
    assert scheduler.statistics().num_preemptions == 1


def test_preemption_takes_the_lowest_priority_first():
    scheduler, bm, runner = _fill_pool([3, 0, 1])
    output = step(scheduler, bm, runner)
    assert output.preempted == ("r0",)
    assert chunk_sizes(output) == {"r1": 1, "r2": 1}


def test_a_request_preempts_itself_rather_than_a_higher_priority_one():
    scheduler, bm, runner = _fill_pool([0, 0, 0])
    scheduler.get_request("r1").priority = 9  # r1 now ranks last
    output = step(scheduler, bm, runner)
    assert output.preempted == ("r1",)
    assert chunk_sizes(output) == {"r0": 1, "r2": 1}


def test_preempted_requests_resume_and_their_greedy_output_is_unchanged():
    def run(num_blocks: int) -> tuple[dict[str, list[int]], Scheduler, object]:
        scheduler, bm = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16, max_model_len=40)
        for i in range(5):
            scheduler.add_request(make_request(f"r{i}", prompt_len=10, max_tokens=14, priority=i % 2))
        requests = [scheduler.get_request(f"r{i}") for i in range(5)]
        run_to_completion(scheduler, bm, FakeRunner(4))
        return {r.request_id: r.output_token_ids for r in requests}, scheduler, bm

    roomy, roomy_scheduler, _ = run(num_blocks=64)
    tight, tight_scheduler, tight_bm = run(num_blocks=12)
    assert roomy_scheduler.statistics().num_preemptions == 0
    assert tight_scheduler.statistics().num_preemptions > 0
    assert tight_bm.statistics().prefix_cache_hits > 0  # resumed through the cache
    assert tight == roomy
    assert all(len(out) == 14 for out in tight.values())


def test_one_request_needing_the_whole_pool_completes_beside_others():
    scheduler, bm = make_scheduler(num_blocks=8, max_model_len=64, max_num_batched_tokens=8)
    assert scheduler.max_context_len == 32  # the pool, not max_model_len, bounds a context
    whole = make_request("whole", prompt_len=20, max_tokens=None)
    scheduler.add_request(whole)
    for i in range(3):
        scheduler.add_request(make_request(f"small{i}", prompt_len=5, max_tokens=20, priority=1))
    run_to_completion(scheduler, bm, FakeRunner(4))
    assert whole.finish_reason is FinishReason.LENGTH and whole.num_tokens == 32
    assert whole.output_token_ids == reference_output(whole, max_context_len=32, vocab_size=1000)
    bm.check_invariants({})
    assert bm.statistics().num_free_blocks == 8


def test_check_fits_refuses_prompts_that_cannot_fit():
    scheduler, _ = make_scheduler(max_model_len=16, num_blocks=32)
    with pytest.raises(RequestTooLongError, match=r"max_model_len \(16\)") as too_long:
        scheduler.check_fits(16)
    assert too_long.value.field == "prompt"
    scheduler.check_fits(15)
    scheduler.add_request(make_request("ok", prompt_len=15))

    small_pool, _ = make_scheduler(max_model_len=64, num_blocks=4)
    message = r"needs 5 KV blocks of 4 tokens, but the KV pool has only 4"
    with pytest.raises(RequestTooLongError, match=message) as no_room:
        small_pool.check_fits(16)
    assert no_room.value.field == "prompt"
    small_pool.add_request(make_request("fits", prompt_len=15))
    assert small_pool.num_waiting == 1


def test_duplicate_request_id_is_refused():
    scheduler, bm = make_scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(InvalidRequestError, match="'a' is already in use") as dup:
        scheduler.add_request(make_request("a"))
    assert dup.value.field == "request_id"
    scheduler.abort("a")  # finished, but its free is not sent yet: the id is still taken
    with pytest.raises(InvalidRequestError):
        scheduler.add_request(make_request("a"))
    scheduler.free_finished(bm)
    scheduler.add_request(make_request("a"))


def test_abort_frees_everything_at_once():
    scheduler, bm = make_scheduler(num_blocks=16)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", prompt_len=10, max_tokens=10))
    scheduler.add_request(make_request("b", prompt_len=6, max_tokens=10))
    scheduler.add_request(make_request("c", prompt_len=6, max_tokens=10))
    step(scheduler, bm, runner)
    held_by_a = len(scheduler.get_request("a").block_ids)
    free_before = bm.statistics().num_free_blocks

    assert scheduler.abort("a") is True
    assert scheduler.abort("a") is False
    assert scheduler.abort("nobody") is False
    finished = scheduler.free_finished(bm)
    assert [r.request_id for r in finished] == ["a"] and finished[0].finish_reason is FinishReason.ABORT
    assert bm.statistics().num_free_blocks == free_before + held_by_a
    bm.check_invariants(scheduler.block_holders())
    scheduler.check_invariants()

    # Without free_finished the next step's batch frees first and reports it.
    scheduler.abort("b")
    output = step(scheduler, bm, runner)
    assert [r.request_id for r in output.finished] == ["b"]
    assert "b" not in scheduler.block_holders() and chunk_sizes(output) == {"c": 1}
    assert scheduler.num_running == 1 and scheduler.num_waiting == 0


def test_abort_while_a_batch_is_in_flight():
    scheduler, bm = make_scheduler(num_blocks=16)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", prompt_len=6, max_tokens=3))
    scheduler.add_request(make_request("b", prompt_len=6, max_tokens=3))
    batch = scheduler.propose()
    with pytest.raises(RuntimeError, match="in flight"):
        scheduler.propose()
    assert scheduler.abort("b")  # the pool has not answered yet
    output = scheduler.finalize(batch, bm.apply(batch))
    assert chunk_sizes(output) == {"a": 6}
    scheduler.update_from_output(output, runner.execute(output))
    assert scheduler.block_holders().keys() == {"a", "b"}  # the pool gave b blocks; they go next batch
    bm.check_invariants(scheduler.block_holders())
    run_to_completion(scheduler, bm, runner)
    bm.check_invariants({})
    assert bm.statistics().num_free_blocks == 16


def test_finish_request_from_outside():
    scheduler, bm = make_scheduler()
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", max_tokens=10))
    step(scheduler, bm, runner)
    finished = scheduler.finish_request("a", FinishReason.DEADLINE)
    assert finished is not None and finished.finish_reason is FinishReason.DEADLINE and finished.is_finished
    assert scheduler.finish_request("a", FinishReason.ERROR) is None
    assert not scheduler.has_unfinished() and scheduler.get_request("a") is None
    scheduler.free_finished(bm)
    assert bm.statistics().num_free_blocks == bm.num_blocks


@pytest.mark.parametrize(
    ("sampling", "tokens", "reason"),
    [
        ({"eos_token_ids": (7,)}, [3, 7], FinishReason.STOP),
        ({"eos_token_ids": (7,), "ignore_eos": True}, [7, 7, 7, 7], FinishReason.LENGTH),
        ({"eos_token_ids": (7,), "min_tokens": 3}, [7, 7, 7], FinishReason.STOP),
        ({"stop_token_ids": (5,), "min_tokens": 2}, [5, 5], FinishReason.STOP),
        ({"stop_token_ids": (5,), "ignore_eos": True}, [1, 5], FinishReason.STOP),
        ({}, [1, 2, 3, 4], FinishReason.LENGTH),
    ],
)
def test_token_level_stops(sampling, tokens, reason):
    scheduler, bm = make_scheduler()
    request = make_request("a", max_tokens=4, **sampling)
    scheduler.add_request(request)
    returned = []
    for token in tokens:
        assert not request.is_finished
        output = scheduler.schedule(bm)
        returned = scheduler.update_from_output(output, {"a": token})
    assert request.output_token_ids == tokens
    assert request.finish_reason is reason and returned == [request]


def test_reaching_max_model_len_stops_with_length():
    scheduler, bm = make_scheduler(max_model_len=10)
    request = make_request("a", prompt_len=7, max_tokens=None)
    scheduler.add_request(request)
    for _ in range(3):
        step_with(scheduler, bm, {"a": 1})
    assert request.finish_reason is FinishReason.LENGTH and request.num_tokens == 10


def test_siblings_with_the_same_prompt_share_blocks():
    scheduler, bm = make_scheduler(num_blocks=16)
    runner = FakeRunner(4)
    prompt = list(range(1, 11))  # two full blocks and a partial one
    first = make_request("n0", prompt, max_tokens=3)
    scheduler.add_request(first)
    step(scheduler, bm, runner)
    second = make_request("n1", prompt, max_tokens=3)
    scheduler.add_request(second)
    output = step(scheduler, bm, runner)
    assert chunk_sizes(output) == {"n0": 1, "n1": 2}  # 8 prompt tokens came from the cache
    assert second.num_cached_tokens == 8
    assert second.block_ids[:2] == first.block_ids[:2] and second.block_ids[2] != first.block_ids[2]
    bm.check_invariants(scheduler.block_holders())  # so those blocks have ref count 2
    run_to_completion(scheduler, bm, runner)
    assert first.output_token_ids == second.output_token_ids


def test_shared_system_prompt_hits_across_chats():
    scheduler, bm = make_scheduler(num_blocks=32, max_num_batched_tokens=64)
    runner = FakeRunner(4)
    system = list(range(500, 516))  # four blocks
    chats = [make_request(f"chat{i}", system + [i, i + 1, i + 2], max_tokens=2) for i in range(4)]
    scheduler.add_request(chats[0])
    run_to_completion(scheduler, bm, runner)
    for chat in chats[1:]:
        scheduler.add_request(chat)
    run_to_completion(scheduler, bm, runner)
    assert [c.num_cached_tokens for c in chats] == [0, 16, 16, 16]
    stats = scheduler.statistics().kv
    assert stats.prefix_cache_queries == 4 * 19 and stats.prefix_cache_hits == 3 * 16
    for chat in chats:
        assert chat.output_token_ids == reference_output(chat, max_context_len=64, vocab_size=1000)


def test_propose_and_finalize_check_the_protocol():
    scheduler, bm = make_scheduler()
    scheduler.add_request(make_request("a"))
    batch = scheduler.propose()
    with pytest.raises(ValueError, match="needs the batch the last propose"):
        scheduler.finalize(type(batch)(), bm.apply(type(batch)()))
    output = scheduler.finalize(batch, bm.apply(batch))
    with pytest.raises(ValueError, match="no sampled token for request 'a'"):
        scheduler.update_from_output(output, {})


VOCAB = 12  # small, so random prompts share prefixes and EOS (token 0) comes up
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort / finish / free sequences over a fake runner.

    After every rule both sides' invariants hold; at the end every request
    has finished, each one that finished by itself produced exactly its
    greedy reference output (preemptions and cache hits changed nothing),
    and every block is back in the pool.
    """

    @initialize(
        num_blocks=st.integers(4, 12),
        max_num_seqs=st.integers(1, 4),
        max_num_batched_tokens=st.integers(1, 9),
    )
    def setup(self, num_blocks, max_num_seqs, max_num_batched_tokens):
        self.scheduler, self.bm = make_scheduler(
            num_blocks=num_blocks,
            block_size=2,
            max_model_len=14,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.runner = FakeRunner(2, vocab_size=VOCAB)
        self.requests: list[Request] = []
        self.stopped_from_outside: set[str] = set()

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5),
        max_tokens=st.integers(1, 8),
        priority=st.integers(0, 2),
        eos=st.booleans(),
    )
    def add(self, prefix, tail, max_tokens, priority, eos):
        request = make_request(
            f"r{len(self.requests)}", prefix + tail, max_tokens=max_tokens, priority=priority,
            eos_token_ids=(0,) if eos else (),
        )
        prompt_room = self.scheduler.max_context_len - 1
        if request.num_tokens > prompt_room:
            with pytest.raises(RequestTooLongError):
                self.scheduler.check_fits(request.num_tokens)
            return
        self.scheduler.check_fits(request.num_tokens)
        self.scheduler.add_request(request)
        self.requests.append(request)

    @rule()
    def step(self):
        busy = self.scheduler.has_unfinished()
        output = step(self.scheduler, self.bm, self.runner)
        assert output.num_batched_tokens <= self.scheduler.max_num_batched_tokens
        assert len(output.chunks) <= self.scheduler.max_num_seqs
        assert not busy or output.chunks, "empty plan while requests are unfinished"

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), reason=st.sampled_from([FinishReason.ABORT, FinishReason.DEADLINE]), now=st.booleans())
    def stop_from_outside(self, data, reason, now):
        request = data.draw(st.sampled_from(self.requests))
        was_unfinished = not request.is_finished
        if reason is FinishReason.ABORT:
            assert self.scheduler.abort(request.request_id) is was_unfinished
        else:
            assert (self.scheduler.finish_request(request.request_id, reason) is request) is was_unfinished
        if was_unfinished:
            self.stopped_from_outside.add(request.request_id)
        if now:
            self.scheduler.free_finished(self.bm)
            assert request.request_id not in self.scheduler.block_holders()

    @invariant()
    def consistent(self):
        if hasattr(self, "scheduler"):
            self.scheduler.check_invariants()
            self.bm.check_invariants(self.scheduler.block_holders())

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        run_to_completion(self.scheduler, self.bm, self.runner)
        stats = self.scheduler.statistics()
        event(f"preempted: {stats.num_preemptions > 0}")
        event(f"prefix hits: {stats.kv.prefix_cache_hits > 0}")
        event(f"evictions: {stats.kv.num_evictions > 0}")
        self.bm.check_invariants({})
        assert self.bm.statistics().num_free_blocks == self.bm.num_blocks
        for request in self.requests:
            assert request.is_finished and request.finish_reason is not None
            if request.request_id not in self.stopped_from_outside:
                expected = reference_output(request, max_context_len=self.scheduler.max_context_len, vocab_size=VOCAB)
                assert request.output_token_ids == expected, request.request_id


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
