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
``scaled_dot_product_attention``, on CPU and CUDA alike, except where a
layer soft-caps its scores (Gemma 2) or has attention sinks (gpt-oss):
SDPA has neither, so those run in plain torch (``_attend``).

Decode gathers each sequence's blocks into a scratch buffer and attends
over it. On CPU the decode rows go in chunks whose gathered keys and values
fit in the cache (``CPU_DECODE_CHUNK_BYTES``): gathering a whole batch at
once wrote tens of MB per layer that attention then read back from memory,
which cost more than the attention itself. Rows are sorted by context length
so that a chunk reads little past its shortest context.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from trioserve.engine.layers.forward_batch import ForwardBatch
from trioserve.engine.layers.kv_cache import KVCache, as_stored, from_cache, to_cache

# Gathered keys plus values per decode chunk on CPU: within the last-level
# cache, so attention reads what the gather just wrote from cache, not DRAM.
CPU_DECODE_CHUNK_BYTES = 4 << 20


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
class DecodeChunk:
    """Decode rows ``start:end`` (in attention order) attended in one call."""

    start: int
    end: int
    # [(end - start) * num_blocks] block ids, row-major; None when the chunk
    # is one row whose blocks are consecutive from first_block, read in place.
    blocks: torch.Tensor | None
    first_block: int
    num_blocks: int
    context_len: int  # the chunk's longest context; keys past it are not read
    # [end - start, 1, 1, context_len] bool, True where a key is in the row's
    # context; None when every row of the chunk has context_len tokens.
    mask: torch.Tensor | None


