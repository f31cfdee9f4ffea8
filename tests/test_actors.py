"""The actor engine over a real (tiny, random-weight) model, with the model
step in a worker thread."""

from __future__ import annotations

import collections
import random
import threading
from typing import Any

import pytest
import trio
import trio.testing

from actor_fixtures import assert_clean, prompts, tiny_loaded
from trioserve.actors import EngineOverloaded, ModelExecutor, RequestFailed, RequestShed, open_engine
from trioserve.actors.engine import engine_sampling_defaults
from trioserve.testing import engine_config
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.core.sequence import FinishReason


class GatedRunner:
    """Wraps a ModelRunner. Records each plan's request ids; the ``nth``
    plan that contains ``gate_id`` signals ``entered`` (from the worker
    thread) and holds the step until ``release`` is set; a plan that
    ``fail(ids, count)`` selects raises instead of running."""

    def __init__(self, runner: Any, *, gate_id: str | None = None, nth: int = 1, fail=None) -> None:
        self.runner = runner
        self.gate_id = gate_id
        self.nth = nth
        self.fail = fail
        self.entered = trio.Event()
        self.trio_token = trio.lowlevel.current_trio_token()  # the step thread is not trio's
        self.release = threading.Event()
        self.plans: list[set[str]] = []
        self._seen = 0

    def execute(self, plan):
        ids = {c.request_id for c in plan.chunks}
        self.plans.append(ids)
        if self.fail is not None and self.fail(ids, len(self.plans)):
            raise RuntimeError("injected fault in the model step")
        if self.gate_id in ids:
            self._seen += 1
            if self._seen == self.nth:
                trio.from_thread.run_sync(self.entered.set, trio_token=self.trio_token)
                if not self.release.wait(timeout=60):
                    raise TimeoutError("the test never released the step")
        return self.runner.execute(plan)


def gated(**kw: Any):
    runners: list[GatedRunner] = []

    def make(core: EngineCore) -> ModelExecutor:
        runners.append(GatedRunner(core.runner, **kw))
        return ModelExecutor(runners[-1])

    return make, runners


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def collect(engine, prompt: Any, p: SamplingParams, **kw: Any) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, p, **kw)]


def by_completion(outputs: list[RequestOutput]) -> dict[int, tuple[list[int], str, FinishReason | None]]:
    result: dict[int, tuple[list[int], str, FinishReason | None]] = {}
    for out in outputs:
        tokens, text, _ = result.get(out.index, ([], "", None))
        result[out.index] = (tokens + list(out.new_token_ids), text + out.text_delta, out.finish_reason)
    return result


def workload() -> list[tuple[str, Any, SamplingParams]]:
    items: list[tuple[str, Any, SamplingParams]] = []
    for i, text in enumerate(prompts(20)):
        items.append((f"greedy{i}", text, greedy(4 + i % 13)))
    for i, text in enumerate(prompts(6, seed=3)):
        items.append((f"seeded{i}", text, SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=10)))
    items.append(("chat", [{"role": "user", "content": "Name three colours."}], greedy(12)))
    items.append(("n2", "two completions", SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=8)))
    items.append(("shared-prefix", prompts(1)[0] + " and then some more words", greedy(9)))
    return items


async def test_outputs_through_the_actors_equal_those_of_engine_core_directly():
    loaded = tiny_loaded()
    config = engine_config()
    core = EngineCore(loaded, config)
    # The actors' edge fills the sampling fields a request leaves out with
    # the model's defaults; the core takes its params as they are.
    defaults = engine_sampling_defaults(config, loaded)
    direct: dict[str, list[RequestOutput]] = collections.defaultdict(list)
    for request_id, prompt, p in workload():
        core.add_request(request_id, prompt, defaults.apply(p))
    while core.has_unfinished():
        for out in core.step():
            direct[out.request_id].append(out)

    through: dict[str, list[RequestOutput]] = {}

    async def run(request_id: str, prompt: Any, p: SamplingParams) -> None:
        through[request_id] = await collect(engine, prompt, p, request_id=request_id)

    async with open_engine(config, loaded=loaded) as engine:
        async with trio.open_nursery() as nursery:
            for item in workload():
                nursery.start_soon(run, *item)
    assert set(through) == set(direct)
    for request_id in direct:
        assert by_completion(through[request_id]) == by_completion(direct[request_id]), request_id
    assert_clean(engine)


