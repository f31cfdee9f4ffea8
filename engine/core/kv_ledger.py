"""The scheduler's side of the KV pool: what it knows of it, what it owes it.

The scheduler never calls the pool; each step it sends one ``KVBatch`` and
reads one ``KVResult`` (kv_batch.py). Between batches this ledger keeps:

- the pool's block tables and reference counts as its answers gave them
  (``BlockTables``), so the scheduler knows exactly how many blocks a free
  returns and what preempting a sequence would free, and plans a step from
  the pool's last ``budget`` plus the blocks the frees of this batch release;
- how much of each sequence the pool has hashed into its prefix cache, so a
  full block is committed once, as soon as it is computed;
- what the next batch owes the pool: the commits of every holder, the frees
  of finished, aborted, paused and lost sequences, and whether the pool must
  forget its prefix cache (its KV tensors were lost).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from trioserve.engine.core.block_tables import BlockTables
from trioserve.engine.core.kv_batch import KVBudget, KVCommit
from trioserve.engine.core.sequence import Request


@attrs.define
class KVLedger:
    """The mirror of a pool of ``num_blocks`` blocks of ``block_size``
    tokens, and the commits and frees owed to it."""

    num_blocks: int
    block_size: int
    # Running sequences, plus finished or preempted ones whose free is not
    # sent yet (the pool still holds their blocks).
    tables: BlockTables = attrs.field(init=False, factory=BlockTables)
    budget: KVBudget = attrs.field(init=False)  # the pool as of the last batch
    _to_free: dict[str, Request] = attrs.field(init=False, factory=dict)  # finished, their free not sent
    # Owed by pause() and recompute_all(), sent with the next batch (their
    # tables stay in ``tables`` until then, as the pool still holds them).
    _paused_commits: list[KVCommit] = attrs.field(init=False, factory=list)
    _paused_frees: list[str] = attrs.field(init=False, factory=list)
    _forget_cache: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self.budget = KVBudget(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_blocks,
            num_cached_blocks=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_evictions=0,
        )

    def owes_free(self, request_id: str) -> bool:
        """Whether the next batch frees this sequence's blocks."""
        return request_id in self._to_free or request_id in self._paused_frees

    def has_finished(self) -> bool:
        """Whether finished sequences wait for the next batch to free their blocks."""
        return bool(self._to_free)

    def free_finished(self, request: Request) -> None:
        """A sequence finished: the next batch commits its computed blocks
        and frees it."""
        self._to_free[request.request_id] = request

    def free_paused(self, request: Request) -> None:
        """A running sequence is preempted between steps (paused): its
        computed full blocks are committed now, and the next batch sends
        that commit and frees it."""
        commit = self._commit_for(request)
        if commit is not None:
            self._paused_commits.append(commit)
        self._paused_frees.append(request.request_id)

    def free_lost(self, request_id: str) -> None:
        """A running sequence whose KV was lost: the next batch frees it,
        committing nothing."""
        self._paused_frees.append(request_id)

    def forget_cache(self) -> None:
        """The KV tensors are lost: the next batch makes the pool forget its
        prefix cache (``KVBatch.forget_cache``)."""
        self._forget_cache = True

    def take_forget(self) -> bool:
        forget, self._forget_cache = self._forget_cache, False
        return forget

    def take_release(self, running: Iterable[Request]) -> tuple[list[KVCommit], list[str], int]:
        """What the next batch owes the pool: commits for every holder
        (``running`` and the finished), frees for the finished, paused and
        lost, and how many blocks those frees return to the pool."""
        holders = [*running, *self._to_free.values()]
        commits = self._paused_commits + [c for c in map(self._commit_for, holders) if c is not None]
        frees = list(dict.fromkeys([*self._paused_frees, *self._to_free]))
        num_freed = sum(self.tables.drop(rid) for rid in frees)
        self._to_free.clear()
        self._paused_commits, self._paused_frees = [], []
        return commits, frees, num_freed

    def _commit_for(self, request: Request) -> KVCommit | None:
        done = self.tables.committed(request.request_id)
        full = request.num_computed_tokens // self.block_size * self.block_size
        if full <= done or request.request_id not in self.tables:
            return None
        self.tables.set_committed(request.request_id, full)
        return KVCommit(request.request_id, request.all_token_ids[done:full])
