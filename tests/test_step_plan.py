"""The step plan is a value: it pickles, it never changes under the runner,
and a runner given only copies of the plans computes exactly what it
computes from the originals (what a runner in another process would get)."""

from __future__ import annotations

import pickle

import attrs
import pytest
from actor_fixtures import tiny_loaded

from trioserve import testing
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.runtime.model_runner import ModelRunner
from trioserve.engine.core.new_request import NewRequest
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.runtime.step_plan import StepPlan

# A mix that exercises every part of a plan: greedy and seeded draws,
# penalties that read the output and the prompt, n > 1 (shared prefix
# blocks), min_tokens, and a pool small enough to preempt.
REQUESTS = [
    ("greedy", "the quick brown fox jumps over the lazy dog", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
    ("seeded", "a seeded prompt that runs a while", SamplingParams(temperature=0.9, seed=5, max_tokens=22, ignore_eos=True)),
    (
        "penalised",
        "repeat repeat repeat repeat",
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=20, ignore_eos=True),
    ),
    ("several", "three completions of one prompt", SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=18, ignore_eos=True)),
    ("floor", "at least some tokens", SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8)),
]


def run(core: EngineCore) -> dict[tuple[str, int], list[int]]:
    for request_id, prompt, params in REQUESTS:
        core.add_request(request_id, prompt, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    while core.has_unfinished():
        for output in core.step():
            tokens.setdefault((output.request_id, output.index), []).extend(output.new_token_ids)
    return tokens


def small_core() -> EngineCore:
    # 4 blocks of 16 tokens for 7 sequences of about 30: preemptions happen.
    return EngineCore(tiny_loaded(), testing.engine_config(num_blocks=4))


def test_a_runner_fed_pickled_copies_of_the_plans_computes_the_same_tokens(monkeypatch):
    expected = run(small_core())

    plans: list[StepPlan] = []
    real_execute = ModelRunner.execute

    def execute_a_copy(self: ModelRunner, plan: StepPlan):
        copy = pickle.loads(pickle.dumps(plan))
        assert copy == plan and copy is not plan
        plans.append(plan)
        return real_execute(self, copy)

    monkeypatch.setattr(ModelRunner, "execute", execute_a_copy)
    core = small_core()
    assert run(core) == expected
    assert core.scheduler.statistics().num_preemptions > 0
    assert any(c.sampling and c.sampling.output_token_ids for p in plans for c in p.chunks)  # penalties got history
    assert any(c.sampling and c.sampling.prompt_token_ids for p in plans for c in p.chunks)


def test_a_plan_does_not_change_when_the_scheduler_moves_on():
    core = small_core()
    core.add_request("r", "a prompt that will decode", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    first = core.schedule()
    frozen = pickle.dumps(first.plan)
    core.process_output(first, core.execute(first))
    while core.has_unfinished():
        core.step()
    assert pickle.dumps(first.plan) == frozen  # nothing in it aliases the request's lists
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        first.plan.chunks[0].start = 3  # type: ignore[misc]


def test_the_runner_forgets_ended_sequences_with_the_next_plan():
    core = small_core()
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=3, ignore_eos=True)
    core.add_request("a", "first seeded request", seeded)
    while core.has_unfinished():
        core.step()
    sampler = core.runner.sampler
    assert sampler.num_sequences == 1  # ended, but no plan has said so yet
    core.add_request("b", "second request", SamplingParams(temperature=0.0, max_tokens=1))
    plan = core.schedule()
    assert plan.plan.released == ("a",)
    core.process_output(plan, core.execute(plan))
    assert sampler.num_sequences == 0


def test_a_request_is_validated_into_a_value_that_cannot_be_invalid():
    core = small_core()
    new = core.validate("ok", "a prompt", SamplingParams(max_tokens=2), priority=2)
    assert new.prompt_token_ids and new.priority == 2
    assert pickle.loads(pickle.dumps(new)) == new
    with pytest.raises(InvalidRequestError) as slash:
        core.validate("a/0", "a prompt")
    assert slash.value.field == "request_id"
    with pytest.raises(InvalidRequestError) as empty:
        NewRequest("x", (), SamplingParams())
    assert empty.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as priority:
        core.validate("x", "a prompt", priority=1.5)  # type: ignore[arg-type]
    assert priority.value.field == "priority"
    with pytest.raises(InvalidRequestError) as vocab:
        core.validate("x", [10**9])
    assert vocab.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as too_long:
        core.validate("x", [1] * 64)
    assert too_long.value.field == "prompt"
    assert not core.has_unfinished()  # nothing was admitted by validating
