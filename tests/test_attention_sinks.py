"""Attention sinks (gpt-oss) in paged attention, against transformers.

The reference is transformers' own ``eager_attention_forward`` of gpt-oss,
run one query token at a time over the keys that token may see (its
sequence's positions up to its own, within the window if there is one), so
the sink's math is transformers' exactly. Batches mix decode rows with
prefill chunks from position 0 and over a cached prefix, so both of
``paged_attention``'s paths take the sinks.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import TEST_DEVICE
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from trioserve.engine.layers.attention import AttentionMetadata, paged_attention, write_kv
from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk
from trioserve.engine.layers.kv_cache import KVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 8, 4
NUM_BLOCKS = 64
SCALE = HEAD_DIM**-0.5


def _sinks(seed: int = 2) -> torch.Tensor:
    # Large enough that a sink takes a real share of a head's weight.
    return torch.randn(HEADS, generator=torch.Generator().manual_seed(seed)) * 2


def _batch() -> list[SeqChunk]:
    blocks = list(range(NUM_BLOCKS))
    random.Random(3).shuffle(blocks)
    tables = [blocks[i * 8 : (i + 1) * 8] for i in range(6)]
    return [
        SeqChunk([1], 13, tables[0]),
        SeqChunk([2] * 6, 0, tables[1]),  # a prefill from position 0
        SeqChunk([3], 4, tables[2]),
        SeqChunk([4] * 5, 9, tables[3], num_logits=5),  # a prefill over a cached prefix
        SeqChunk([5], 0, tables[4]),
        SeqChunk([6], 27, tables[5]),
    ]


def _reference(query, kv: KVCache, chunks, sinks, window) -> torch.Tensor:
    """Each query token through transformers' gpt-oss eager attention over
    the slots it sees, in position order; on CPU."""
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=HEADS // KV_HEADS, training=False)
    keys = kv.key[0].cpu().reshape(-1, KV_HEADS, HEAD_DIM)
    values = kv.value[0].cpu().reshape(-1, KV_HEADS, HEAD_DIM)
    query = query.cpu()
    rows = []
    t = 0
    for c in chunks:
        for i in range(len(c.token_ids)):
            pos = c.start_position + i
            first = 0 if window is None else max(0, pos - window + 1)
            slots = [c.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, pos + 1)]
            q = query[t].view(1, HEADS, 1, HEAD_DIM)
            k = keys[slots].permute(1, 0, 2).unsqueeze(0)  # [1, kv_heads, seen, d]
            v = values[slots].permute(1, 0, 2).unsqueeze(0)
            out, _ = eager_attention_forward(module, q, k, v, None, SCALE)
            rows.append(out.reshape(-1))
            t += 1
    return torch.stack(rows)


def _attend(chunks, sinks, *, window=None, chunk_bytes=None):
    torch.manual_seed(0)
    kv = KVCache(
        key=(torch.randn(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM) * 3).to(TEST_DEVICE),
        value=torch.randn(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM).to(TEST_DEVICE),
    )
    batch = ForwardBatch.build(chunks, block_size=BLOCK, device=TEST_DEVICE)
    query = torch.randn(batch.num_tokens, HEADS, HEAD_DIM).to(TEST_DEVICE)
    key = (torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM) * 3).to(TEST_DEVICE)
    value = torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM).to(TEST_DEVICE)
    write_kv(key, value, kv.key[0], kv.value[0], batch.slot_mapping)
    meta = AttentionMetadata.build(batch, kv, decode_chunk_bytes=chunk_bytes)
    sinks_here = None if sinks is None else sinks.to(TEST_DEVICE)
    out = paged_attention(
        query, key, value, kv.key[0], kv.value[0], meta, scale=SCALE, window=window, sinks=sinks_here
    )
    return out.cpu(), query, kv


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_sinks_match_transformers_on_decode_and_prefill_rows(window, chunk_bytes):
    chunks = _batch()
    sinks = _sinks()
    out, query, kv = _attend(chunks, sinks, window=window, chunk_bytes=chunk_bytes)
    ref = _reference(query, kv, chunks, sinks, window)
    assert (out - ref).abs().max() < 1e-5


def test_sinks_change_the_output_and_zero_weight_sinks_do_not():
    # A sink of -inf takes no weight: plain attention. A finite sink scales
    # every key's weight down, so the output differs.
    chunks = _batch()
    plain, _, _ = _attend(chunks, None, window=3)
    gone, _, _ = _attend(chunks, torch.full((HEADS,), float("-inf")), window=3)
    sunk, _, _ = _attend(chunks, _sinks(), window=3)
    assert (gone - plain).abs().max() < 1e-5
    assert (sunk - plain).abs().max() > 1e-2


def test_a_decode_plan_from_device_tables_takes_the_sinks():
    # The CUDA-graph plan (``for_decode_tables``): padded rows, a mask.
    contexts = [1, 5, 12]
    blocks = list(range(NUM_BLOCKS))
    random.Random(7).shuffle(blocks)
    tables = [blocks[i * 4 : (i + 1) * 4] for i in range(len(contexts))]
    chunks = [SeqChunk([0], ctx - 1, table) for ctx, table in zip(contexts, tables)]
    torch.manual_seed(0)
    kv = KVCache(
        key=(torch.randn(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM) * 3).to(TEST_DEVICE),
        value=torch.randn(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM).to(TEST_DEVICE),
    )
    query = torch.randn(len(chunks), HEADS, HEAD_DIM).to(TEST_DEVICE)
    meta = AttentionMetadata.for_decode_tables(
        torch.tensor(tables, device=TEST_DEVICE), torch.tensor(contexts, device=TEST_DEVICE), kv
    )
    sinks = _sinks(5)
    out = paged_attention(query, None, None, kv.key[0], kv.value[0], meta, scale=SCALE, sinks=sinks.to(TEST_DEVICE))
    assert (out.cpu() - _reference(query, kv, chunks, sinks, None)).abs().max() < 1e-5


def test_sinks_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="one logit per head"):
        _attend(_batch(), torch.zeros(KV_HEADS))
