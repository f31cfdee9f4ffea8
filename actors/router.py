"""The replica router: which data-parallel replica a request goes to.

Each request is routed once, when it is put in the admission queue (the
moment there is room for it; the replicated admission queue calls
``choose`` then ``record``):

1. **Prefix affinity.** The prompt's first full KV blocks are hashed as the
   prefix cache hashes them (``engine/core/prefix_hash.py``). The router keeps,
   per block hash, the replicas it sent a request with that block to (an LRU
   table bounded to ``table_capacity`` hashes). A request goes to the least
   loaded of the replicas holding its deepest matching block, since their
   caches hold (or are about to hold) its prefix.
2. **The bound.** Affinity is followed only while that replica has fewer
   than ``affinity_slack`` more outstanding requests than the least loaded
   replica (like SGLang's router's balance threshold). Past that the request
   goes to the least loaded replica, which then holds the prefix too, so a
   popular prefix spreads over replicas instead of piling onto one.
3. **Load.** Otherwise the least loaded replica: the fewest outstanding
   tokens (the prompt plus the most it may generate, for every request
   routed there and not yet closed), then the lowest KV usage, then the
   lowest index.

The table is a hint, not the caches' truth: a replica may have evicted a
block the table still names. That costs a miss, never a wrong answer.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import attrs

from trioserve.engine.core.prefix_hash import prefix_block_hashes
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.validators import integer_at_least

at_least_one = integer_at_least(1)



@attrs.frozen
class RouterStatistics:
    """What the router did (cumulative counts) and the load it sees now."""

    num_by_affinity: int  # routed to a replica holding the prefix
    num_spilled: int  # had affinity, sent elsewhere by the bound
    num_by_load: int  # no prefix known: the least loaded replica
    outstanding_requests: tuple[int, ...]  # per replica
    outstanding_tokens: tuple[int, ...]  # per replica
    num_by_slo: int = 0  # --scheduling-policy slo: the replica with the soonest predicted TTFT


@attrs.define
class ReplicaRouter:
    """Routes requests over ``num_replicas`` replicas (see the module docstring)."""

    num_replicas: int = attrs.field(validator=at_least_one)
    block_size: int = attrs.field(validator=at_least_one)
    max_model_len: int = attrs.field(validator=at_least_one)
    affinity_slack: int = attrs.field(default=8, validator=at_least_one)
    max_prefix_blocks: int = attrs.field(default=64, validator=at_least_one)
    table_capacity: int = attrs.field(default=1 << 16, validator=at_least_one)
    _table: collections.OrderedDict[int, set[int]] = attrs.field(init=False, factory=collections.OrderedDict)
    _routed: dict[str, tuple[int, int]] = attrs.field(init=False, factory=dict)  # id -> (replica, tokens)
    _requests: list[int] = attrs.field(init=False)
    _tokens: list[int] = attrs.field(init=False)
    _counts: collections.Counter[str] = attrs.field(init=False, factory=collections.Counter)

    def __attrs_post_init__(self) -> None:
        self._requests = [0] * self.num_replicas
        self._tokens = [0] * self.num_replicas

    def cost(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Outstanding tokens a request adds: its prompt and the most its
        completions may generate."""
        room = max(0, self.max_model_len - len(prompt_token_ids))
        most = room if params.max_tokens is None else min(params.max_tokens, room)
        return len(prompt_token_ids) + params.n * most

    def choose(
        self, prompt_token_ids: Sequence[int], kv_usage: Sequence[float], predicted_ttfts: Sequence[float] = ()
    ) -> tuple[int, list[int]]:
        """The replica for a prompt, and its prefix hashes (for ``record``).
        ``kv_usage``: each replica's KV usage now, 0..1. ``predicted_ttfts``:
        with the slo policy, each replica's predicted TTFT for the request
        (actors/slo_admission.py): the soonest wins, as admission judged it."""
        assert len(kv_usage) == self.num_replicas
        if len(predicted_ttfts) == self.num_replicas:
            self._counts["slo"] += 1
            soonest = min(range(self.num_replicas), key=lambda replica: (predicted_ttfts[replica], replica))
            return soonest, prefix_block_hashes(prompt_token_ids, self.block_size, self.max_prefix_blocks)

        def load(replica: int) -> tuple[int, float, int]:
            return self._tokens[replica], kv_usage[replica], replica

        least = min(range(self.num_replicas), key=load)
        hashes = prefix_block_hashes(prompt_token_ids, self.block_size, self.max_prefix_blocks)
        holders: set[int] | None = None
        for block_hash in hashes:
            found = self._table.get(block_hash)
            if not found:
                break
            holders = found
        if not holders:
            self._counts["load"] += 1
            return least, hashes
        best = min(holders, key=load)
        if self._requests[best] - self._requests[least] < self.affinity_slack:
            self._counts["affinity"] += 1
            return best, hashes
        self._counts["spilled"] += 1
        return least, hashes

    def record(self, request_id: str, replica: int, hashes: Sequence[int], cost: int) -> None:
        """``request_id`` went to ``replica``: count its load there until
        ``release``, and note that replica for its prefix blocks."""
        assert request_id not in self._routed, request_id
        self._routed[request_id] = (replica, cost)
        self._requests[replica] += 1
        self._tokens[replica] += cost
        for block_hash in hashes:
            holders = self._table.get(block_hash)
            if holders is None:
                self._table[block_hash] = {replica}
            else:
                holders.add(replica)
                self._table.move_to_end(block_hash)
        while len(self._table) > self.table_capacity:
            self._table.popitem(last=False)

    def release(self, request_id: str) -> None:
        """The request is over on the callers' side: its load is gone.
        Nothing if it was never routed (or already released)."""
        routed = self._routed.pop(request_id, None)
        if routed is not None:
            replica, cost = routed
            self._requests[replica] -= 1
            self._tokens[replica] -= cost

    def replica_of(self, request_id: str) -> int | None:
        """Where ``request_id`` went, while it is routed."""
        routed = self._routed.get(request_id)
        return None if routed is None else routed[0]

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(
            num_by_affinity=self._counts["affinity"],
            num_spilled=self._counts["spilled"],
            num_by_load=self._counts["load"],
            num_by_slo=self._counts["slo"],
            outstanding_requests=tuple(self._requests),
            outstanding_tokens=tuple(self._tokens),
        )
