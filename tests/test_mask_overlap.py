"""Structured output's mask off the critical path: the scheduler sends a
plan with constrained rows marked ``awaits_mask``, fills the mask while the
step's forward runs and sends it as ``StepMask``; the step samples with it.

Checked here on the executors themselves (the fake on the autojump clock,
the step thread with the tiny model), through the actor engine (fake,
thread, worker process, speculative decoding beside constrained rows),
and the grammar cache's bound.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch
import trio
import trio.testing

from actor_fixtures import assert_clean, tiny_loaded
from trioserve import testing
from trioserve.actors import open_engine
from trioserve.actors.executor import FakeExecutor, MaskNotSent, ModelExecutor
from trioserve.actors.messages import RunStep, StepDone, StepFailed, StepMask
from trioserve.engine.runtime.build import build_runner
from trioserve.engine.sampling.grammar import GrammarCompiler, MaskFill, MaskRequest
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.runtime.step_plan import ScheduledChunk, StepPlan
from trioserve.engine.sampling.rows import SamplingRow, TokenMask
from trioserve.engine.sampling.structured_output import StructuredOutput
from trioserve.testing.tiny_model import BLOCK_SIZE, VOCAB_SIZE, tokenizer
from trioserve.web.cli import build_parser
from trioserve.web.engine_options import engine_config_from_args

CHOICES = ["alpha", "beta", "gamma delta"]
PATTERN = r"[a-c]{2,5}-[0-9]{1,3}"
ONLY = 4242  # the one token a test mask allows


def _only(token_id: int, request_id: str = "r") -> TokenMask:
    bitmask = torch.zeros(1, (VOCAB_SIZE + 31) // 32, dtype=torch.int32)
    bitmask[0, token_id // 32] = 1 << (token_id % 32)
    return TokenMask((request_id,), bitmask)


def _plan(*, awaits_mask: bool = True) -> StepPlan:
    row = SamplingRow("r", SamplingParams(temperature=0), eos_token_ids=(2,), num_output_tokens=0)
    chunk = ScheduledChunk("r", 0, tuple(range(10, 19)), (0,), sampling=row)
    return StepPlan(chunks=(chunk,), awaits_mask=awaits_mask)


def test_a_plan_awaits_its_mask_or_carries_it_not_both():
    with pytest.raises(AssertionError):
        StepPlan(chunks=(), token_mask=_only(ONLY), awaits_mask=True)


async def test_the_fake_step_waits_for_a_mask_that_comes_after_its_plan(autojump_clock):
    fake = FakeExecutor(vocab_size=VOCAB_SIZE, block_size=BLOCK_SIZE, step_time=1.0)
    replies_send, replies = trio.open_memory_channel(1)
    async with trio.open_nursery() as nursery:
        inbox = await nursery.start(fake.run, replies_send)
        async with inbox:
            await inbox.send(RunStep(1, _plan()))
            with trio.move_on_after(30):  # far past the step's time: it waits for the mask
                await replies.receive()
                pytest.fail("the step answered before its mask came")
            await inbox.send(StepMask(1, _only(ONLY)))
            reply = await replies.receive()
    assert isinstance(reply, StepDone) and reply.output.sampled == {"r": ONLY}
    assert len(fake.masks) == 1 and fake.plans[0].token_mask is None


async def test_a_step_whose_mask_never_comes_fails_and_the_executor_ends(autojump_clock):
    fake = FakeExecutor(vocab_size=VOCAB_SIZE, block_size=BLOCK_SIZE, step_time=1.0)
    replies_send, replies = trio.open_memory_channel(1)
    async with trio.open_nursery() as nursery:
        inbox = await nursery.start(fake.run, replies_send)
        await inbox.send(RunStep(1, _plan()))
        await inbox.aclose()  # the scheduler is gone before the mask
        reply = await replies.receive()
    assert isinstance(reply, StepFailed) and isinstance(reply.error, MaskNotSent)


async def test_the_step_threads_forward_runs_before_the_mask_exists():
    runner = build_runner(tiny_loaded(), testing.engine_config(num_blocks=8), num_blocks=8)
    forwarded = threading.Event()

    class Watched:
        def execute(self, plan):
            return runner.execute(plan)

        def forward_step(self, plan):
            step = runner.forward_step(plan)
            forwarded.set()
            return step

        def sample_step(self, step, token_mask):
            return runner.sample_step(step, token_mask)

    executor = ModelExecutor(Watched())
    replies_send, replies = trio.open_memory_channel(1)
    async with trio.open_nursery() as nursery:
        inbox = await nursery.start(executor.run, replies_send)
        async with inbox:
            await inbox.send(RunStep(1, _plan()))
            assert await trio.to_thread.run_sync(forwarded.wait, 60.0)  # the forward ran without the mask
            assert replies.statistics().current_buffer_used == 0
            await inbox.send(StepMask(1, _only(ONLY)))
            reply = await replies.receive()
    assert isinstance(reply, StepDone) and reply.output.sampled == {"r": ONLY}


def _requests() -> dict[str, SamplingParams]:
    """Constrained (choice and regex, greedy and seeded) and free requests."""
    requests = {}
    for i in range(4):
        sampling = dict(temperature=1.0, seed=i) if i % 2 else dict(temperature=0)
        requests[f"c{i}"] = SamplingParams(max_tokens=16, structured_output=StructuredOutput.choice(CHOICES), **sampling)
        requests[f"x{i}"] = SamplingParams(max_tokens=12, structured_output=StructuredOutput.regex(PATTERN), **sampling)
        requests[f"f{i}"] = SamplingParams(max_tokens=8, ignore_eos=True, **sampling)
    return requests


async def _generate(engine, requests: dict[str, SamplingParams]) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    for params in requests.values():
        # Compiled first: on the autojump clock a compile in a worker thread
        # would let the free requests run to their end before it returns.
        await engine.prepare(params)

    async def one(request_id: str, params: SamplingParams) -> None:
        got, text = [], ""
        async for out in engine.generate(f"Say something about {request_id}:", params, request_id=request_id):
            got.extend(out.new_token_ids)
            text += out.text_delta
        tokens[request_id], texts[request_id] = got, text

    async with trio.open_nursery() as nursery:  # together, so they share steps
        for request_id, params in requests.items():
            nursery.start_soon(one, request_id, params)
    return tokens, texts


def _check_constrained(texts: dict[str, str]) -> None:
    for request_id, text in texts.items():
        if request_id.startswith("c"):
            assert text in CHOICES, (request_id, text)
        elif request_id.startswith("x"):
            assert re.fullmatch(PATTERN, text), (request_id, text)


async def test_the_fake_engine_sends_constrained_plans_without_their_mask(autojump_clock):
    executors: list[FakeExecutor] = []

    def make(core):
        executors.append(FakeExecutor.for_core(core, step_time=0.01))
        return executors[-1]

    async with open_engine(testing.engine_config(num_blocks=64), loaded=tiny_loaded(), executor=make) as engine:
        _, texts = await _generate(engine, _requests())
        assert_clean(engine)
    _check_constrained(texts)
    fake = executors[0]
    constrained = [p for p in fake.plans if any(c.samples and c.request_id[0] in "cx" for c in p.chunks)]
    assert constrained and all(p.awaits_mask and p.token_mask is None for p in constrained)
    assert sum(p.awaits_mask for p in fake.plans) == len(constrained) == len(fake.masks)


def _repeating_token(chunk, context):
    """A fake model that repeats its context (period 3), so n-gram proposals hold."""
    return context[-3] if len(context) >= 3 else 100


async def test_speculating_rows_and_constrained_rows_share_steps(autojump_clock):
    async def run(speculative, requests):
        executors: list[FakeExecutor] = []

        def make(core):
            executors.append(FakeExecutor.for_core(core, step_time=0.01, token=_repeating_token))
            return executors[-1]

        config = testing.engine_config(num_blocks=64, speculative=speculative)
        async with open_engine(config, loaded=tiny_loaded(), executor=make) as engine:
            tokens, texts = await _generate(engine, requests)
            stats = engine.statistics().scheduler
            assert_clean(engine)
        return tokens, texts, stats, executors[0].plans

    free = {f"f{i}": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for i in range(4)}
    plain, _, _, _ = await run(None, free)
    constrained = {f"x{i}": SamplingParams(temperature=0, max_tokens=12, structured_output=StructuredOutput.regex(PATTERN)) for i in range(4)}
    tokens, texts, stats, plans = await run("ngram", {**free, **constrained})
    _check_constrained(texts)
    assert {rid: tokens[rid] for rid in free} == plain
    assert stats.num_draft_tokens > 0
    assert any(p.awaits_mask and any(c.num_draft_tokens for c in p.chunks) for p in plans)


async def test_half_constrained_batch_keeps_the_free_tokens_and_the_worker_process_matches_the_thread():
    requests = _requests()
    free = {rid: params for rid, params in requests.items() if rid.startswith("f")}
    config = testing.engine_config(num_blocks=64)
    async with open_engine(config, loaded=tiny_loaded()) as engine:
        alone, _ = await _generate(engine, free)
        mixed, texts = await _generate(engine, requests)
        assert_clean(engine)
    _check_constrained(texts)
    assert {rid: mixed[rid] for rid in free} == alone
    process = testing.engine_config(num_blocks=64, worker_mode="process")
    async with open_engine(process, loaded=tiny_loaded(), worker_model=testing.tiny_model.tiny_worker_model) as engine:
        in_worker, _ = await _generate(engine, requests)
        assert_clean(engine)
    assert in_worker == mixed


def test_a_fill_that_raises_fails_its_rows_not_the_step():
    class Broken:
        def fill_next_token_bitmask(self, bitmask, index):
            raise RuntimeError("boom")

    filled = MaskFill((MaskRequest("a"), MaskRequest("b")), (Broken(), Broken()), VOCAB_SIZE).run()
    assert filled.mask.request_ids == ("a", "b") and bool((filled.mask.bitmask == -1).all())
    assert [rid for rid, _ in filled.dead] == ["a", "b"] and "RuntimeError" in filled.dead[0][1]


def test_the_grammar_cache_keeps_the_most_recently_used():
    compiler = GrammarCompiler(tokenizer(), VOCAB_SIZE, (2,), cache_size=2)
    first, second, third = (StructuredOutput.regex(p) for p in ("a+", "b+", "c+"))
    compiled = compiler.compile(first)
    compiler.compile(second)
    assert compiler.cached(first) is compiled  # a use: "b+" is now the oldest
    compiler.compile(third)
    assert compiler.num_cached == 2
    assert compiler.cached(second) is None and compiler.cached(first) is compiled and compiler.cached(third) is not None
    assert compiler.compile(second) is not None and compiler.cached(first) is None


def test_the_grammar_cache_size_is_a_flag_and_a_config_field():
    args = build_parser().parse_args(["generate", "--grammar-cache-size", "3", "hi"])
    assert engine_config_from_args(args).grammar_cache_size == 3
    assert engine_config_from_args(build_parser().parse_args(["generate", "hi"])).grammar_cache_size == 128
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--grammar-cache-size", "0", "hi"])
    with pytest.raises(ValueError):
        testing.engine_config(grammar_cache_size=0)