@pytest.mark.parametrize("seed", [20, 21])
async def test_200_concurrent_requests_with_cancels_deadlines_and_priorities_all_end_clean(seed):
    rng = random.Random(seed)
    loaded = tiny_loaded()
    # A pool too small for 16 sequences of up to 36 tokens (preemption),
    # short output buffers (slow readers get paused) and a short queue.
    config = engine_config(num_blocks=24, max_num_seqs=16, max_queued_requests=24)
    ended: collections.Counter[str] = collections.Counter()
    texts = prompts(50)

    async def one(engine, i: int) -> None:
        try:
            await one_request(engine, i)
        except* RequestShed:
            # A nowait request of higher priority took its place in the full
            # queue (DegradationPolicy.shed_lower_priority): nothing computed.
            ended["shed"] += 1

    async def one_request(engine, i: int) -> None:
        kind = rng.choice(["plain", "cancel", "deadline", "abort", "final", "slow", "nowait"])
        p = SamplingParams(
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            max_tokens=rng.randint(1, 24),
            ignore_eos=True,
            n=rng.choice([1, 1, 1, 2]),
        )
        kw: dict[str, Any] = dict(request_id=f"q{i}", priority=rng.randint(0, 3))
        prompt = texts[i % len(texts)]
        outputs: list[RequestOutput] = []
        if kind == "cancel":
            with trio.move_on_after(rng.uniform(0, 0.05)) as scope:
                async for out in engine.generate(prompt, p, **kw):
                    outputs.append(out)
            if scope.cancelled_caught:
                ended["cancelled"] += 1
                return
        elif kind == "deadline":
            outputs = await collect(engine, prompt, p, timeout=rng.uniform(0, 0.05), **kw)
        elif kind == "abort":
            async with trio.open_nursery() as nursery:

                async def abort_later(delay=rng.uniform(0, 0.05)) -> None:
                    await trio.sleep(delay)
                    engine.abort(kw["request_id"])

                nursery.start_soon(abort_later)
                outputs = await collect(engine, prompt, p, **kw)
                nursery.cancel_scope.cancel()
        elif kind == "slow":
            async for out in engine.generate(prompt, p, **kw):
                outputs.append(out)
                await trio.testing.wait_all_tasks_blocked()  # read once everyone else is blocked
        elif kind == "nowait":
            try:
                stream = engine.generate_nowait(prompt, p, **kw)
            except EngineOverloaded as exc:
                assert exc.retry_after > 0
                ended["refused"] += 1
                outputs = await collect(engine, prompt, p, **kw)
            else:
                async with stream:
                    outputs = [out async for out in stream]
        else:
            outputs = await collect(engine, prompt, p, final_only=kind == "final", **kw)
        completions = by_completion(outputs)
        assert sorted(completions) == list(range(p.n))
        for tokens, _, reason in completions.values():
            assert reason is not None
            assert len(tokens) <= p.max_tokens
            if reason is FinishReason.LENGTH:
                assert len(tokens) == p.max_tokens
            ended[reason.value] += 1

    with trio.fail_after(120):
        async with open_engine(config, loaded=loaded, max_buffered_outputs=2) as engine:
            async with trio.open_nursery() as nursery:
                for i in range(200):
                    nursery.start_soon(one, engine, i)
            await trio.testing.wait_all_tasks_blocked()
            stats = engine.statistics()
    assert_clean(engine)
    assert engine.statistics().num_reserved_ids == 0
    s = stats.scheduler
    assert s.num_live == 0 and s.num_waiting == 0 and s.num_running == 0 and s.num_paused == 0
    unqueued = stats.num_deadline_unqueued + stats.num_cancelled_unqueued + stats.overload.num_shed
    # A shed request's reader may have ended first on its own side (its deadline, a cancel).
    assert ended["shed"] <= stats.overload.num_shed
    assert s.num_finished + s.num_aborted + s.num_deadline_exceeded + s.num_failed + unqueued == 200
    assert stats.num_accepted + stats.num_deadline_unqueued + stats.num_cancelled_unqueued == 200
    assert s.num_failed == 0 and s.num_preemptions > 0
    assert ended["length"] > 0 and ended["cancelled"] + ended["abort"] > 0 and ended["deadline"] > 0
    assert stats.allocator.kv.num_free_blocks == stats.allocator.kv.num_blocks


