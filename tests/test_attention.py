"""Paged attention against a plain per-sequence reference.

Every plan (one decode chunk or many, masked or not, gathered or read in
place, decode rows reordered around prefill chunks) must give the same
output as attending each sequence's keys in position order.

The cache, the batch and the attention run on TEST_DEVICE
(TRIOSERVE_TEST_DEVICE, default CPU); the reference always runs on CPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TEST_DEVICE

from trioserve.engine.layers.attention import AttentionMetadata, paged_attention, write_kv
from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk
from trioserve.engine.layers.kv_cache import KVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 8, 4
NUM_BLOCKS = 64
TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * 4  # keys and values of one token, float32


def _cache() -> KVCache:
    torch.manual_seed(0)
    key = torch.randn(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM) * 3
    value = torch.randn(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    return KVCache(key=key.to(TEST_DEVICE), value=value.to(TEST_DEVICE))


def _reference(query, kv: KVCache, chunks: list[SeqChunk]) -> torch.Tensor:
    """Each query token attends its sequence's positions 0..its own, read
    slot by slot, with every KV head repeated over its group; on CPU."""
    query = query.cpu()
    keys = kv.key[0].cpu().reshape(-1, KV_HEADS, HEAD_DIM)
    values = kv.value[0].cpu().reshape(-1, KV_HEADS, HEAD_DIM)
    group = HEADS // KV_HEADS
    rows = []
    t = 0
    for c in chunks:
        for i in range(len(c.token_ids)):
            pos = c.start_position + i
            slots = [c.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(pos + 1)]
            k = keys[slots].repeat_interleave(group, dim=1)  # [ctx, heads, d]
            v = values[slots].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,thd->ht", query[t], k) * HEAD_DIM**-0.5
            rows.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v).reshape(-1))
            t += 1
    return torch.stack(rows)


def _run(chunks: list[SeqChunk], chunk_bytes: int | None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    kv = _cache()
    batch = ForwardBatch.build(chunks, block_size=BLOCK, device=TEST_DEVICE)
    torch.manual_seed(1)
    query = torch.randn(batch.num_tokens, HEADS, HEAD_DIM).to(TEST_DEVICE)
    key = (torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM) * 3).to(TEST_DEVICE)
    value = torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM).to(TEST_DEVICE)
    write_kv(key, value, kv.key[0], kv.value[0], batch.slot_mapping)
    meta = AttentionMetadata.build(batch, kv, decode_chunk_bytes=chunk_bytes)
    out = paged_attention(query, key, value, kv.key[0], kv.value[0], meta, scale=HEAD_DIM**-0.5)
    assert out.device == kv.key.device
    return out.cpu(), _reference(query, kv, chunks), meta


def _scattered_tables(num: int, seed: int) -> list[list[int]]:
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    per = NUM_BLOCKS // num
    return [blocks[i * per : (i + 1) * per] for i in range(num)]


def _mixed_batch() -> list[SeqChunk]:
    # Decode rows of many context lengths (some equal, some ending mid-block)
    # around a prefill from position 0 and one continuing a cached prefix.
    tables = _scattered_tables(8, seed=3)
    return [
        SeqChunk([1], 13, tables[0]),
        SeqChunk([2] * 6, 0, tables[1]),
        SeqChunk([3], 4, tables[2]),
        SeqChunk([4], 13, tables[3]),
        SeqChunk([5] * 5, 9, tables[4], num_logits=5),
        SeqChunk([6], 0, tables[5]),
        SeqChunk([7], 27, tables[6]),
        SeqChunk([8], 7, tables[7]),
    ]


@pytest.mark.parametrize("chunk_bytes", [None, 1, 8 * BLOCK * TOKEN_BYTES, 1 << 30])
def test_mixed_batch_matches_reference_for_any_chunking(chunk_bytes):
    out, ref, meta = _run(_mixed_batch(), chunk_bytes)
    assert (out - ref).abs().max() < 1e-5
    # Decode rows go longest context first, whatever the chunking.
    assert meta.num_decodes == 6
    assert meta.decode_token_indices.tolist() == [15, 0, 8, 16, 7, 14]
    if chunk_bytes == 1:
        assert len(meta.decode_chunks) == 6  # at least one row per chunk
    if chunk_bytes is None:  # the CPU default holds this whole batch
        assert len(meta.decode_chunks) == 1


def test_chunks_respect_the_budget_and_mask_only_uneven_contexts():
    chunks = _mixed_batch()
    _, _, meta = _run(chunks, 8 * BLOCK * TOKEN_BYTES)
    for c in meta.decode_chunks:
        assert (c.end - c.start) * c.num_blocks <= 8 or c.end - c.start == 1
    by_rows = {(c.start, c.end): c for c in meta.decode_chunks}
    # Contexts in attention order: 28, 14, 14, 8, 5, 1.
    assert [(c.start, c.end, c.context_len) for c in meta.decode_chunks] == [(0, 1, 28), (1, 3, 14), (3, 6, 8)]
    assert by_rows[(0, 1)].mask is None
    assert by_rows[(1, 3)].mask is None  # equal contexts: no mask
    mask = by_rows[(3, 6)].mask
    assert mask.shape == (3, 1, 1, 8)
    assert mask.flatten(1).sum(-1).tolist() == [8, 5, 1]


def test_all_decode_batch_in_batch_order_needs_no_reorder():
    tables = _scattered_tables(4, seed=5)
    chunks = [SeqChunk([i], 10, t) for i, t in enumerate(tables)]
    out, ref, meta = _run(chunks, 2 * 3 * BLOCK * TOKEN_BYTES)
    assert meta.decode_token_indices is None
    assert [(c.start, c.end) for c in meta.decode_chunks] == [(0, 2), (2, 4)]
    assert (out - ref).abs().max() < 1e-5


def test_lone_sequence_on_consecutive_blocks_is_read_in_place():
    chunks = [SeqChunk([1], 21, list(range(10, 20)))]
    out, ref, meta = _run(chunks, None)
    (chunk,) = meta.decode_chunks
    assert chunk.blocks is None and chunk.first_block == 10 and chunk.num_blocks == 6
    assert meta.decode_key_buffer is None
    assert (out - ref).abs().max() < 1e-5


def test_lone_sequence_on_scattered_blocks_is_gathered():
    chunks = [SeqChunk([1], 21, [10, 11, 12, 14, 13, 15])]
    out, ref, meta = _run(chunks, None)
    (chunk,) = meta.decode_chunks
    assert chunk.blocks.tolist() == [10, 11, 12, 14, 13, 15]
    assert (out - ref).abs().max() < 1e-5


def test_a_decode_plan_from_device_tables_matches_the_reference():
    # The plan a CUDA graph records (engine/runtime/cuda_graphs.py): every row
    # gathers the same number of blocks, its table padded with arbitrary
    # valid blocks (stale keys of other sequences) that the mask must hide.
    tables = _scattered_tables(5, seed=7)
    contexts = [1, 4, 5, 11, 12]  # one token, a full block, mid-block, ...
    chunks = [SeqChunk([0], ctx - 1, table) for ctx, table in zip(contexts, tables)]
    width = 8  # more blocks than the longest context (12 tokens: 3) needs
    padded = [table[: -(-ctx // BLOCK)] for ctx, table in zip(contexts, tables)]
    padded = [t + [NUM_BLOCKS - 1 - i] * (width - len(t)) for i, t in enumerate(padded)]
    kv = _cache()
    torch.manual_seed(1)
    query = torch.randn(len(chunks), HEADS, HEAD_DIM).to(TEST_DEVICE)
    meta = AttentionMetadata.for_decode_tables(
        torch.tensor(padded, device=TEST_DEVICE), torch.tensor(contexts, device=TEST_DEVICE), kv
    )
    assert meta.num_decodes == len(chunks) and meta.decode_token_indices is None and not meta.prefills
    (chunk,) = meta.decode_chunks
    assert chunk.num_blocks == width and chunk.context_len == width * BLOCK
    out = paged_attention(query, None, None, kv.key[0], kv.value[0], meta, scale=HEAD_DIM**-0.5)
    assert (out.cpu() - _reference(query, kv, chunks)).abs().max() < 1e-5
