"""Sliding-window layers keep only their window in the paged KV cache.

At the pool's level (engine/core/block_manager.py): a scheduler drives a
``BlockManager`` with a window group over random request lengths, windows
and block sizes, while a fake runner keeps two paged stores of token ids,
one per group, and checks that every position a window layer reads is in
the window group's blocks with the right token (and every position a full
layer reads in the full group's). After every step: blocks out of the
window are released, no block is held twice, counts add up, the tables
match the scheduler's mirror, and each sequence holds no more window
blocks than the sizing policy (``window_pool_blocks``) allows it.

At the engine's level: a tiny Gemma-3-like model (sliding and global
layers) and an all-sliding Mistral generate ten windows past their window
with the window group on; their greedy tokens equal the same engine's
with n-gram speculation, and with the sliding layers on the full pool (only masked, the path
test_model_equivalence.py checks against transformers), the window
group's used blocks stay within the sequences' windows, and a second
request sharing a long prefix hits the prefix cache and gives the tokens
it gives on a cold engine. The pool's plan gives the bytes the window
group leaves to more blocks of the other layers, within the budget.
"""

from __future__ import annotations

import math
import random

import attrs
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve.engine.config import EngineConfig, ModelConfig
from trioserve.engine.core import kv_pool
from trioserve.engine.core.block_manager import NULL_BLOCK, BlockManager
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.core.kv_batch import KVAllocation, KVBatch, KVCommit, KVResult
from trioserve.engine.core.kv_budget import KVPoolPlan, split_for_window
from trioserve.engine.core.scheduler import Scheduler, SchedulerOutput
from trioserve.engine.core.sequence import Request
from trioserve.engine.layers.kv_cache import kv_bytes_per_block
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.models.llama import LlamaForCausalLM
from trioserve.engine.runtime import build
from trioserve.engine.runtime.build import window_pool_blocks
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.text.fast_tokenizer import FastTokenizer
from trioserve.testing.tiny_model import write_word_tokenizer

VOCAB = 7  # small, so that prompts share prefixes often


@attrs.define
class TwoGroupRunner:
    """A fake runner over two paged stores of token ids: the full group's
    (``block_ids``) and the window group's (``window_block_ids``)."""

    block_size: int
    window: int
    full: dict[int, int] = attrs.field(factory=dict)  # slot -> token
    windowed: dict[int, int] = attrs.field(factory=dict)

    def _slot(self, table: tuple[int, ...], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, output: SchedulerOutput, scheduler: Scheduler) -> dict[str, int]:
        sampled = {}
        for chunk in output.plan.chunks:
            table, window_table = chunk.block_ids, chunk.window_block_ids
            assert window_table is not None and len(window_table) == len(table)
            first = max(0, chunk.start - self.window + 1) // self.block_size
            # Blocks wholly before the oldest query's window are released,
            # the rest are real blocks.
            assert all(b == NULL_BLOCK for b in window_table[:first]), (chunk.start, window_table)
            assert all(b != NULL_BLOCK for b in window_table[first:]), (chunk.start, window_table)
            for offset, token in enumerate(chunk.token_ids):
                self.full[self._slot(table, chunk.start + offset)] = token
                self.windowed[self._slot(window_table, chunk.start + offset)] = token
            tokens = scheduler.get_request(chunk.request_id).all_token_ids
            end = chunk.start + chunk.num_tokens
            # Every query of the chunk reads its window from the window group.
            for p in range(max(0, chunk.start - self.window + 1), end):
                assert self.windowed.get(self._slot(window_table, p)) == tokens[p], f"window slot of position {p}"
            context = [self.full.get(self._slot(table, p)) for p in range(end)]
            assert context == tokens[:end], "the full group reads a wrong context"
            if chunk.samples:
                # The next token depends on the window only, as a window layer's output does.
                sampled[chunk.request_id] = hash(tuple(tokens[max(0, end - self.window) : end])) % VOCAB
        return sampled


def _request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        eos_token_ids=(),
    )


