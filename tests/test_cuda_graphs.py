"""CUDA graphs for decode steps (engine/runtime/cuda_graphs.py).

The shapes, the padding and the static inputs are checked on any device: a
recorder that replays a step by running it again over the same static
buffers stands in for ``torch.cuda.CUDAGraph`` on CPU, so a step that
closed over one batch's values instead of reading the buffers would give
the next batch wrong logits here too. With TRIOSERVE_TEST_DEVICE=cuda the
same tests record real graphs (``CudaGraphRecorder``), and the engine
builds them itself.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import ON_CUDA, TEST_DEVICE

from trioserve.engine.config import EngineConfig
from trioserve.engine.runtime.cuda_graphs import (
    CudaGraphRecorder,
    DecodeGraphs,
    GraphShape,
    Recording,
    graph_batch_sizes,
)
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.text.fast_tokenizer import FastTokenizer
from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk
from trioserve.engine.layers.kv_cache import KVCache, kv_bytes_per_block
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.testing.tiny_model import BLOCK_SIZE as ENGINE_BLOCK_SIZE
from trioserve.testing.tiny_model import VOCAB_SIZE, engine_config, tiny_loaded_with, write_word_tokenizer

BLOCK = 4
NUM_BLOCKS = 96
# Logits reach about 20: float32 sums in another order (a padded batch, a
# longer masked span) move them by well under this; a wrong input by units.
ATOL = 5e-4


def rerun(step) -> Recording:
    """A graph's stand-in off CUDA: replay runs ``step`` again and leaves
    its result where the first run's was."""
    output = step()
    return Recording(lambda: output.copy_(step()), output)


def _recorder():
    return CudaGraphRecorder(torch.device(TEST_DEVICE)) if ON_CUDA else rerun


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    # A word-level tokenizer rather than the default model's, whose file a
    # lent GPU machine does not have; the tiny model's peaked weights, so
    # greedy choices do not hinge on float rounding.
    folder = tmp_path_factory.mktemp("words")
    write_word_tokenizer(folder, VOCAB_SIZE)
    return tiny_loaded_with(FastTokenizer.from_folder(folder), TEST_DEVICE)


def _cache(loaded) -> KVCache:
    return KVCache.allocate(loaded.model_config, num_blocks=NUM_BLOCKS, block_size=BLOCK, dtype=torch.float32,
                            device=TEST_DEVICE)  # fmt: skip


def _graphs(loaded, kv: KVCache, record=None, **fields) -> DecodeGraphs:
    fields.setdefault("batch_sizes", graph_batch_sizes(16))
    fields.setdefault("max_width", 16)
    return DecodeGraphs(loaded.model, kv, record or _recorder(), **fields)


def _prefilled(loaded, lengths: list[int], seed: int = 0) -> tuple[KVCache, list[list[int]]]:
    """A cache holding one prompt of each length, on scattered blocks."""
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    tables = [blocks[i * 16 : (i + 1) * 16] for i in range(len(lengths))]
    rng = random.Random(seed + 1)
    vocab = loaded.model_config.vocab_size
    chunks = [SeqChunk([rng.randrange(3, vocab) for _ in range(n)], 0, t, 1) for n, t in zip(lengths, tables)]
    kv = _cache(loaded)
    with torch.inference_mode():
        loaded.model(ForwardBatch.build(chunks, block_size=BLOCK, device=TEST_DEVICE), kv)
    return kv, tables


def _eager(loaded, kv: KVCache, chunks: list[SeqChunk]) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(ForwardBatch.build(chunks, block_size=BLOCK, device=TEST_DEVICE), kv)


def _decodes(tables, contexts, tokens) -> list[SeqChunk]:
    """One decode token per sequence, at position ``context - 1``."""
    return [SeqChunk([tok], ctx - 1, table) for tok, ctx, table in zip(tokens, contexts, tables)]


def test_graph_batch_sizes_cover_every_batch_up_to_max_num_seqs():
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(3) == (1, 2, 4)
    assert graph_batch_sizes(5) == (1, 2, 4, 8)
    assert graph_batch_sizes(8) == (1, 2, 4, 8)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_batch_sizes(10_000)[-1] == 512
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


