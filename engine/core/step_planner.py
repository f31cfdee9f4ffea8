"""Planning one step: which requests get how many tokens, and who is preempted.

There is no prefill or decode phase. Every step, within ``max_num_seqs``
requests (or the running limit) and ``max_num_batched_tokens`` tokens:

1. Running requests that decode (one token left to compute) go first, then
   running requests part way through their prompt, each in key order
   ((effective priority, arrival) for the built-in policy). A prompt gets
   what is left of the token budget, so a long one is chunked over several
   steps and never stalls decodes. A decoding request may run a speculative
   proposal with its token (drafts.py).
2. A running request whose next blocks the pool cannot cover preempts others
   by recompute: lowest priority first (highest key), then latest arrival,
   down to itself. A preempted request keeps its output, restarts from token
   0 and goes back to waiting; its computed full blocks were committed to the
   prefix cache, so it resumes from whatever of them survived.
3. If nothing was preempted, waiting requests are admitted in key order
   until a budget runs out or the first one that does not fit (no request is
   overtaken by a smaller one behind it). Their prefix-cache hit is found by
   the pool, and the chunk starts after it. An admission is planned as if
   nothing were cached (an upper bound on its cost), and the first admission
   beyond that estimate is still sent, since its hit may make it fit.
4. A waiting request that does not fit may preempt running requests of a
   strictly lower (effective) priority, lowest first, when preempting them
   all would make room for it (its cost estimated without its prefix hit).
   Equal priorities never preempt each other, so arrival order holds.
5. With every sequence slot taken, the policy may give the head waiting
   request a slot by preempting a running one it does not outrank
   (``slot_victim``: the ``slo`` policy does, for a request that would
   miss its deadline waiting), when the victim's blocks and tokens make
   room for it.

The free blocks planned from are the pool's after the previous batch plus
those the frees of this batch release, exact since the scheduler mirrors
every block table (kv_ledger.py): a running request is never refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs

from trioserve.engine.core.drafts import Drafts
from trioserve.engine.core.kv_batch import KVAllocation
from trioserve.engine.core.kv_ledger import KVLedger
from trioserve.engine.core.request_queues import RequestQueues
from trioserve.engine.core.sequence import Request, RequestStatus
from trioserve.engine.plugins import SchedulingPolicy
from trioserve.engine.sampling.speculative import NgramProposer


@attrs.define
class StepPlanner:
    """One step's plan while it is made: what is left of its budgets, the
    running requests' planned tokens and new blocks, and who was preempted.
    It moves requests between the scheduler's queues as it preempts."""

    queues: RequestQueues
    kv: KVLedger
    drafts: Drafts
    key: Callable[[Request], tuple[float, ...]]
    policy: SchedulingPolicy
    proposer: NgramProposer | None
    block_size: int
    max_context_len: int
    tokens: int  # left of max_num_batched_tokens
    free_blocks: int  # left of the pool's
    planned: dict[str, tuple[int, int]] = attrs.field(factory=dict)  # running id -> (tokens, new blocks)
    # (waiting request, requests admitted before it this step) -> a running
    # request to preempt for its sequence slot, or None (item 5 above).
    slot_victim: Callable[[Request, Sequence[Request]], Request | None] | None = None
    preempted: list[str] = attrs.field(factory=list)

    def plan_running(self) -> None:
        """Give the running requests their tokens (items 1 and 2)."""
        running = self.queues.running
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        for request in sorted(decodes, key=self.key) + sorted(prefills, key=self.key):
            if self.tokens == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = min(request.num_tokens - request.num_computed_tokens, self.tokens)
            num_blocks = max(0, self._blocks_for(request.num_computed_tokens + num_tokens) - len(request.block_ids))
            if self.proposer is not None and num_tokens == 1 and request.num_output_tokens > 0:
                num_tokens, num_blocks = self.drafts.plan(
                    request,
                    self.proposer,
                    tokens_left=self.tokens,
                    free_blocks=self.free_blocks,
                    num_blocks=num_blocks,
                    max_context_len=self.max_context_len,
                    block_size=self.block_size,
                )
            while num_blocks > self.free_blocks and request.status is RequestStatus.RUNNING:
                self._preempt(max(running, key=self.key))
            if request.status is RequestStatus.RUNNING:
                self.planned[request.request_id] = (num_tokens, num_blocks)
                self.free_blocks -= num_blocks
                self.tokens -= num_tokens

    def allocations(self) -> list[KVAllocation]:
        """The running requests' allocations, as planned."""
        requests = self.queues.requests
        return [
            KVAllocation(rid, requests[rid].num_computed_tokens, num_tokens)
            for rid, (num_tokens, _) in self.planned.items()
        ]

    def plan_admissions(self, running_limit: int) -> list[KVAllocation]:
        """Admit waiting requests in order while the budgets last, fewer
        than ``running_limit`` running (items 3 and 4)."""
        admissions: list[KVAllocation] = []
        admitted: list[Request] = []
        num_seqs = len(self.queues.running)
        for request in list(self.queues.waiting):  # a snapshot: preemption below inserts
            if num_seqs >= running_limit:
                if not self._preempt_for_slot(request, admitted):
                    break
                num_seqs -= 1
            if self.tokens == 0:
                break
            num_tokens = min(request.num_tokens, self.tokens)
            needed = self._blocks_for(num_tokens)
            if needed > self.free_blocks:
                # Preempt strictly lower priorities, lowest first, if
                # preempting all of them would make room.
                key = self.key(request)
                outranked = (r for r in self.queues.running if self.policy.outranks(key, self.key(r)))
                victims = sorted(outranked, key=self.key, reverse=True)
                reclaimable = sum(
                    self.kv.tables.sole_blocks(v.request_id) + self.planned.get(v.request_id, (0, 0))[1] for v in victims
                )
                for victim in victims if self.free_blocks + reclaimable >= needed else ():
                    if self.free_blocks >= needed:
                        break
                    self._preempt(victim)
                    num_seqs -= 1
                num_tokens = min(request.num_tokens, self.tokens)
            # Prompt logprobs need logits at every prompt position, which a
            # prefix-cache hit would skip: such a request computes its whole
            # prompt (no token ids: no lookup). Its blocks are still cached.
            # So do mean and CLS embeddings (engine/sampling/pooling.py),
            # which need every position's hidden state.
            pools_all = request.pooling is not None and request.pooling.method.needs_every_position
            lookup = request.all_token_ids if request.sampling_params.prompt_logprobs is None and not pools_all else ()
            root = 0 if request.lora is None else request.lora.root_hash  # blocks per adapter
            admissions.append(KVAllocation(request.request_id, 0, num_tokens, lookup, root))
            admitted.append(request)
            num_seqs += 1
            self.tokens -= num_tokens
            self.free_blocks -= self._blocks_for(num_tokens)
            if self.free_blocks < 0:
                break  # the pool decides whether its prefix hit makes it fit
        return admissions

    def _preempt_for_slot(self, request: Request, admitted: Sequence[Request]) -> bool:
        """Preempt the running request ``slot_victim`` names for
        ``request``'s slot, if its blocks and planned tokens make room for
        ``request``'s first chunk; whether it did."""
        victim = None if self.slot_victim is None else self.slot_victim(request, admitted)
        if victim is None:
            return False
        tokens, blocks = self.planned.get(victim.request_id, (0, 0))
        room = self.free_blocks + blocks + self.kv.tables.sole_blocks(victim.request_id)
        if self.tokens + tokens == 0 or self._blocks_for(min(request.num_tokens, self.tokens + tokens)) > room:
            return False
        self._preempt(victim)
        return True

    def _preempt(self, victim: Request) -> None:
        """Preempt ``victim`` while planning: give back what was planned for
        it this step and the blocks its free returns."""
        undone_tokens, undone_blocks = self.planned.pop(victim.request_id, (0, 0))
        self.drafts.drop(victim.request_id)
        self.tokens += undone_tokens
        self.free_blocks += undone_blocks + self.kv.tables.drop(victim.request_id)
        self.queues.preempt(victim)
        self.preempted.append(victim.request_id)

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)
