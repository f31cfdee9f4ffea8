"""Attention over a paged KV cache, in plain torch.

The model calls two functions per layer: ``write_kv`` stores the step's new
keys and values at their slots, then ``paged_attention`` attends every query
token over its sequence's cache. Everything that depends only on the batch
(which tokens decode, which blocks each sequence reads, the masks) is planned
once per forward in ``AttentionMetadata``, not once per layer. A faster
kernel can replace these two functions and keep the metadata.

Keys and values are never repeated per query head (GQA): decode stacks a
KV head's group of query heads along the query axis, prefill broadcasts each
KV head over its group with a stride-0 view. Both run on torch's
``scaled_dot_product_attention``, on CPU and CUDA alike.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from .forward_batch import ForwardBatch
from .kv_cache import KVCache


@attrs.frozen
class PrefillPlan:
    """One sequence with more than one query token."""

    token_start: int  # its query tokens are rows token_start:token_end of the batch
    token_end: int
    # Block ids holding its context, or None when the chunk is the whole
    # context (it starts at position 0): then its fresh keys and values are
    # used as they are, with no read from the cache, under a plain causal mask.
    context_blocks: torch.Tensor | None
    context_len: int
    # [query_len, context_len] bool, True where a query may attend: causal,
    # offset by the cached prefix. None when context_blocks is None.
    mask: torch.Tensor | None


@attrs.frozen
class AttentionMetadata:
    """The per-forward plan of which rows decode and which prefill.

    Decode rows (query length 1) are attended in one batched call over a
    padded ``[D, S, kv_heads, head_dim]`` gather of their blocks; prefill
    chunks one sequence at a time.
    """

    num_tokens: int
    block_size: int
    # Batch rows of the decode tokens; None when every token decodes, in order.
    decode_token_indices: torch.Tensor | None
    decode_blocks: torch.Tensor | None  # [D * max_blocks] block ids, row-major
    decode_max_blocks: int
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool
    # [D * max_blocks, block_size, kv_heads, head_dim] scratch for the gathered
    # keys and values, shared by all layers: a fresh multi-MB allocation per
    # layer costs page faults that took longer than the gather itself.
    decode_key_buffer: torch.Tensor | None
    decode_value_buffer: torch.Tensor | None
    prefills: tuple[PrefillPlan, ...]

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_mask is None else int(self.decode_mask.shape[0])

    @classmethod
    def build(cls, batch: ForwardBatch, kv_cache: KVCache) -> AttentionMetadata:
        """Plan ``batch`` from its host-side lengths; no device sync."""
        device = batch.input_ids.device
        block_size = kv_cache.block_size
        decode_rows: list[int] = []
        decode_tokens: list[int] = []
        prefills: list[PrefillPlan] = []
        offset = 0
        for row, (qlen, ctx) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu)):
            if qlen == 1:
                decode_rows.append(row)
                decode_tokens.append(offset)
            else:
                start = ctx - qlen
                blocks = mask = None
                if start > 0:
                    blocks = batch.block_tables[row, : -(-ctx // block_size)]
                    # Query i sits at position start + i and sees keys 0 .. start + i.
                    mask = torch.ones(qlen, ctx, dtype=torch.bool, device=device).tril(start)
                prefills.append(PrefillPlan(offset, offset + qlen, blocks, ctx, mask))
            offset += qlen
        decode_blocks = decode_mask = token_indices = key_buffer = value_buffer = None
        max_blocks = 0
        if decode_rows:
            max_ctx = max(batch.context_lens_cpu[r] for r in decode_rows)
            max_blocks = -(-max_ctx // block_size)
            if len(decode_rows) == batch.num_seqs:
                tables = batch.block_tables[:, :max_blocks]
                ctx_lens = batch.context_lens
            else:
                rows = torch.tensor(decode_rows, dtype=torch.int64, device=device)
                tables = batch.block_tables[rows, :max_blocks]
                ctx_lens = batch.context_lens[rows]
                token_indices = torch.tensor(decode_tokens, dtype=torch.int64, device=device)
            decode_blocks = tables.reshape(-1)
            span = torch.arange(max_blocks * block_size, device=device)
            decode_mask = (span[None, :] < ctx_lens[:, None])[:, None, None, :]
            shape = (decode_blocks.shape[0], *kv_cache.key.shape[2:])
            key_buffer = kv_cache.key.new_empty(shape)
            value_buffer = kv_cache.value.new_empty(shape)
        return cls(
            num_tokens=batch.num_tokens,
            block_size=block_size,
            decode_token_indices=token_indices,
            decode_blocks=decode_blocks,
            decode_max_blocks=max_blocks,
            decode_mask=decode_mask,
            decode_key_buffer=key_buffer,
            decode_value_buffer=value_buffer,
            prefills=tuple(prefills),
        )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` (``[T, kv_heads, head_dim]``) at ``slot_mapping``
    in one layer's ``[num_blocks, block_size, kv_heads, head_dim]`` pools."""
    kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
) -> torch.Tensor:
    """Attend ``query`` (``[T, heads, head_dim]``) over each sequence's cache.

    ``key``/``value`` (``[T, kv_heads, head_dim]``) are the step's fresh
    keys and values, already written to the cache with ``write_kv``; a
    prefill chunk that starts at position 0 reads them directly. Returns
    ``[T, heads * head_dim]``.
    """
    num_tokens, heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    if meta.num_decodes == num_tokens:
        return _decode(query, key_cache, value_cache, meta, scale).view(num_tokens, heads * head_dim)
    out = query.new_empty(num_tokens, heads * head_dim)
    if meta.num_decodes:
        q = query.index_select(0, meta.decode_token_indices)
        out.index_copy_(0, meta.decode_token_indices, _decode(q, key_cache, value_cache, meta, scale).flatten(1))
    for p in meta.prefills:
        qlen = p.token_end - p.token_start
        # [qlen, heads, d] -> [kv_heads, group, qlen, d]: a view, no copy.
        q = query[p.token_start : p.token_end].view(qlen, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        if p.context_blocks is None:
            k = key[p.token_start : p.token_end]
            v = value[p.token_start : p.token_end]
        else:
            k = key_cache.index_select(0, p.context_blocks).view(-1, kv_heads, head_dim)[: p.context_len]
            v = value_cache.index_select(0, p.context_blocks).view(-1, kv_heads, head_dim)[: p.context_len]
        # Each KV head broadcast over its group with a stride-0 view: GQA
        # without copying keys and values per query head.
        shape = (kv_heads, group, k.shape[0], head_dim)
        k = k.permute(1, 0, 2).unsqueeze(1).expand(shape)
        v = v.permute(1, 0, 2).unsqueeze(1).expand(shape)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale)
        # [kv_heads, group, qlen, d] -> [qlen, heads * d]
        out[p.token_start : p.token_end] = o.permute(2, 0, 1, 3).reshape(qlen, heads * head_dim)
    return out


def _decode(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Batched attention of ``D`` single-token queries; returns ``[D, heads, head_dim]``."""
    num_decodes, heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    span = meta.decode_max_blocks * meta.block_size
    # A block-wise gather moves block_size rows per index: far cheaper than per token.
    k = torch.index_select(key_cache, 0, meta.decode_blocks, out=meta.decode_key_buffer)
    v = torch.index_select(value_cache, 0, meta.decode_blocks, out=meta.decode_value_buffer)
    k = k.view(num_decodes, span, kv_heads, head_dim)
    v = v.view(num_decodes, span, kv_heads, head_dim)
    q = query.view(num_decodes, kv_heads, heads // kv_heads, head_dim)
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=meta.decode_mask, scale=scale)
    return o.view(num_decodes, heads, head_dim)
