"""Speculative decoding without a draft model (``--speculative ngram``).

The tiny random model rarely repeats itself, so the speculating requests
here bias a few tokens strongly (``logit_bias`` applies at every verified
position the same way): the output is then a sequence over those tokens,
whose n-grams recur, and the model's own logits still choose among them.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import trio
from actor_fixtures import assert_clean, tiny_loaded
from factories import make_request, make_scheduler

from trioserve.actors import open_engine
from trioserve.actors.executor import FakeExecutor
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.sampling.sampler import Sampler
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.core.sequence import FinishReason
from trioserve.engine.sampling.speculative import NgramProposer, may_speculate, verify_sampled
from trioserve.engine.sampling.rows import SamplingRow
from trioserve.testing import engine_config

BIAS = {35877: 30.0, 15222: 30.0, 19287: 30.0}
PROMPTS = [
    "one two three one two three one two three one two",
    "the cat sat on the mat and the cat sat on the",
    "hello there",
    "a b a b a b a b",
]


def greedy(max_tokens: int = 40, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **kw)


def run_core(speculative: str | None, requests: list[tuple[str, str, SamplingParams]], **config: Any):
    """Step a core until done; per request (tokens, text, finish, count),
    and the core for its statistics. Checks the pool after every step."""
    config.setdefault("num_blocks", 64)  # the pool is checked after every step: keep it small
    core = EngineCore(tiny_loaded(), engine_config(speculative=speculative, **config))
    for request_id, prompt, params in requests:
        core.add_request(request_id, prompt, params)
    results: dict[str, list] = collections.defaultdict(lambda: [[], "", None, None])
    while core.has_unfinished():
        for out in core.step():
            entry = results[out.request_id]
            entry[0].extend(out.new_token_ids)
            entry[1] += out.text_delta
            if out.finished:
                entry[2], entry[3] = out.finish_reason, out.num_output_tokens
        core.scheduler.check_invariants()
        core.block_manager.check_invariants(core.scheduler.block_holders())
    kv = core.scheduler.statistics().kv
    assert kv.num_free_blocks == kv.num_blocks and not core.scheduler.block_holders()
    return dict(results), core


# -- proposing --------------------------------------------------------------------


def test_ngram_proposer_takes_the_most_recent_longest_match():
    proposer = NgramProposer(num_speculative_tokens=3, max_ngram=3, min_ngram=1)
    # "1 2 3" recurs: the most recent earlier match is at 4, followed by 9 8.
    assert proposer.propose([1, 2, 3, 7, 1, 2, 3, 9, 8, 1, 2, 3], limit=10) == (9, 8, 1)
    assert proposer.propose([1, 2, 3, 7, 1, 2, 3, 9, 8, 1, 2, 3], limit=2) == (9, 8)
    # Only the last token recurs: a 1-gram match.
    assert proposer.propose([5, 6, 7, 5], limit=10) == (6, 7, 5)
    assert proposer.propose([1, 2, 3, 4], limit=10) == ()
    assert proposer.propose([1, 2, 1], limit=0) == ()
    assert NgramProposer().propose([5, 6, 7, 5], limit=10) == ()  # 2-grams at least by default
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(max_ngram=2, min_ngram=3)


def test_a_proposal_is_as_long_as_the_last_one_earned():
    proposer = NgramProposer(num_speculative_tokens=4, min_ngram=1)
    assert proposer.next_limit(4, 0) == 1  # all rejected: one token next time
    assert proposer.next_limit(4, 2) == 3  # one more than were accepted
    assert proposer.next_limit(1, 1) == 3  # all accepted: two more
    assert proposer.next_limit(3, 3) == 4  # never past k
    scheduler, pool = make_scheduler(block_size=4)
    scheduler.proposer = proposer
    request = make_request("r", [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5], max_tokens=30)
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(pool), {"r": 6})
    step = scheduler.schedule(pool)
    assert step.chunks[0].num_draft_tokens == 4  # "7 8 9 5" after the recurring "5 6"
    scheduler.update_from_output(step, {"r": 5})  # the first proposed token (7) already rejected
    step = scheduler.schedule(pool)
    assert step.chunks[0].num_draft_tokens == 1 and request.draft_limit == 1
    scheduler.update_from_output(step, {"r": step.chunks[0].token_ids[1]}, {"r": (2,)})  # accepted
    assert request.draft_limit == 3


def test_sequences_that_read_per_position_state_do_not_speculate():
    assert may_speculate(greedy(), 1)
    assert not may_speculate(greedy(), 0)  # still prefilling
    assert not may_speculate(greedy(logprobs=2), 5)
    assert not may_speculate(greedy(frequency_penalty=0.5), 5)
    assert not may_speculate(SamplingParams(min_tokens=8, max_tokens=20), 5)


def test_config_refuses_an_unknown_method():
    with pytest.raises(ValueError, match="speculative"):
        engine_config(speculative="eagle")
    with pytest.raises(ValueError, match="speculative_min_ngram"):
        engine_config(speculative="ngram", speculative_max_ngram=1, speculative_min_ngram=2)
    # The shortest n-gram defaults to 2, or to the longest when that is 1.
    assert engine_config(speculative="ngram").speculative_min_ngram == 2
    assert engine_config(speculative="ngram", speculative_max_ngram=1).speculative_min_ngram == 1
    assert NgramProposer(max_ngram=1).min_ngram == 1 and NgramProposer().min_ngram == 2


# -- greedy: identical output ------------------------------------------------------


def mixed_workload() -> list[tuple[str, str, SamplingParams]]:
    """Speculating requests beside ones that may not (logprobs, penalties,
    plain unbiased text), with max_tokens cuts that fall mid-proposal."""
    items = [(f"s{i}", prompt, greedy(37 - 3 * i, logit_bias=BIAS)) for i, prompt in enumerate(PROMPTS)]
    items.append(("lp", PROMPTS[0], greedy(20, logit_bias=BIAS, logprobs=2)))
    items.append(("pen", PROMPTS[1], greedy(20, logit_bias=BIAS, frequency_penalty=0.3)))
    items.append(("plain", "Tell me a story", greedy(25)))
    return items


def test_greedy_output_is_identical_with_speculation_in_a_mixed_batch():
    plain, _ = run_core(None, mixed_workload())
    spec, core = run_core("ngram", mixed_workload())
    assert spec == plain
    stats = core.scheduler.statistics()
    assert stats.num_draft_tokens > 50
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # Fewer steps than tokens: accepted proposals cost no step of their own.
    assert all(spec[rid][3] == len(spec[rid][0]) for rid in spec)


def test_greedy_output_is_identical_under_preemption():
    items = [(f"s{i}", p, greedy(60, logit_bias=BIAS)) for i, p in enumerate(PROMPTS * 2)]
    plain, plain_core = run_core(None, items, num_blocks=14)
    spec, core = run_core("ngram", items, num_blocks=14)
    assert plain_core.scheduler.statistics().num_preemptions > 0
    assert core.scheduler.statistics().num_preemptions > 0
    assert core.scheduler.statistics().num_accepted_tokens > 0
    assert spec == plain


def test_stops_cut_accepted_tokens_where_plain_decoding_stops():
    # Take stops from a plain run's output, so they land inside what a
    # speculating step accepts.
    reference, _ = run_core(None, [("r", PROMPTS[3], greedy(40, logit_bias=BIAS))])
    tokens, text = reference["r"][0], reference["r"][1]
    stop_token = tokens[13]
    stop_text = text[len(text) // 2 : len(text) // 2 + 6]
    items = [
        ("tok", PROMPTS[3], greedy(40, logit_bias=BIAS, stop_token_ids=[stop_token])),
        ("str", PROMPTS[3], greedy(40, logit_bias=BIAS, stop=[stop_text])),
        ("len", PROMPTS[3], greedy(23, logit_bias=BIAS)),
    ]
    plain, _ = run_core(None, items)
    spec, core = run_core("ngram", items)
    assert spec == plain
    assert plain["tok"][2] is FinishReason.STOP and plain["tok"][0][-1] == stop_token
    assert plain["str"][2] is FinishReason.STOP and stop_text not in plain["str"][1]
    assert plain["len"][3] == 23
    assert core.scheduler.statistics().num_accepted_tokens > 0


async def test_greedy_output_through_the_actor_engine_is_identical_and_counted():
    async def run(speculative: str | None) -> tuple[dict[str, list[int]], Any]:
        results: dict[str, list[int]] = {}
        async with open_engine(engine_config(speculative=speculative), loaded=tiny_loaded()) as engine:

            async def one(request_id: str, prompt: str, params: SamplingParams) -> None:
                tokens: list[int] = []
                async for out in engine.generate(prompt, params, request_id=request_id):
                    tokens.extend(out.new_token_ids)
                results[request_id] = tokens

            async with trio.open_nursery() as nursery:
                for item in mixed_workload():
                    nursery.start_soon(one, *item)
            stats = engine.statistics()
            assert_clean(engine)
        return results, stats

    plain, _ = await run(None)
    spec, stats = await run("ngram")
    assert spec == plain
    assert stats.scheduler.num_draft_tokens > 0 and stats.scheduler.num_accepted_tokens > 0
    assert stats.scheduler.total_generation_tokens == sum(map(len, spec.values()))


# -- sampled: the target distribution ------------------------------------------------


def total_variation(counts: collections.Counter, probs: torch.Tensor, n: int) -> float:
    return 0.5 * sum(abs(counts.get(i, 0) / n - float(probs[i])) for i in range(len(probs)))


def test_rejection_sampling_keeps_the_target_distribution():
    # Target rows for two positions; the proposal is a likely token, then
    # an unlikely one, so acceptance and rejection both happen often.
    probs = torch.tensor([[0.1, 0.5, 0.25, 0.15, 0.0], [0.4, 0.05, 0.05, 0.2, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2]])
    draft = [1, 4]
    generator = torch.Generator().manual_seed(7)
    n = 20_000
    first: collections.Counter = collections.Counter()
    second: collections.Counter = collections.Counter()
    accepted_first = 0
    for _ in range(n):
        out = verify_sampled(probs, draft, generator)
        first[out[0]] += 1
        if out[0] == draft[0]:
            accepted_first += 1
            second[out[1]] += 1
    # The first token follows p0; given it was the proposal, the second follows p1.
    assert total_variation(first, probs[0], n) < 0.02
    assert total_variation(second, probs[1], accepted_first) < 0.025
    # Always accepting the proposal would give 1 - p0(1) = 0.5 here.
    assert first[1] / n == pytest.approx(0.5, abs=0.02)


def test_sampler_verify_draws_from_the_processed_distribution_and_is_seeded():
    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0], [0.0, 0.0, 1.0, 1.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.7, top_k=4, seed=11, max_tokens=10)
    row = SamplingRow("r", params, (), 3)
    target = torch.softmax(torch.where(logits[0] >= logits[0].topk(4).values[-1], logits[0] / 0.7, -torch.inf), -1)

    def draws(count: int) -> list[list[int]]:
        sampler = Sampler(vocab)
        return [sampler.verify(logits, row, [2]) for _ in range(count)]

    # Thousands of tiny draws: one thread spares them an OpenMP wake-up each.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = draws(5_000)
    finally:
        torch.set_num_threads(threads)
    first = collections.Counter(o[0] for o in out)
    assert total_variation(first, target, len(out)) < 0.03  # always accepting token 2 would give about 0.95
    assert first[3] == first[4] == 0  # dropped by top_k
    # Seeded: a fresh sampler with the same seed draws the same tokens.
    assert draws(20) == out[:20]


def copying_token(chunk: Any, context: list[int]) -> int:
    """A fake model that repeats its context with a period set by the request
    (so n-gram proposals are mostly right), every so often breaking it."""
    period = 3 + int(chunk.request_id[1:]) % 4
    if len(context) % 11 == 0:
        return 100 + len(context) % 50
    return context[-period] if len(context) >= period else 100


async def test_fake_executor_verifies_greedily_and_the_pool_ends_clean(autojump_clock):
    async def run(speculative: str | None) -> tuple[dict[str, list[int]], Any, int]:
        executors: list[FakeExecutor] = []

        def make(core: EngineCore) -> FakeExecutor:
            executor = FakeExecutor.for_core(core, step_time=0.01, token=copying_token)
            executors.append(executor)
            return executor

        results: dict[str, list[int]] = {}
        # 12 sequences of up to about 60 tokens in 20 blocks of 16: preemption.
        config = engine_config(num_blocks=20, max_num_seqs=12, speculative=speculative)
        async with open_engine(config, loaded=tiny_loaded(), executor=make) as engine:

            async def one(i: int) -> None:
                tokens: list[int] = []
                params = greedy(40 + i, stop_token_ids=[110 + i])
                async for out in engine.generate(PROMPTS[i % 4], params, request_id=f"r{i}"):
                    tokens.extend(out.new_token_ids)
                results[f"r{i}"] = tokens

            async with trio.open_nursery() as nursery:
                for i in range(12):
                    nursery.start_soon(one, i)
            stats = engine.statistics()
            assert_clean(engine)
        return results, stats, len(executors[0].plans)

    plain, plain_stats, plain_steps = await run(None)
    spec, stats, steps = await run("ngram")
    assert spec == plain
    assert plain_stats.scheduler.num_preemptions > 0 and stats.scheduler.num_preemptions > 0
    assert stats.scheduler.num_accepted_tokens > stats.scheduler.num_draft_tokens // 2
    assert steps < plain_steps


def test_a_stop_inside_accepted_tokens_leaves_no_computed_token_past_the_output():
    scheduler, pool = make_scheduler(block_size=4)
    scheduler.proposer = NgramProposer(num_speculative_tokens=4)
    request = make_request("r", [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1], max_tokens=10, stop_token_ids=[4])
    scheduler.add_request(request)
    prefill = scheduler.schedule(pool)
    scheduler.update_from_output(prefill, {"r": 2})
    # "5 1 2" recurs: the proposal is what followed it, "3 4 5 1".
    step = scheduler.schedule(pool)
    (chunk,) = step.chunks
    assert (chunk.start, chunk.token_ids, chunk.num_logits) == (11, (2, 3, 4, 5, 1), 5)
    # All four accepted, but the second token is a stop: 3 and 4 are kept.
    finished = scheduler.update_from_output(step, {"r": 3}, {"r": (4, 5, 1, 7)})
    assert finished == [request] and request.output_token_ids == [2, 3, 4]
    assert request.num_computed_tokens == request.num_tokens == 14
    assert scheduler.statistics().num_accepted_tokens == 4
    scheduler.free_finished(pool)
    scheduler.check_invariants()
    pool.check_invariants(scheduler.block_holders())
    assert pool.statistics().num_free_blocks == pool.num_blocks
