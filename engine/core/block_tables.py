"""The scheduler's mirror of the KV pool's block tables.

The scheduler never reads the pool (``BlockManager``); it only sees its
answers. From them it keeps every sequence's block table and each
block's reference count, which is all it needs to plan exactly: how many
blocks a free returns to the pool (those no other table holds) and what
preempting a sequence would free. It also remembers how many tokens of each
sequence the pool has hashed into the prefix cache, so each full block is
committed once.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import attrs


@attrs.define
class BlockTables:
    """Sequence id -> block table, with per-block reference counts."""

    _tables: dict[str, tuple[int, ...]] = attrs.field(init=False, factory=dict)
    _refs: collections.Counter[int] = attrs.field(init=False, factory=collections.Counter)
    _committed: dict[str, int] = attrs.field(init=False, factory=dict)  # tokens the pool has hashed

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def get(self, request_id: str) -> tuple[int, ...] | None:
        return self._tables.get(request_id)

    def set(self, request_id: str, table: tuple[int, ...]) -> None:
        """Record the pool's table for a sequence: the old one plus new
        blocks at its end (an allocation only ever appends)."""
        old = self._tables.get(request_id, ())
        assert table[: len(old)] == old, f"the pool rewrote the head of {request_id!r}'s block table"
        self._refs.update(table[len(old) :])
        self._tables[request_id] = table

    def drop(self, request_id: str) -> int:
        """Forget a sequence's table; return how many of its blocks no one
        else holds (what the pool frees)."""
        num_freed = 0
        for block_id in self._tables.pop(request_id, ()):
            self._refs[block_id] -= 1
            if self._refs[block_id] == 0:
                del self._refs[block_id]
                num_freed += 1
        self._committed.pop(request_id, None)
        return num_freed

    def sole_blocks(self, request_id: str) -> int:
        """Blocks only this sequence holds (what dropping it frees)."""
        return sum(1 for block_id in self._tables.get(request_id, ()) if self._refs[block_id] == 1)

    def committed(self, request_id: str) -> int:
        """Tokens of the sequence the pool has hashed into its prefix cache."""
        return self._committed.get(request_id, 0)

    def set_committed(self, request_id: str, num_tokens: int) -> None:
        self._committed[request_id] = num_tokens

    def as_dict(self) -> Mapping[str, tuple[int, ...]]:
        """A copy: sequence id -> block table."""
        return dict(self._tables)

    def check(self) -> None:
        """Raise ``AssertionError`` if the reference counts differ from the tables."""
        expected = collections.Counter(b for table in self._tables.values() for b in table)
        if expected != self._refs:
            raise AssertionError("reference counts differ from the block tables")