@attrs.frozen
class AttentionMetadata:
    """The per-forward plan of which rows decode and which prefill.

    Decode rows (query length 1) are taken longest context first and
    attended in ``decode_chunks``, each one gather of its blocks into the
    shared scratch buffers (or a view of the pool) and one batched attention
    call; prefill chunks go one sequence at a time.
    """

    num_tokens: int
    block_size: int
    num_decodes: int
    # Batch rows of the decode tokens in attention order; None when every
    # token decodes and the order is the batch's.
    decode_token_indices: torch.Tensor | None
    decode_chunks: tuple[DecodeChunk, ...]
    # [blocks of the largest chunk, block_size, kv_heads, head_dim] scratch
    # for the gathered keys and values, shared by all chunks and layers: a
    # fresh multi-MB allocation per layer costs page faults.
    decode_key_buffer: torch.Tensor | None
    decode_value_buffer: torch.Tensor | None
    prefills: tuple[PrefillPlan, ...]
    # Each decode row's context length, in attention order: what a sliding
    # window's mask is made from (built when a layer asks: ``decode_contexts``).
    decode_context_lens: tuple[int, ...] = ()
    decode_context_tensor: torch.Tensor | None = None

    def decode_contexts(self, device: torch.device) -> torch.Tensor:
        """``[D]`` int64 context lengths of the decode rows, in attention order."""
        if self.decode_context_tensor is not None:
            return self.decode_context_tensor
        return torch.tensor(self.decode_context_lens, dtype=torch.int64, device=device)

    @classmethod
    def build(
        cls, batch: ForwardBatch, kv_cache: KVCache, *, decode_chunk_bytes: int | None = None
    ) -> AttentionMetadata:
        """Plan ``batch`` from its host-side lengths and tables; no device sync.

        ``decode_chunk_bytes`` bounds the keys and values one decode chunk
        gathers (a chunk holds at least one row); the default is
        ``CPU_DECODE_CHUNK_BYTES`` on CPU and no bound elsewhere, where one
        gather and one call for the whole batch is fastest.
        """
        device = batch.input_ids.device
        block_size = kv_cache.block_size
        if decode_chunk_bytes is None and device.type == "cpu":
            decode_chunk_bytes = CPU_DECODE_CHUNK_BYTES
        decodes: list[tuple[int, int, int]] = []  # (context_len, batch row of the token, sequence)
        prefills: list[PrefillPlan] = []
        offset = 0
        for seq, (qlen, ctx) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu)):
            if qlen == 1:
                decodes.append((ctx, offset, seq))
            else:
                start = ctx - qlen
                blocks = mask = None
                if start > 0:
                    table = batch.block_tables_cpu[seq][: -(-ctx // block_size)]
                    blocks = torch.tensor(table, dtype=torch.int64, device=device)
                    # Query i sits at position start + i and sees keys 0 .. start + i.
                    mask = torch.ones(qlen, ctx, dtype=torch.bool, device=device).tril(start)
                prefills.append(PrefillPlan(offset, offset + qlen, blocks, ctx, mask))
            offset += qlen
        token_indices = key_buffer = value_buffer = None
        chunks: tuple[DecodeChunk, ...] = ()
        if decodes:
            # Stable: equal contexts keep the batch's order.
            decodes.sort(key=lambda d: -d[0])
            tokens = [d[1] for d in decodes]
            if len(decodes) != batch.num_tokens or tokens != list(range(len(tokens))):
                token_indices = torch.tensor(tokens, dtype=torch.int64, device=device)
            chunks = _plan_decode_chunks(batch, decodes, block_size, kv_cache.token_bytes, decode_chunk_bytes, device)
            largest = max(((c.end - c.start) * c.num_blocks for c in chunks if c.blocks is not None), default=0)
            if largest:
                shape = (largest, *kv_cache.key.shape[2:])
                key_buffer = kv_cache.key.new_empty(shape)
                value_buffer = kv_cache.value.new_empty(shape)
        return cls(
            num_tokens=batch.num_tokens,
            block_size=block_size,
            num_decodes=len(decodes),
            decode_token_indices=token_indices,
            decode_chunks=chunks,
            decode_key_buffer=key_buffer,
            decode_value_buffer=value_buffer,
            prefills=tuple(prefills),
            decode_context_lens=tuple(d[0] for d in decodes),
        )

    @classmethod
    def for_decode_tables(
        cls, block_tables: torch.Tensor, context_lens: torch.Tensor, kv_cache: KVCache
    ) -> AttentionMetadata:
        """Plan a batch whose every row decodes one token, from device
        tensors alone: ``block_tables`` ``[rows, width]`` (each row's blocks,
        padded with any valid block id) and ``context_lens`` ``[rows]``.

        Every row gathers all ``width`` blocks and the mask hides what lies
        past its context, so the plan's shapes depend on ``rows`` and
        ``width`` only and nothing is read back to the host: a CUDA graph
        records it once and replays it with new tables and lengths
        (engine/runtime/cuda_graphs.py). ``build`` reads less for uneven contexts.
        """
        rows, width = block_tables.shape
        span = width * kv_cache.block_size
        positions = torch.arange(span, device=block_tables.device)
        mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
        shape = (rows * width, *kv_cache.key.shape[2:])
        chunk = DecodeChunk(0, rows, block_tables.reshape(-1), 0, width, span, mask)
        return cls(
            num_tokens=rows,
            block_size=kv_cache.block_size,
            num_decodes=rows,
            decode_token_indices=None,
            decode_chunks=(chunk,),
            decode_key_buffer=kv_cache.key.new_empty(shape),
            decode_value_buffer=kv_cache.value.new_empty(shape),
            prefills=(),
            decode_context_tensor=context_lens,
        )


def _plan_decode_chunks(
    batch: ForwardBatch,
    decodes: list[tuple[int, int, int]],
    block_size: int,
    token_bytes: int,
    chunk_bytes: int | None,
    device: torch.device,
) -> tuple[DecodeChunk, ...]:
    """Cut ``decodes`` (longest context first) into chunks of at most
    ``chunk_bytes`` gathered bytes, each padded to its first row's blocks."""
    tables = batch.block_tables_cpu
    bounds: list[tuple[int, int]] = []
    start = 0
    while start < len(decodes):
        span = -(-decodes[start][0] // block_size) * block_size
        rows = len(decodes) - start if chunk_bytes is None else max(1, chunk_bytes // (span * token_bytes))
        bounds.append((start, min(start + rows, len(decodes))))
        start = bounds[-1][1]
    # One host-to-device copy for all chunks' block ids, one for the context
    # lengths when some chunk needs a mask.
    flat: list[int] = []
    firsts: list[int | None] = []  # per chunk: its first block when read in place
    for a, b in bounds:
        num_blocks = -(-decodes[a][0] // block_size)
        table = tables[decodes[a][2]][:num_blocks]
        if b - a == 1 and table == tuple(range(table[0], table[0] + num_blocks)):
            # A lone sequence on consecutive blocks (one stream on a fresh
            # pool) is attended over a view of the pool: no gather.
            firsts.append(table[0])
            continue
        firsts.append(None)
        for _, _, seq in decodes[a:b]:
            table = tables[seq][:num_blocks]
            # Rows shorter than the chunk's longest read any valid block past
            # their end; the mask hides it.
            flat.extend(table)
            flat.extend(table[:1] * (num_blocks - len(table)))
    all_blocks = torch.tensor(flat, dtype=torch.int64, device=device) if flat else None
    ctx_lens = positions = None
    if any(decodes[a][0] != decodes[b - 1][0] for a, b in bounds):
        ctx_lens = torch.tensor([d[0] for d in decodes], dtype=torch.int64, device=device)
        positions = torch.arange(decodes[0][0], device=device)
    chunks = []
    offset = 0
    for (a, b), first in zip(bounds, firsts):
        context_len = decodes[a][0]
        num_blocks = -(-context_len // block_size)
        mask = None
        if decodes[b - 1][0] != context_len:
            mask = (positions[None, :context_len] < ctx_lens[a:b, None])[:, None, None, :]
        if first is not None:
            chunks.append(DecodeChunk(a, b, None, first, num_blocks, context_len, mask))
        else:
            end = offset + (b - a) * num_blocks
            chunks.append(DecodeChunk(a, b, all_blocks[offset:end], 0, num_blocks, context_len, mask))
            offset = end
    return tuple(chunks)


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
    # Rounded into the cache's dtype where it is narrower (kv_cache.py).
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, to_cache(key, key_cache.dtype))
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, to_cache(value, value_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend ``query`` (``[T, heads, head_dim]``) over each sequence's cache.

    ``key``/``value`` (``[T, kv_heads, head_dim]``) are the step's fresh
    keys and values, already written to the cache with ``write_kv``; a
    prefill chunk that starts at position 0 reads them directly. With
    ``window``, a query sees only the last ``window`` positions up to its
    own; with ``softcap``, scores pass through ``softcap * tanh(s / softcap)``
    (Gemma 2); with ``sinks`` (``[heads]``, gpt-oss), each head's softmax
    takes one more logit, unscaled, that has no value: it only draws weight
    away from the keys. Returns ``[T, heads * head_dim]``.
    """
    num_tokens, heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"sinks must have one logit per head ({heads}), got shape {tuple(sinks.shape)}")
    if meta.num_decodes == num_tokens and meta.decode_token_indices is None:
        decoded = _decode(query, key_cache, value_cache, meta, scale, window, softcap, sinks)
        return decoded.view(num_tokens, heads * head_dim)
    out = query.new_empty(num_tokens, heads * head_dim)
    if meta.num_decodes:
        q = query.index_select(0, meta.decode_token_indices)
        decoded = _decode(q, key_cache, value_cache, meta, scale, window, softcap, sinks)
        out.index_copy_(0, meta.decode_token_indices, decoded.flatten(1))
    for p in meta.prefills:
        qlen = p.token_end - p.token_start
        # [qlen, heads, d] -> [kv_heads, group, qlen, d]: a view, no copy.
        q = query[p.token_start : p.token_end].view(qlen, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        if p.context_blocks is None:
            # As the cache holds them (rounded, in a narrower cache), so that
            # how a prompt is chunked or cached does not change what it sees.
            k = as_stored(key[p.token_start : p.token_end], key_cache.dtype)
            v = as_stored(value[p.token_start : p.token_end], value_cache.dtype)
        else:
            k = key_cache.index_select(0, p.context_blocks).view(-1, kv_heads, head_dim)[: p.context_len]
            v = value_cache.index_select(0, p.context_blocks).view(-1, kv_heads, head_dim)[: p.context_len]
            k, v = from_cache(k, query.dtype), from_cache(v, query.dtype)
        # Each KV head broadcast over its group with a stride-0 view: GQA
        # without copying keys and values per query head.
        shape = (kv_heads, group, k.shape[0], head_dim)
        k = k.permute(1, 0, 2).unsqueeze(1).expand(shape)
        v = v.permute(1, 0, 2).unsqueeze(1).expand(shape)
        mask = p.mask
        if window is not None:
            # Query i sits at position ctx - qlen + i; key j is seen when i's position - j < window.
            rows = torch.arange(p.context_len - qlen, p.context_len, device=query.device)[:, None]
            cols = torch.arange(p.context_len, device=query.device)[None, :]
            mask = (cols <= rows) & (cols > rows - window)
        # A head's sink broadcast over its query rows: q is [kv_heads, group, qlen, d].
        sink = None if sinks is None else sinks.view(kv_heads, group, 1, 1)
        o = _attend(q, k, v, mask, scale, softcap, sink)
        # [kv_heads, group, qlen, d] -> [qlen, heads * d]
        out[p.token_start : p.token_end] = o.permute(2, 0, 1, 3).reshape(qlen, heads * head_dim)
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention; ``mask`` None is causal. With
    ``softcap`` or ``sink`` (each head's sink logit, shaped to broadcast
    against the scores' leading dimensions with a trailing 1), in plain
    torch: SDPA has neither."""
    if softcap is None and sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(scores.shape[-1] - scores.shape[-2])
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink is None:
        probs = scores.softmax(-1)
    else:
        # As transformers' gpt-oss: the sink joins the softmax as one more
        # column, which is dropped after, so the keys' weights sum to less than 1.
        column = sink.float().expand(*scores.shape[:-1], 1)
        probs = torch.cat((scores, column), -1).softmax(-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the ``D`` single-token queries (in attention order); returns ``[D, heads, head_dim]``."""
    num_decodes, heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    # [D, heads, d] -> [D, kv_heads, group, d]: a KV head's query heads share its keys.
    query = query.view(num_decodes, kv_heads, heads // kv_heads, head_dim)
    # Each head's sink against its row of a KV head's group: scores are [rows, kv_heads, group, context].
    sink = None if sinks is None else sinks.view(kv_heads, heads // kv_heads, 1)
    outs = []
    contexts = None
    for c in meta.decode_chunks:
        rows = c.end - c.start
        if c.blocks is None:
            k = key_cache[c.first_block : c.first_block + c.num_blocks]
            v = value_cache[c.first_block : c.first_block + c.num_blocks]
        else:
            size = rows * c.num_blocks
            # A block-wise gather moves block_size rows per index: far cheaper than per token.
            k = torch.index_select(key_cache, 0, c.blocks, out=meta.decode_key_buffer[:size])
            v = torch.index_select(value_cache, 0, c.blocks, out=meta.decode_value_buffer[:size])
        # [rows, span, kv_heads, d] -> [rows, kv_heads, context_len, d], a view.
        k = k.view(rows, -1, kv_heads, head_dim)[:, : c.context_len].transpose(1, 2)
        v = v.view(rows, -1, kv_heads, head_dim)[:, : c.context_len].transpose(1, 2)
        k, v = from_cache(k, query.dtype), from_cache(v, query.dtype)  # a narrower cache, widened
        mask = c.mask
        if window is not None:
            if contexts is None:
                contexts = meta.decode_contexts(query.device)
            ctx = contexts[c.start : c.end, None]
            positions = torch.arange(c.context_len, device=query.device)[None, :]
            mask = ((positions < ctx) & (positions >= ctx - window))[:, None, None, :]
        if mask is None and softcap is None and sink is None:
            outs.append(F.scaled_dot_product_attention(query[c.start : c.end], k, v, scale=scale))
        else:
            if mask is None:
                mask = torch.ones(1, 1, 1, c.context_len, dtype=torch.bool, device=query.device)
            outs.append(_attend(query[c.start : c.end], k, v, mask, scale, softcap, sink))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    # CUDA's SDPA kernels may return a permuted layout: reshape copies only then.
    return out.reshape(num_decodes, heads, head_dim)