def test_only_decode_steps_that_fit_take_a_graph(loaded):
    kv = _cache(loaded)
    graphs = _graphs(loaded, kv, batch_sizes=graph_batch_sizes(8), max_width=12)
    table = list(range(16))
    decode = SeqChunk([5], 9, table)  # position 9: 10 tokens, 3 blocks
    assert graphs.shape_of([decode]) == GraphShape(rows=1, width=4)
    assert graphs.shape_of([decode] * 3) == GraphShape(rows=4, width=4)
    assert graphs.shape_of([decode] * 5) == GraphShape(rows=8, width=4)
    assert graphs.shape_of([SeqChunk([5], 0, table)]) == GraphShape(rows=1, width=1)
    # Widths go up in powers of two, up to a whole max_model_len's blocks.
    assert graphs.shape_of([SeqChunk([5], 4 * BLOCK, table)]) == GraphShape(rows=1, width=8)
    assert graphs.shape_of([SeqChunk([5], 12 * BLOCK - 1, table)]) == GraphShape(rows=1, width=12)
    # Not decode-only: a prompt chunk, a chunk without logits, a speculating chunk.
    assert graphs.shape_of([decode, SeqChunk([5, 6], 9, table)]) is None
    assert graphs.shape_of([SeqChunk([5], 9, table, num_logits=0)]) is None
    assert graphs.statistics().eager_steps == 0
    # Decode-only, but too many rows, too long a context, too much to gather.
    assert graphs.shape_of([decode] * 9) is None
    assert graphs.shape_of([SeqChunk([5], 12 * BLOCK, table)]) is None
    token_bytes = 2 * loaded.model_config.num_key_value_heads * loaded.model_config.head_dim * 4
    small = _graphs(loaded, kv, max_width=12, max_gather_bytes=2 * 4 * BLOCK * token_bytes)
    assert small.shape_of([decode] * 2) == GraphShape(rows=2, width=4)
    assert small.shape_of([decode] * 3) is None
    assert graphs.statistics().eager_steps == 2 and small.statistics().eager_steps == 1


def test_replays_match_eager_steps_and_write_only_their_own_slots(loaded):
    lengths = [5, 9, 13]
    kv, tables = _prefilled(loaded, lengths)
    graphs = _graphs(loaded, kv)
    # Step 1: three rows padded to four, contexts within 4 blocks.
    contexts, tokens = [n + 1 for n in lengths], [7, 8, 9]
    chunks = _decodes(tables, contexts, tokens)
    reference = KVCache(kv.key.clone(), kv.value.clone())
    expected = _eager(loaded, reference, chunks)
    before = KVCache(kv.key.clone(), kv.value.clone())
    with torch.inference_mode():
        got = graphs.run(chunks)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert (got - expected).abs().max() < ATOL
    assert graphs.statistics().graphs == 1 and graphs.statistics().replays == 1
    # The padding row repeated row 0 into row 0's slot: every other slot
    # of the pool, other sequences' included, is as it was.
    written = {t[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK for t, c in zip(tables, contexts)}
    for pool, old, ref in ((kv.key, before.key, reference.key), (kv.value, before.value, reference.value)):
        flat, flat_old, flat_ref = (p.view(p.shape[0], -1, *p.shape[3:]) for p in (pool, old, ref))
        others = [s for s in range(NUM_BLOCKS * BLOCK) if s not in written]
        assert torch.equal(flat[:, others], flat_old[:, others])
        assert (flat[:, sorted(written)] - flat_ref[:, sorted(written)]).abs().max() < ATOL

    # Step 2, the same shape with other tokens and contexts: the replay reads
    # the new inputs, not the recorded ones.
    contexts, tokens = [c + 1 for c in contexts], [11, 12, 13]
    chunks = _decodes(tables, contexts, tokens)
    expected = _eager(loaded, reference, chunks)
    with torch.inference_mode():
        got = graphs.run(chunks)
    assert (got - expected).abs().max() < ATOL
    assert graphs.statistics().graphs == 1 and graphs.statistics().replays == 2

    # Step 3: two rows (a shape of its own), one now past 4 blocks (width 8).
    contexts = [20, contexts[1] + 1]
    chunks = _decodes([tables[0], tables[1]], contexts, [14, 15])
    # Row 0 skipped positions 6..18: fill them as the eager cache has them.
    expected = _eager(loaded, reference, chunks)
    kv.key.copy_(reference.key)
    kv.value.copy_(reference.value)
    with torch.inference_mode():
        got = graphs.run(chunks)
    assert (got - expected).abs().max() < ATOL
    stats = graphs.statistics()
    assert (stats.graphs, stats.replays, stats.eager_steps, stats.disabled) == (2, 3, 0, None)


def test_a_graph_that_cannot_be_recorded_turns_graphs_off(loaded):
    kv, tables = _prefilled(loaded, [6])

    def refuse(step):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = _graphs(loaded, kv, record=refuse)
    chunks = _decodes(tables, [7], [5])
    with torch.inference_mode():
        assert graphs.run(chunks) is None
    stats = graphs.statistics()
    assert stats.graphs == 0 and "1 rows x 2 blocks failed: operation not permitted" in stats.disabled
    assert graphs.shape_of(chunks) is None  # from now on every step runs eagerly


def test_bad_block_tables_are_refused_before_anything_runs(loaded):
    kv, _ = _prefilled(loaded, [6])
    graphs = _graphs(loaded, kv)
    with pytest.raises(ValueError, match="chunk 1: block_table has 1 blocks, position 9 needs 3"):
        graphs.run([SeqChunk([5], 2, [0]), SeqChunk([5], 9, [1])])
    assert graphs.statistics().graphs == 0


def _workload(core: EngineCore, vocab: int) -> dict[str, list[int]]:
    rng = random.Random(5)
    # More requests than sequences, prompts of uneven lengths (chunked by
    # the token budget, sharing steps with decodes) and n=2.
    for i in range(7):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))]
        params = SamplingParams(max_tokens=rng.randrange(8, 30), temperature=0.0, ignore_eos=True, n=1 + (i == 3))
        core.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(f"{out.request_id}/{out.index}", []).extend(out.new_token_ids)
    return tokens