def _check_window_holdings(bm: BlockManager, scheduler: Scheduler, bound: int) -> None:
    for rid in scheduler.block_holders():
        held = [b for b in bm.window_table(rid) if b != NULL_BLOCK]
        assert len(held) <= bound, f"{rid!r} holds {len(held)} window blocks, more than {bound}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    window=st.integers(1, 12),
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(4, 16),
    pool_tokens=st.integers(40, 256),  # small pools preempt
    prefix=st.lists(st.integers(0, VOCAB - 1), max_size=20),
    requests=st.lists(
        st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), st.integers(1, 20)),
        min_size=1,
        max_size=6,
    ),
    arrivals=st.lists(st.integers(0, 6), min_size=6, max_size=6),
)
def test_window_group_keeps_only_the_window(
    block_size, window, max_num_seqs, max_num_batched_tokens, pool_tokens, prefix, requests, arrivals
):
    max_model_len = 64
    num_blocks = -(-pool_tokens // block_size)
    num_window_blocks = window_pool_blocks(
        window, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, max_chunk=max_num_batched_tokens
    )
    scheduler = Scheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size=block_size,
    )
    bm = BlockManager(num_blocks, block_size, window=window, num_window_blocks=num_window_blocks)
    runner = TwoGroupRunner(block_size, window)
    bound = math.ceil((window - 1 + max_num_batched_tokens) / block_size) + 1
    pending = [
        (arrivals[i], _request(f"r{i}", prefix + tail, max_tokens)) for i, (tail, max_tokens) in enumerate(requests)
    ]
    steps = 0
    while pending or scheduler.has_unfinished():
        for arrival, request in [p for p in pending if p[0] <= steps]:
            scheduler.add_request(request)
            pending.remove((arrival, request))
        steps += 1
        assert steps < 2000, "requests still unfinished"
        output = scheduler.schedule(bm)
        scheduler.update_from_output(output, runner.execute(output, scheduler))
        scheduler.check_invariants()
        bm.check_invariants(scheduler.block_holders())
        _check_window_holdings(bm, scheduler, bound)
        budget = bm.statistics()
        assert budget.num_window_blocks == num_window_blocks - 1
        assert budget.num_used_window_blocks <= max_num_seqs * bound
    scheduler.free_finished(bm)
    bm.check_invariants({})
    budget = bm.statistics()
    assert budget.num_free_blocks == num_blocks
    assert budget.num_free_window_blocks == num_window_blocks - 1


def _admit(bm: BlockManager, rid: str, tokens: list[int]) -> KVResult:
    return bm.apply(KVBatch(allocations=[KVAllocation(rid, 0, len(tokens), tokens)]))


def _grow(bm: BlockManager, rid: str, computed: int, num_new: int, commit: tuple[int, ...] = ()) -> KVResult:
    commits = [KVCommit(rid, commit)] if commit else []
    return bm.apply(KVBatch(commits=commits, allocations=[KVAllocation(rid, computed, num_new)]))


def test_a_hit_needs_the_window_group_to_hold_the_window_before_it():
    # Block size 2, window 3: a query at position p reads p - 2 .. p.
    bm = BlockManager(32, 2, window=3, num_window_blocks=10)
    tokens = list(range(12))
    result = _admit(bm, "a", tokens)
    assert result.num_cached_tokens == (0,)
    assert NULL_BLOCK not in result.window_tables[0]
    # Computed all 12, then decode from 12: blocks 0..4 (positions 0-9) fall out of the window.
    result = _grow(bm, "a", 12, 1, commit=tokens)
    window = result.window_tables[0]
    assert window[:5] == (NULL_BLOCK,) * 5 and NULL_BLOCK not in window[5:]
    bm.check_invariants({"a": result.block_tables[0]})
    # Another request with the same 12 tokens and more: its hit of 12 tokens
    # (6 blocks, the last token never served) needs window block 5 only
    # (positions 10, 11 for a query at 12): still cached, so the hit stands.
    result = _admit(bm, "b", tokens + [99])
    assert result.num_cached_tokens == (12,)
    assert result.window_tables[0][:5] == (NULL_BLOCK,) * 5
    assert result.window_tables[0][5] == window[5]  # shared, as the full blocks are
    # A third admission of the first 9 tokens needs window block 3 (positions
    # 6, 7 for a query at 8), released by "a" but still cached: a hit of 8.
    assert bm.cached_prefix_len(tokens[:8] + [77]) == 8
    # Taking every window block evicts the released windows: the full
    # group still caches the prefix, but no hit is usable now.
    bm.apply(KVBatch(frees=["a", "b"]))
    fill = _admit(bm, "fill", [50 + i for i in range(18)])
    assert fill.block_tables[0] is not None
    bm.apply(KVBatch(frees=["fill"]))
    result = _admit(bm, "c", tokens[:8] + [77])
    assert result.num_cached_tokens == (0,)
    bm.check_invariants({"c": result.block_tables[0]})


