"""Which token rows of a step run which LoRA adapter (``LoraBatch``), as the
runner builds it and the model's layers read it (engine/lora/projections.py)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from trioserve.engine.lora.adapter import LoraAdapter


@attrs.frozen(eq=False)
class LoraGroup:
    """The token rows of one step that run ``adapter``: ``segments`` of
    consecutive rows ``(start, end)`` (a sequence's chunk, or neighbours
    merged), and all of them as ``rows`` (int64, on the model's device)."""

    adapter: LoraAdapter
    segments: tuple[tuple[int, int], ...]
    rows: torch.Tensor


@attrs.frozen(eq=False)
class LoraBatch:
    """A step's adapters by token row; an empty one (no groups) still tells
    the model the engine serves LoRA, so every batch takes the same path."""

    groups: tuple[LoraGroup, ...] = ()

    @classmethod
    def build(
        cls, adapters: Sequence[LoraAdapter | None], query_lens: Sequence[int], device: torch.device | str
    ) -> LoraBatch:
        """Groups for a batch whose sequence ``i`` has ``query_lens[i]``
        token rows (in order) and runs ``adapters[i]`` (None: the base)."""
        segments: dict[str, list[tuple[int, int]]] = {}
        by_name: dict[str, LoraAdapter] = {}
        offset = 0
        for adapter, n in zip(adapters, query_lens, strict=True):
            if adapter is not None:
                by_name[adapter.name] = adapter
                own = segments.setdefault(adapter.name, [])
                if own and own[-1][1] == offset:
                    own[-1] = (own[-1][0], offset + n)  # its neighbour runs it too: one segment
                else:
                    own.append((offset, offset + n))
            offset += n
        groups = []
        for name, spans in segments.items():
            rows = [row for start, end in spans for row in range(start, end)]
            groups.append(LoraGroup(by_name[name], tuple(spans), torch.tensor(rows, dtype=torch.int64, device=device)))
        return cls(tuple(groups))
