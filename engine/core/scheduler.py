"""The continuous-batching scheduler: which tokens of which requests run next.

A policy object. Each step ``propose()`` decides what to run and what to
preempt and returns the one ``KVBatch`` the KV pool must apply; ``finalize()``
turns the pool's ``KVResult`` into a ``SchedulerOutput`` (the plan); the runner
executes the plan; ``update_from_output()`` applies the sampled tokens.
``schedule(block_manager)`` does the first two in process.

There is no prefill or decode phase. Every step, within ``max_num_seqs``
requests and ``max_num_batched_tokens`` tokens:

1. Running requests that decode (one token left to compute) go first, then
   running requests part way through their prompt, each in (priority,
   arrival) order. A prompt gets what is left of the token budget, so a long
   one is chunked over several steps and never stalls decodes.
2. A running request whose next blocks the pool cannot cover preempts others
   by recompute: lowest priority first (highest ``priority`` value), then
   latest arrival, down to itself. A preempted request keeps its output,
   restarts from token 0 and goes back to waiting; its computed full blocks
   were committed to the prefix cache, so it resumes from whatever of them
   survived.
3. If nothing was preempted, waiting requests are admitted in (priority,
   arrival) order until a budget runs out or the first one that does not fit
   (no request is overtaken by a smaller one behind it). Their prefix-cache
   hit is found by the pool, and the chunk starts after it.

Planning uses the pool's budget after the previous batch plus the blocks the
frees of this batch release. The scheduler knows every block table, so it
knows the pool's reference counts and that number is exact; a running request
is never refused. An admission is planned as if nothing were cached (an upper
bound on its cost), and the first admission beyond that estimate is still
sent, since its hit may make it fit.

4. A waiting request that does not fit may preempt running requests of a
   strictly lower (effective) priority, lowest first, when preempting them
   all would make room for it (its cost estimated without its prefix hit).
   Equal priorities never preempt each other, so arrival order holds.
5. Aging (``aging_interval``, in steps; None: off): a request's effective
   priority is its ``priority`` minus one for every ``aging_interval`` steps
   since its admission, running or waiting, preempted or not. So a
   low-priority request waits at most ``aging_interval`` steps per level of
   difference before it outranks every newer arrival: it cannot starve, and
   once it runs, newer arrivals of the old level cannot preempt it.
6. ``pause(request_id)`` preempts a request by recompute (its output kept,
   its computed full blocks committed to the prefix cache) and keeps it out
   of scheduling until ``resume(request_id)``; the actors use it for a
   reader that fell behind.

No deadlock: a request's context is capped at what the whole pool holds
(``min(max_model_len, num_blocks * block_size)``; it finishes with ``LENGTH``
there), and admission refuses a prompt beyond that cap. So the
highest-priority running request always fits once every other is preempted,
and when nothing runs the head waiting request fits the empty pool.

Finished and aborted requests release their blocks in the next batch;
``free_finished(block_manager)`` releases them at once in process.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.core.block_tables import BlockTables
from trioserve.engine.errors import InvalidRequestError, RequestTooLongError
from trioserve.engine.core.kv_batch import KVAllocation, KVBatch, KVBudget, KVCommit, KVResult
from trioserve.engine.plugins import PriorityPolicy, SchedulingPolicy
from trioserve.engine.core.sequence import FinishReason, Request, RequestStatus
from trioserve.engine.sampling.speculative import NgramProposer, may_speculate
from trioserve.engine.runtime.step_plan import ScheduledChunk, StepPlan
from trioserve.engine.sampling.rows import SamplingRow


@attrs.frozen
class SchedulerOutput:
    """What one ``finalize`` decided: the step's ``plan`` (the value the
    runner gets), and for the caller in this process the ids preempted this
    step and the requests that finished or were aborted since the last step,
    whose blocks this step's batch released."""

    plan: StepPlan
    preempted: tuple[str, ...]
    finished: tuple[Request, ...]

    @property
    def chunks(self) -> tuple[ScheduledChunk, ...]:
        return self.plan.chunks

    @property
    def num_batched_tokens(self) -> int:
        return self.plan.num_batched_tokens

    @property
    def is_empty(self) -> bool:
        return self.plan.is_empty