def test_a_model_without_a_window_group_answers_as_before():
    bm = BlockManager(8, 2)
    result = _admit(bm, "a", [1, 2, 3])
    assert result.window_tables == ()
    assert bm.statistics().num_window_blocks == 0


# -- the engine ------------------------------------------------------------------

WINDOW = 8
BLOCK = 4
MAX_CHUNK = 16


def _hf_config(kind: str):
    small = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if kind == "gemma3":
        # Interleaved as Gemma 3 is (sliding, then a global layer), each with its own rotary.
        config = transformers.Gemma3TextConfig(
            **small, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000.0}},
        )  # fmt: skip
        config.architectures = ["Gemma3ForCausalLM"]
    elif kind == "gpt-oss":
        # Sliding and full layers alternating, attention sinks, experts.
        config = transformers.GptOssConfig(
            **small, num_hidden_layers=3, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
            num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        )  # fmt: skip
        config.architectures = ["GptOssForCausalLM"]
    else:
        # Mistral v0.1: every layer slides.
        config = transformers.MistralConfig(**small, num_hidden_layers=2, sliding_window=WINDOW)
        config.architectures = ["MistralForCausalLM"]
    return config


@pytest.fixture(scope="module", params=["gemma3", "gpt-oss", "mistral-window"])
def window_loaded(request, tmp_path_factory) -> LoadedModel:
    """A tiny model with sliding layers, seeded random weights peaked enough
    that greedy choices do not hinge on rounding, and a word tokenizer."""
    hf = _hf_config(request.param)
    config = ModelConfig.from_hf_config(hf.to_dict())
    model = LlamaForCausalLM(config, dtype=torch.float32, device="cpu")
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1]) * 2)
    model.eval()
    folder = tmp_path_factory.mktemp(request.param)
    write_word_tokenizer(folder, config.vocab_size)
    return LoadedModel(
        model=model,
        model_config=config,
        tokenizer=FastTokenizer.from_folder(folder),
        name=request.param,
        path=folder,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def _core(loaded: LoadedModel, **overrides) -> EngineCore:
    config = dict(
        block_size=BLOCK, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=MAX_CHUNK,
        kv_cache_memory=4 << 20, kv_cache_dtype="float32", warm_up=False,
    )  # fmt: skip
    config.update(overrides)
    return EngineCore(loaded, EngineConfig(**config))


def _generate(core: EngineCore, requests: list[tuple[str, list[int]]], *, max_tokens: int = 40) -> dict[str, dict]:
    """Run ``requests`` in order, each admitted after the one before finished
    (so a later one may hit what an earlier one cached); check after every
    step that the window group holds no more than each sequence's window."""
    bound = math.ceil((WINDOW - 1 + MAX_CHUNK) / BLOCK) + 1
    results = {}
    for rid, prompt in requests:
        core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        tokens, cached = [], 0
        while core.has_unfinished():
            for out in core.step():
                tokens.extend(out.new_token_ids)
                if out.finished:
                    cached = out.num_cached_tokens
            holders = core.scheduler.block_holders()
            core.block_manager.check_invariants(holders)
            if core.block_manager.window is not None:
                budget = core.block_manager.statistics()
                assert budget.num_used_window_blocks <= len(holders) * bound, budget
        results[rid] = {"tokens": tokens, "cached": cached}
    return results


def _prompts(vocab: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, vocab) for _ in range(30)]
    return [
        ("first", shared + [rng.randrange(3, vocab) for _ in range(5)]),
        ("second", shared + [rng.randrange(3, vocab) for _ in range(7)]),
    ]