async def test_a_cancel_landing_while_the_step_runs_is_applied_after_it():
    make, runners = gated(gate_id="victim", nth=3)
    async with open_engine(engine_config(), loaded=tiny_loaded(), executor=make) as engine:
        runner = runners[0]
        victim_scope = trio.CancelScope()
        victim_got: list[RequestOutput] = []
        bystander: list[RequestOutput] = []

        async def victim() -> None:
            with victim_scope:
                async for out in engine.generate("the victim", greedy(50), request_id="victim"):
                    victim_got.append(out)

        async def other() -> None:
            bystander.extend(await collect(engine, "the bystander", greedy(12), request_id="bystander"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(victim)
            nursery.start_soon(other)
            await runner.entered.wait()  # the victim's third step is in the worker thread
            victim_scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            # The abort waits for the step boundary: the step is not cancellable.
            assert engine.statistics().executor.step_in_flight
            assert engine.core.scheduler.get_request("victim") is not None
            gated_step = len(runner.plans)
            runner.release.set()
        assert victim_scope.cancelled_caught
        assert not any("victim" in ids for ids in runner.plans[gated_step:])
        assert by_completion(bystander)[0][2] is FinishReason.LENGTH
        await trio.testing.wait_all_tasks_blocked()
        stats = engine.statistics()
        assert stats.scheduler.num_aborted == 1 and stats.scheduler.num_finished == 1
        assert stats.allocator.kv.num_free_blocks == stats.allocator.kv.num_blocks
    assert_clean(engine)


async def test_a_failing_model_step_fails_only_its_requests_and_the_engine_serves_on():
    make, runners = gated(fail=lambda ids, count: "bad" in ids and "peer" in ids)
    async with open_engine(engine_config(), loaded=tiny_loaded(), executor=make) as engine:
        errors: dict[str, BaseException] = {}

        async def run(name: str) -> None:
            try:
                await collect(engine, f"the {name} request", greedy(20), request_id=name)
            except RequestFailed as exc:
                errors[name] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "bad")
            nursery.start_soon(run, "peer")
        assert set(errors) == {"bad", "peer"}
        assert "injected fault" in str(errors["bad"]) and errors["peer"].request_id == "peer"
        # New requests are served normally afterwards.
        after = await collect(engine, "after the fault", greedy(6))
        assert by_completion(after)[0][2] is FinishReason.LENGTH
        await trio.testing.wait_all_tasks_blocked()
        stats = engine.statistics()
        assert stats.executor.num_failed_steps == 1 and stats.scheduler.num_failed == 2
        assert stats.allocator.kv.num_free_blocks == stats.allocator.kv.num_blocks
    assert_clean(engine)


async def test_the_example_embeds_the_engine(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "embed_in_trio.py"
    spec = importlib.util.spec_from_file_location("embed_in_trio", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    await example.main(engine_config(), loaded=tiny_loaded(), bound=0.2)
    printed = capsys.readouterr().out
    assert "[chat] finish_reason=" in printed
    assert "[bounded] cancelled by move_on_after(0.2)" in printed
    assert "statistics:" in printed and "aborted=1" in printed