@attrs.frozen
class SchedulerStatistics:
    """Queue lengths, preemptions and the pool's last budget."""

    num_waiting: int
    num_running: int
    num_preemptions: int  # since start
    kv: KVBudget  # the pool as of the last batch
    num_paused: int = 0  # out of scheduling until resumed
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed, since start
    num_accepted_tokens: int = 0  # ... and of those, accepted

    @property
    def kv_usage(self) -> float:
        return self.kv.usage


@attrs.define
class _InFlight:
    batch: KVBatch
    preempted: tuple[str, ...]
    finished: tuple[Request, ...]


@attrs.define
class _StepBudget:
    """What is left of one step's budgets while ``propose`` plans it."""

    tokens: int
    free_blocks: int
    planned: dict[str, tuple[int, int]] = attrs.field(factory=dict)  # running id -> (tokens, new blocks)
    preempted: list[str] = attrs.field(factory=list)


@attrs.define
class Scheduler:
    """Continuous batching over a KV pool of ``num_blocks`` x ``block_size``.

    Requests reach ``add_request`` validated (``EngineCore.validate``); the
    scheduler only checks what depends on its own state: the id is free and
    the request could ever fit the pool.
    """

    max_num_seqs: int = attrs.field(kw_only=True)
    max_num_batched_tokens: int = attrs.field(kw_only=True)
    max_model_len: int = attrs.field(kw_only=True)
    num_blocks: int = attrs.field(kw_only=True)
    block_size: int = attrs.field(kw_only=True)
    aging_interval: int | None = attrs.field(default=None, kw_only=True)
    # Speculative decoding (engine/sampling/speculative.py): a decoding sequence that
    # may speculate runs [last token, proposal] when the proposal's tokens
    # and blocks fit this step without preempting anyone.
    proposer: NgramProposer | None = attrs.field(default=None, kw_only=True)
    _drafts: dict[str, tuple[int, ...]] = attrs.field(init=False, factory=dict)  # planned this step
    _num_draft_tokens: int = attrs.field(init=False, default=0)
    _num_accepted_tokens: int = attrs.field(init=False, default=0)
    # The order of waiting requests and the choice of victims (engine/plugins.py);
    # None: the built-in PriorityPolicy with aging_interval.
    policy: SchedulingPolicy | None = attrs.field(default=None, kw_only=True)
    _requests: dict[str, Request] = attrs.field(init=False, factory=dict)  # unfinished
    _waiting: list[Request] = attrs.field(init=False, factory=list)  # sorted by _key
    _running: list[Request] = attrs.field(init=False, factory=list)
    # The pool's block tables as this scheduler knows them: running requests
    # plus finished or preempted ones whose free is not sent yet.
    _tables: BlockTables = attrs.field(init=False, factory=BlockTables)
    _to_free: dict[str, Request] = attrs.field(init=False, factory=dict)
    _finished: list[Request] = attrs.field(init=False, factory=list)  # to report in the next output
    # Ended sequences the runner has not been told of (it keeps their
    # sampling state until a plan lists them in ``released``).
    _released: list[str] = attrs.field(init=False, factory=list)
    _budget: KVBudget = attrs.field(init=False)
    _in_flight: _InFlight | None = attrs.field(init=False, default=None)
    _next_arrival: int = attrs.field(init=False, default=0)
    _num_preemptions: int = attrs.field(init=False, default=0)
    _num_steps: int = attrs.field(init=False, default=0)
    _admitted_step: dict[str, int] = attrs.field(init=False, factory=dict)  # for aging
    _paused: dict[str, Request] = attrs.field(init=False, factory=dict)
    # What pause() owes the pool, sent with the next batch (the tables of
    # _pause_frees stay in _tables until then, as the pool still holds them).
    _pause_commits: list[KVCommit] = attrs.field(init=False, factory=list)
    _pause_frees: list[str] = attrs.field(init=False, factory=list)
    _running_limit: int | None = attrs.field(init=False, default=None)
    _forget_cache: bool = attrs.field(init=False, default=False)  # sent with the next batch (recompute_all)

    def __attrs_post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.aging_interval is not None and self.aging_interval <= 0:
            raise ValueError(f"aging_interval must be > 0 or None, got {self.aging_interval!r}")
        if self.policy is None:
            self.policy = PriorityPolicy(self.aging_interval)
        self._budget = KVBudget(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_blocks,
            num_cached_blocks=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_evictions=0,
        )

    @property
    def max_context_len(self) -> int:
        """The longest a request may grow: ``max_model_len``, or less if the
        whole pool holds less."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    # -- requests -------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Raise ``RequestTooLongError`` (field ``prompt``) if a prompt this
        long plus one generated token exceeds ``max_model_len`` or could
        never fit the KV pool. The edge calls it before ``add_request``."""
        needed = num_prompt_tokens + 1
        if needed > self.max_model_len:
            raise RequestTooLongError(
                f"prompt has {num_prompt_tokens} tokens; with one generated token that exceeds "
                f"max_model_len ({self.max_model_len})",
                field="prompt",
            )
        if needed > self.num_blocks * self.block_size:
            raise RequestTooLongError(
                f"prompt has {num_prompt_tokens} tokens; with one generated token it needs "
                f"{math.ceil(needed / self.block_size)} KV blocks of {self.block_size} tokens, "
                f"but the KV pool has only {self.num_blocks}",
                field="prompt",
            )

    def add_request(self, request: Request) -> None:
        """Admit a request to the waiting queue and set its ``arrival_index``.

        The request fits (the edge called ``check_fits``). Raises ``InvalidRequestError`` if its id
        is still in use here (unfinished, or its blocks not yet released).
        """
        if request.request_id in self._requests or request.request_id in self._to_free:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use", field="request_id")
        assert request.num_tokens + 1 <= self.max_context_len, f"request {request.request_id!r} can never fit"
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._admitted_step[request.request_id] = self._num_steps
        bisect.insort(self._waiting, request, key=self._key)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish an unfinished request from outside (a stop string, a
        deadline, an error). Its blocks are released by the next batch.
        Return the request, or None if there is no such unfinished request."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._finish(request, reason)
        return request

    def abort(self, request_id: str) -> bool:
        """Finish a request with ``ABORT``; False if it was not unfinished.
        Its blocks are released by the next batch (``free_finished`` does it
        at once in process)."""
        return self.finish_request(request_id, FinishReason.ABORT) is not None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]
        self._admitted_step.pop(request.request_id, None)
        if request in self._running:
            self._running.remove(request)
        elif request in self._waiting:
            self._waiting.remove(request)
        else:
            self._paused.pop(request.request_id, None)
        self._to_free[request.request_id] = request
        self._finished.append(request)
        self._released.append(request.request_id)

    # -- one step -------------------------------------------------------------

    def schedule(self, block_manager: BlockManager) -> SchedulerOutput:
        """Plan a step against an in-process pool. The pool applies the
        batch's frees before its allocations, so the blocks of requests that
        finished or were aborted since the last step are reusable at once."""
        batch = self.propose()
        return self.finalize(batch, block_manager.apply(batch))

    def free_finished(self, block_manager: BlockManager) -> tuple[Request, ...]:
        """Release the blocks of finished and aborted requests now, in
        process; return those requests (they are not reported again)."""
        batch = self.propose_release()
        return self.finalize(batch, block_manager.apply(batch)).finished

    def has_blocks_to_free(self) -> bool:
        """Whether requests finished or aborted since the last batch still
        hold their blocks (``free_finished`` gives them back now)."""
        return bool(self._to_free)

    def propose_release(self) -> KVBatch:
        """A batch that only commits and frees, for releasing blocks between
        steps. Must be followed by ``finalize``."""
        self._check_not_in_flight()
        commits, frees, _ = self._release_pending()
        batch = KVBatch(commits=commits, frees=frees, forget_cache=self._take_forget())
        self._in_flight = _InFlight(batch, (), self._take_finished())
        return batch

    def propose(self) -> KVBatch:
        """Decide this step's work and preemptions; return the pool's batch.
        Must be followed by ``finalize`` with the pool's answer."""
        self._check_not_in_flight()
        self._num_steps += 1
        if self.aging_interval or not isinstance(self.policy, PriorityPolicy):
            self._waiting.sort(key=self._key)  # effective priorities moved on
        commits, frees, num_freed = self._release_pending()
        step = _StepBudget(tokens=self.max_num_batched_tokens, free_blocks=self._budget.num_free_blocks + num_freed)
        self._drafts.clear()

        decodes = [r for r in self._running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self._running if r.num_tokens - r.num_computed_tokens > 1]
        for request in sorted(decodes, key=self._key) + sorted(prefills, key=self._key):
            if step.tokens == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = min(request.num_tokens - request.num_computed_tokens, step.tokens)
            num_blocks = max(0, self._blocks_for(request.num_computed_tokens + num_tokens) - len(request.block_ids))
            if self.proposer is not None and num_tokens == 1 and request.num_output_tokens > 0:
                num_tokens, num_blocks = self._plan_draft(request, step, num_blocks)
            while num_blocks > step.free_blocks and request.status is RequestStatus.RUNNING:
                self._preempt_planned(max(self._running, key=self._key), step)
            if request.status is RequestStatus.RUNNING:
                step.planned[request.request_id] = (num_tokens, num_blocks)
                step.free_blocks -= num_blocks
                step.tokens -= num_tokens

        admissions = [] if step.preempted else self._plan_admissions(step)
        allocations = [
            KVAllocation(rid, self._requests[rid].num_computed_tokens, num_tokens)
            for rid, (num_tokens, _) in step.planned.items()
        ]
        batch = KVBatch(
            commits=commits,
            frees=frees + step.preempted,
            allocations=allocations + admissions,
            forget_cache=self._take_forget(),
        )
        self._in_flight = _InFlight(batch, tuple(step.preempted), self._take_finished())
        return batch

    def _plan_admissions(self, step: _StepBudget) -> list[KVAllocation]:
        """Admit waiting requests in order while the budgets last (a
        waiting request may preempt strictly lower priorities)."""
        admissions: list[KVAllocation] = []
        num_seqs = len(self._running)
        for request in list(self._waiting):  # a snapshot: preemption below inserts
            if num_seqs >= self.running_limit or step.tokens == 0:
                break
            num_tokens = min(request.num_tokens, step.tokens)
            needed = self._blocks_for(num_tokens)
            if needed > step.free_blocks:
                # Preempt strictly lower priorities, lowest first, if
                # preempting all of them would make room.
                key = self._key(request)
                outranked = (r for r in self._running if self.policy.outranks(key, self._key(r)))
                victims = sorted(outranked, key=self._key, reverse=True)
                reclaimable = sum(
                    self._tables.sole_blocks(v.request_id) + step.planned.get(v.request_id, (0, 0))[1] for v in victims
                )
                for victim in victims if step.free_blocks + reclaimable >= needed else ():
                    if step.free_blocks >= needed:
                        break
                    self._preempt_planned(victim, step)
                    num_seqs -= 1
                num_tokens = min(request.num_tokens, step.tokens)
            admissions.append(KVAllocation(request.request_id, 0, num_tokens, request.all_token_ids))
            num_seqs += 1
            step.tokens -= num_tokens
            step.free_blocks -= self._blocks_for(num_tokens)
            if step.free_blocks < 0:
                break  # the pool decides whether its prefix hit makes it fit
        return admissions

    def _preempt_planned(self, victim: Request, step: _StepBudget) -> None:
        """Preempt ``victim`` while planning: give back what was planned for
        it this step and the blocks its free returns."""
        undone_tokens, undone_blocks = step.planned.pop(victim.request_id, (0, 0))
        self._drafts.pop(victim.request_id, None)
        step.tokens += undone_tokens
        self._running.remove(victim)
        step.free_blocks += undone_blocks + self._tables.drop(victim.request_id)
        self._reset_for_recompute(victim)
        bisect.insort(self._waiting, victim, key=self._key)
        step.preempted.append(victim.request_id)

    def finalize(self, batch: KVBatch, result: KVResult) -> SchedulerOutput:
        """Turn the pool's answer to ``batch`` into this step's plan."""
        if self._in_flight is None or self._in_flight.batch is not batch:
            raise ValueError("finalize() needs the batch the last propose() returned")
        if len(result.block_tables) != len(batch.allocations):
            raise ValueError(
                f"result has {len(result.block_tables)} block tables for {len(batch.allocations)} allocations"
            )
        in_flight, self._in_flight = self._in_flight, None
        self._budget = result.budget
        chunks: list[ScheduledChunk] = []
        for allocation, table, num_cached in zip(batch.allocations, result.block_tables, result.num_cached_tokens):
            if table is None:
                continue  # an admission stays waiting; a running request sits this step out
            rid = allocation.request_id
            self._tables.set(rid, table)
            request = self._requests.get(rid)
            if request is None:
                # Finished while the batch was in flight: _finish queued its
                # free, which the next batch sends after this allocation.
                assert rid in self._to_free, f"request {rid!r} got blocks but is unknown"
                continue
            request.block_ids = list(table)
            start = allocation.num_computed_tokens
            num_tokens = allocation.num_new_tokens
            if request.status is not RequestStatus.RUNNING:
                if request.status is RequestStatus.WAITING:
                    request.num_cached_tokens = num_cached
                start = num_cached
                num_tokens = min(num_tokens, request.num_tokens - num_cached)
                request.num_computed_tokens = num_cached
                self._tables.set_committed(rid, num_cached)
                self._waiting.remove(request)
                self._running.append(request)
                request.status = RequestStatus.RUNNING
            chunks.append(self._chunk(request, start, num_tokens, table, self._drafts.pop(rid, ())))
        released = ()
        if chunks:
            # A plan without chunks never reaches the runner: keep them for the next.
            released, self._released = tuple(self._released), []
        return SchedulerOutput(
            plan=StepPlan(chunks=tuple(chunks), released=released),
            preempted=in_flight.preempted,
            finished=in_flight.finished,
        )

    def _plan_draft(self, request: Request, step: _StepBudget, num_blocks: int) -> tuple[int, int]:
        """A decoding request's tokens and new blocks this step with its
        proposal, if it may speculate and the proposal fits what is left of
        the step (else its plain 1 token and ``num_blocks``)."""
        assert self.proposer is not None
        params = request.sampling_params
        if not may_speculate(params, request.num_output_tokens):
            return 1, num_blocks
        # Room for the proposal and the token after it: past a limit the
        # tokens would be cut anyway.
        limit = min(step.tokens - 1, self.max_context_len - request.num_tokens)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
        if request.draft_limit is not None:
            limit = min(limit, request.draft_limit)
        draft = self.proposer.propose(request.all_token_ids, limit)
        if not draft:
            return 1, num_blocks
        num_tokens = 1 + len(draft)
        blocks = max(0, self._blocks_for(request.num_computed_tokens + num_tokens) - len(request.block_ids))
        if blocks > step.free_blocks:
            return 1, num_blocks  # speculation never preempts
        self._drafts[request.request_id] = draft
        return num_tokens, blocks

    @staticmethod
    def _chunk(
        request: Request, start: int, num_tokens: int, table: tuple[int, ...], draft: tuple[int, ...] = ()
    ) -> ScheduledChunk:
        """The chunk's value: its tokens sliced from the prompt or the output
        (a decode step copies one token, never the whole sequence), then a
        proposal to verify."""
        prompt, output = request.prompt_token_ids, request.output_token_ids
        num_tokens -= len(draft)
        end = start + num_tokens
        if start >= len(prompt):
            tokens = tuple(output[start - len(prompt) : end - len(prompt)])
        elif end <= len(prompt):
            tokens = tuple(prompt[start:end])
        else:
            tokens = (*prompt[start:], *output[: end - len(prompt)])
        sampling = None
        if end == request.num_tokens:
            sampling = SamplingRow.for_sequence(
                request.request_id, request.sampling_params, prompt, output, request.eos_token_ids
            )
        return ScheduledChunk(request.request_id, start, tokens + draft, table, sampling, len(draft))

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, int],
        extra_tokens: Mapping[str, Sequence[int]] | None = None,
    ) -> list[Request]:
        """Advance every chunk's request, append sampled tokens and apply
        token-level stops; return the requests that finished.

        ``sampled`` maps the id of each chunk that samples to its new token;
        ``extra_tokens`` a speculating chunk's tokens after it (its accepted
        proposals, then one more). A speculating request advances by the
        tokens accepted; the rest of its chunk is rolled back (its slots are
        overwritten later). Tokens after a stop are dropped.
        A request finished since the plan was made is skipped.
        """
        finished: list[Request] = []
        for chunk in output.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            assert request.num_computed_tokens == chunk.start, (
                f"request {request.request_id!r} has {request.num_computed_tokens} computed tokens, "
                f"chunk starts at {chunk.start}"
            )
            if not chunk.samples:
                request.num_computed_tokens += chunk.num_tokens
                continue
            if request.request_id not in sampled:
                raise ValueError(f"no sampled token for request {request.request_id!r}, whose chunk samples")
            tokens = [sampled[request.request_id]]
            if chunk.num_draft_tokens:
                tokens.extend((extra_tokens or {}).get(request.request_id, ()))
                accepted = len(tokens) - 1
                assert accepted <= chunk.num_draft_tokens, f"{accepted} tokens accepted of {chunk.num_draft_tokens}"
                self._num_draft_tokens += chunk.num_draft_tokens
                self._num_accepted_tokens += accepted
                assert self.proposer is not None
                request.draft_limit = self.proposer.next_limit(chunk.num_draft_tokens, accepted)
            request.num_computed_tokens += chunk.num_tokens - chunk.num_draft_tokens + len(tokens) - 1
            for token in tokens:
                request.output_token_ids.append(token)
                reason = self._stop_reason(request)
                if reason is not None:
                    self._finish(request, reason)
                    finished.append(request)
                    break
            # Cut at a stop, accepted tokens past it are not computed tokens either.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
        return finished

    def _stop_reason(self, request: Request) -> FinishReason | None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                return FinishReason.STOP
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_context_len:
            return FinishReason.LENGTH
        return None

    # -- helpers --------------------------------------------------------------

    def _check_not_in_flight(self) -> None:
        if self._in_flight is not None:
            raise RuntimeError("the previous batch is still in flight: call finalize() first")

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _take_finished(self) -> tuple[Request, ...]:
        finished, self._finished = tuple(self._finished), []
        return finished

    def _commit_for(self, request: Request) -> KVCommit | None:
        done = self._tables.committed(request.request_id)
        full = request.num_computed_tokens // self.block_size * self.block_size
        if full <= done or request.request_id not in self._tables:
            return None
        self._tables.set_committed(request.request_id, full)
        return KVCommit(request.request_id, request.all_token_ids[done:full])

    def _release_pending(self) -> tuple[list[KVCommit], list[str], int]:
        """Commits for every holder, frees for finished and paused ones, and
        how many blocks those frees return to the pool."""
        holders: Iterable[Request] = [*self._running, *self._to_free.values()]
        commits = self._pause_commits + [c for c in map(self._commit_for, holders) if c is not None]
        frees = list(dict.fromkeys([*self._pause_frees, *self._to_free]))
        num_freed = sum(self._tables.drop(rid) for rid in frees)
        self._to_free.clear()
        self._pause_commits, self._pause_frees = [], []
        return commits, frees, num_freed

    def _key(self, request: Request) -> tuple[float, ...]:
        """The policy's key: lower runs first and is preempted last. The
        built-in one is (effective priority, arrival), aging taking one level
        off per ``aging_interval`` steps since admission."""
        age = self._num_steps - self._admitted_step.get(request.request_id, self._num_steps)
        return self.policy.key(request, age)

    def _reset_for_recompute(self, request: Request) -> None:
        """A preempted request: no blocks, nothing computed, output kept."""
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.block_ids = []
        request.num_preemptions += 1
        self._num_preemptions += 1

    def _take_forget(self) -> bool:
        forget, self._forget_cache = self._forget_cache, False
        return forget

    def recompute_all(self) -> list[str]:
        """The KV cache's content is lost (the worker process that held it
        died): preempt every running request by recompute, its output kept,
        and have the next batch free their blocks and make the pool forget
        its prefix cache (``KVBatch.forget_cache``), so nothing is read from
        the lost tensors. Returns the preempted ids."""
        self._check_not_in_flight()
        preempted = []
        for request in list(self._running):
            self._running.remove(request)
            self._pause_frees.append(request.request_id)
            self._reset_for_recompute(request)
            bisect.insort(self._waiting, request, key=self._key)
            preempted.append(request.request_id)
        self._forget_cache = True
        return preempted

    # -- pausing ----------------------------------------------------------------

    def pause(self, request_id: str) -> bool:
        """Preempt an unfinished request by recompute and skip it until
        ``resume``; its output is kept and its computed full blocks are
        committed to the prefix cache with the next batch, which also frees
        its blocks. False if it is not unfinished or already paused."""
        self._check_not_in_flight()
        request = self._requests.get(request_id)
        if request is None or request_id in self._paused:
            return False
        if request.status is RequestStatus.RUNNING:
            commit = self._commit_for(request)
            if commit is not None:
                self._pause_commits.append(commit)
            self._running.remove(request)
            self._pause_frees.append(request_id)
            self._reset_for_recompute(request)
        else:
            self._waiting.remove(request)
        self._paused[request_id] = request
        return True

    def resume(self, request_id: str) -> bool:
        """Let a paused request be scheduled again; False if not paused."""
        request = self._paused.pop(request_id, None)
        if request is None:
            return False
        bisect.insort(self._waiting, request, key=self._key)
        return True

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    # -- the running limit --------------------------------------------------------

    @property
    def running_limit(self) -> int:
        """How many sequences may run at once now: ``max_num_seqs``, or less
        while ``limit_running`` holds it lower."""
        if self._running_limit is None:
            return self.max_num_seqs
        return min(self._running_limit, self.max_num_seqs)

    def limit_running(self, limit: int | None) -> None:
        """Admit waiting requests only while fewer than ``limit`` sequences
        run (None: ``max_num_seqs``). Lowering it preempts nothing: the
        sequences running beyond it finish, and none starts until the number
        running is below it (adaptive concurrency, actors/concurrency.py)."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit!r}")
        self._running_limit = limit

    # -- introspection ----------------------------------------------------------

    def block_holders(self) -> Mapping[str, tuple[int, ...]]:
        """Request id -> block table, as the pool holds them (for
        ``BlockManager.check_invariants``)."""
        return self._tables.as_dict()

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_preemptions=self._num_preemptions,
            kv=self._budget,
            num_paused=len(self._paused),
            num_draft_tokens=self._num_draft_tokens,
            num_accepted_tokens=self._num_accepted_tokens,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the queues or block tables are
        inconsistent (tests call it after every step)."""
        if self._in_flight is not None:
            raise AssertionError("a batch is in flight")
        if len(self._running) > self.max_num_seqs:
            raise AssertionError(f"{len(self._running)} running requests exceed max_num_seqs ({self.max_num_seqs})")
        if [self._key(r) for r in self._waiting] != sorted(self._key(r) for r in self._waiting):
            raise AssertionError("the waiting queue is out of (priority, arrival) order")
        queued = {r.request_id for r in self._running} | {r.request_id for r in self._waiting} | set(self._paused)
        if queued != set(self._requests):
            raise AssertionError("the running, waiting and paused requests are not exactly the unfinished ones")
        for request in [*self._waiting, *self._paused.values()]:
            owed = request.request_id in self._pause_frees  # its free goes with the next batch
            if request.block_ids or request.num_computed_tokens or (request.request_id in self._tables and not owed):
                raise AssertionError(f"waiting request {request.request_id!r} holds blocks or computed tokens")
        for request in self._running:
            table = self._tables.get(request.request_id)
            if table is None or tuple(request.block_ids) != table:
                raise AssertionError(f"running request {request.request_id!r} has no or a stale block table")
            if request.num_computed_tokens > len(table) * self.block_size:
                raise AssertionError(f"request {request.request_id!r} computed more tokens than its blocks hold")
            if request.num_tokens > self.max_context_len:
                raise AssertionError(f"request {request.request_id!r} grew past max_context_len")
        self._tables.check()