def test_the_window_group_keeps_the_tokens_and_frees_the_rest(window_loaded, monkeypatch):
    prompts = _prompts(window_loaded.model_config.vocab_size)
    core = _core(window_loaded)
    cache = core.kv_cache
    assert core.block_manager.window == WINDOW and cache.window is not None
    # The sliding layers' pool is the smaller: its blocks, and so its bytes
    # (resident ones too on CPU: it is mapped, committed as written).
    assert cache.window.num_blocks < cache.num_blocks
    layers = window_loaded.model_config.num_hidden_layers
    assert cache.nbytes < cache.num_blocks * layers * BLOCK * cache.token_bytes
    split = _generate(core, prompts)
    # 35 + 40 tokens, ten windows long; and the second request hit the
    # prefix the first left in the cache, the window before it included.
    assert split["second"]["cached"] >= 24
    stats = core.block_manager.statistics()
    assert stats.num_cached_window_blocks > 0 and stats.num_free_window_blocks == stats.num_window_blocks

    # Speculation verifies proposals on window tables and rolls rejected
    # tokens back; greedy, it gives the same tokens.
    speculating = _core(window_loaded, speculative="ngram")
    assert _generate(speculating, prompts) == split
    assert speculating.scheduler.statistics().num_draft_tokens > 0

    # The same engine with the sliding layers on the full pool, only masked.
    monkeypatch.setattr(kv_pool, "window_group", lambda *args: None)
    monkeypatch.setattr(build, "window_group", lambda *args: None)
    shared = _core(window_loaded)
    assert shared.block_manager.window is None and shared.kv_cache.window is None
    assert _generate(shared, prompts) == split
    # Same request, same tokens whatever the cache: the second alone, cold.
    cold = _core(window_loaded, enable_prefix_caching=False)
    assert _generate(cold, prompts[1:])["second"]["tokens"] == split["second"]["tokens"]


def test_split_for_window_grows_the_pool_into_the_bytes_left():
    # 64 blocks of 2048 bytes, 1536 of them the sliding layers'.
    plan = KVPoolPlan(64, BLOCK, 2048, "float32", "kv_cache_memory 128.0 KiB")
    split = split_for_window(plan, full_bytes_per_block=512, window_blocks=lambda n: 1 + min(n, 56), wanted=128)
    assert (split.num_blocks, split.window_blocks) == (85, 57)
    assert split.nbytes == 85 * 512 + 57 * 1536 <= plan.nbytes
    assert "21 blocks more" in split.reason and split.as_json()["window_blocks"] == 57
    # Every layer slides: the others' blocks cost nothing, up to what is wanted.
    every = split_for_window(plan, full_bytes_per_block=0, window_blocks=lambda n: 1 + min(n, 56), wanted=128)
    assert (every.num_blocks, every.window_blocks) == (128, 57) and every.nbytes <= plan.nbytes
    # A window pool as large as the plan leaves nothing: the plan stays.
    same = split_for_window(plan, full_bytes_per_block=512, window_blocks=lambda n: 1 + n, wanted=128)
    assert same.num_blocks == 64 and same.reason == plan.reason


def test_the_engine_plans_the_split_within_its_budget(window_loaded):
    config = window_loaded.model_config
    budget = 64 * kv_bytes_per_block(config, BLOCK, torch.float32)
    core = _core(window_loaded, kv_cache_memory=budget)
    assert core.num_blocks > 64  # the bytes the window pool left went to more blocks
    assert core.kv_cache.nbytes == core.kv_pool.nbytes <= budget
    assert core.kv_cache.window.num_blocks == core.kv_pool.window_blocks == core.block_manager.num_window_blocks