def test_an_engine_gives_the_same_greedy_tokens_with_graphs_as_without(loaded):
    blocks = 96 * kv_bytes_per_block(loaded.model_config, ENGINE_BLOCK_SIZE, torch.float32)
    fields = dict(max_num_seqs=5, max_num_batched_tokens=32, device=TEST_DEVICE, kv_cache_memory=blocks)
    vocab = loaded.model_config.vocab_size
    eager = EngineCore(loaded, engine_config(enforce_eager=True, **fields))
    assert eager.runner.decode_graphs is None
    core = EngineCore(loaded, engine_config(**fields))
    if ON_CUDA:
        assert core.runner.decode_graphs is not None  # built by the engine itself
    else:
        assert core.runner.decode_graphs is None  # nothing to record on CPU
        core.runner.decode_graphs = DecodeGraphs(
            loaded.model, core.runner.kv_cache, rerun, graph_batch_sizes(5), max_width=256 // ENGINE_BLOCK_SIZE
        )
    expected = _workload(eager, vocab)
    got = _workload(core, vocab)
    assert got == expected
    stats = core.runner.decode_graphs.statistics()
    assert stats.replays > 20 and 2 <= stats.graphs <= 8 and stats.disabled is None


def test_enforce_eager_is_a_flag_and_a_checked_config_field():
    # Imported here: the web stack is not on a lent GPU machine, which runs the rest.
    from trioserve.web.cli import build_parser
    from trioserve.web.engine_options import engine_config_from_args

    assert not EngineConfig().enforce_eager
    args = build_parser().parse_args(["generate", "--enforce-eager", "hi"])
    assert engine_config_from_args(args).enforce_eager
    assert not engine_config_from_args(build_parser().parse_args(["generate", "hi"])).enforce_eager
    assert build_parser().parse_args(["bench", "offline", "--enforce-eager"]).enforce_eager
    with pytest.raises(TypeError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")


def test_graphs_are_chosen_on_cuda_only_and_not_when_eager(loaded):
    kv = _cache(loaded)
    choose = dict(max_num_seqs=24, max_model_len=100)
    assert DecodeGraphs.choose(loaded.model, kv, enforce_eager=True, **choose) is None
    graphs = DecodeGraphs.choose(loaded.model, kv, enforce_eager=False, **choose)
    if ON_CUDA:
        assert graphs.batch_sizes == (1, 2, 4, 8, 16, 24) and graphs.max_width == 25
    else:
        assert graphs is None
