"""The inputs of one model forward over a paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    from trioserve.engine.lora.batch import LoraBatch


@attrs.frozen
class SeqChunk:
    """One sequence's share of a forward: ``token_ids`` at positions
    ``start_position .. start_position + len(token_ids) - 1``.

    ``block_table`` lists the sequence's KV blocks in order; it must cover
    every position up to the chunk's end and may hold more blocks than that.
    ``num_logits`` is how many trailing tokens of the chunk need logits: 0 for
    a prefill chunk that does not end the prompt, 1 to sample, or all of them
    (for prompt logprobs or tests). ``window_table``: the sequence's
    blocks in the sliding-window layers' own pool, indexed like
    ``block_table`` (blocks out of the window are a placeholder the mask
    hides); None when those layers share ``block_table``.
    """

    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]
    num_logits: int = 1
    window_table: Sequence[int] | None = None


@attrs.frozen
class ForwardBatch:
    """A flattened batch of variable-length query chunks.

    Sequence ``i`` contributes the query tokens
    ``input_ids[cu_query_lens[i]:cu_query_lens[i+1]]``, which sit at positions
    ``context_lens[i] - query_len_i .. context_lens[i] - 1`` of that sequence.
    A prefill chunk has many query tokens and may start at any position (a
    prompt prefilled in pieces, or continuing a cached prefix); a decode step
    has one. Prefill chunks and decode tokens mix freely in one batch.

    All tensors live on the model's device. The ``window_`` fields are the
    sliding-window layers' slots and tables when those layers have a pool
    of their own (``KVCache.window``; ``window_batch`` views the batch
    through them), else None.
    """

    input_ids: torch.Tensor  # [T] int64, every query token of every sequence
    positions: torch.Tensor  # [T] int64, each token's position in its sequence
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset where its K/V is written
    cu_query_lens: torch.Tensor  # [B + 1] int64, prefix sums of query lengths
    context_lens: torch.Tensor  # [B] int64, tokens of each sequence in the cache after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0 past a sequence's blocks
    logits_indices: torch.Tensor  # [L] int64, rows of the T tokens whose logits are wanted
    # Host copies, so the attention code can plan without a device sync.
    query_lens_cpu: tuple[int, ...]
    context_lens_cpu: tuple[int, ...]
    block_tables_cpu: tuple[tuple[int, ...], ...]  # each cut to the blocks its context needs, unpadded
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None
    window_block_tables_cpu: tuple[tuple[int, ...], ...] | None = None
    # An engine serving LoRA (engine/lora): which token rows run which
    # adapter; set on every batch of such an engine, None otherwise.
    lora: LoraBatch | None = None

    def window_batch(self) -> ForwardBatch:
        """This batch as the sliding-window layers' pool sees it: their
        slots and block tables in place of the others'."""
        assert self.window_slot_mapping is not None, "this batch has no window tables"
        return attrs.evolve(
            self,
            slot_mapping=self.window_slot_mapping,
            block_tables=self.window_block_tables,
            block_tables_cpu=self.window_block_tables_cpu,
            window_slot_mapping=None,
            window_block_tables=None,
            window_block_tables_cpu=None,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk], *, block_size: int, device: torch.device | str) -> ForwardBatch:
        """Flatten ``chunks`` (in order) into one batch on ``device``.

        Logits rows come out in chunk order, each chunk's last ``num_logits``
        tokens in position order. Block tables are cut to the blocks the
        context needs, so a table longer than the context costs nothing.
        Everything is assembled in Python lists and sent with one
        ``torch.tensor`` call per field: per-token torch ops would cost more
        than a decode step's attention.
        """
        if not chunks:
            raise ValueError("a forward batch needs at least one chunk")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_query_lens = [0]
        context_lens: list[int] = []
        query_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        windowed = chunks[0].window_table is not None
        window_slots: list[int] = []
        window_tables: list[list[int]] = []
        for i, chunk in enumerate(chunks):
            n = len(chunk.token_ids)
            start = chunk.start_position
            end = start + n
            if n == 0:
                raise ValueError(f"chunk {i} has no tokens")
            if start < 0:
                raise ValueError(f"chunk {i}: start_position must be >= 0, got {start}")
            if not 0 <= chunk.num_logits <= n:
                raise ValueError(f"chunk {i}: num_logits must be in [0, {n}], got {chunk.num_logits}")
            num_blocks = -(-end // block_size)
            if len(chunk.block_table) < num_blocks:
                raise ValueError(
                    f"chunk {i}: block_table has {len(chunk.block_table)} blocks, "
                    f"context of {end} tokens needs {num_blocks}"
                )
            table = list(chunk.block_table[:num_blocks])
            offset = cu_query_lens[-1]
            input_ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            _extend_slots(slots, table, start, end, block_size)
            if windowed:
                if chunk.window_table is None or len(chunk.window_table) < num_blocks:
                    raise ValueError(f"chunk {i}: window_table missing or shorter than the {num_blocks} blocks needed")
                window_tables.append(list(chunk.window_table[:num_blocks]))
                _extend_slots(window_slots, window_tables[-1], start, end, block_size)
            logits_indices.extend(range(offset + n - chunk.num_logits, offset + n))
            cu_query_lens.append(offset + n)
            context_lens.append(end)
            query_lens.append(n)
            tables.append(table)
        width = max(len(t) for t in tables)

        def padded(tables: list[list[int]]) -> list[list[int]]:
            return [t + [0] * (width - len(t)) for t in tables]

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        window = {}
        if windowed:
            window = dict(
                window_slot_mapping=tensor(window_slots),
                window_block_tables=tensor(padded(window_tables)),
                window_block_tables_cpu=tuple(map(tuple, window_tables)),
            )

        return cls(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            cu_query_lens=tensor(cu_query_lens),
            context_lens=tensor(context_lens),
            block_tables=tensor(padded(tables)),
            logits_indices=tensor(logits_indices),
            query_lens_cpu=tuple(query_lens),
            context_lens_cpu=tuple(context_lens),
            block_tables_cpu=tuple(map(tuple, tables)),
            **window,
        )


def _extend_slots(slots: list[int], table: list[int], start: int, end: int, block_size: int) -> None:
    """Append the slots of positions ``start .. end - 1`` under ``table``:
    one range per block touched, not one Python op per token."""
    pos = start
    while pos < end:
        block, off = divmod(pos, block_size)
        run = min(block_size - off, end - pos)
        base = table[block] * block_size + off
        slots.extend(range(base, base + run))
        pos += run
