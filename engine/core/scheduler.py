"""The continuous-batching scheduler: which tokens of which requests run next.

A policy object. Each step ``propose()`` decides what to run and what to
preempt (step_planner.py) and returns the one ``KVBatch`` the KV pool must
apply; ``finalize()`` turns the pool's ``KVResult`` into a
``SchedulerOutput`` (the plan); the runner executes the plan;
``update_from_output()`` applies the sampled tokens and their stops.
``schedule(block_manager)`` does the first two in process.

Its parts, each a module of this package: the requests by state
(``request_queues``), the pool as the scheduler knows it and the commits
and frees it owes it (``kv_ledger``), one step's plan (``step_planner``),
speculative proposals (``drafts``), a request's chunk and its stops
(``chunks``).

The order of requests is the policy's key (engine/plugins.py; the
built-in one is (effective priority, arrival)). Aging (``aging_interval``,
in steps; None: off): a request's effective priority is its ``priority``
minus one for every ``aging_interval`` steps since its admission, running
or waiting, preempted or not. So a low-priority request waits at most
``aging_interval`` steps per level of difference before it outranks every
newer arrival: it cannot starve, and once it runs, newer arrivals of the
old level cannot preempt it.

``pause(request_id)`` preempts a request by recompute (its output kept, its
computed full blocks committed to the prefix cache) and keeps it out of
scheduling until ``resume(request_id)``; the actors use it for a reader
that fell behind.

No deadlock: a request's context is capped at what the whole pool holds
(``min(max_model_len, num_blocks * block_size)``; it finishes with ``LENGTH``
there), and admission refuses a prompt beyond that cap. So the
highest-priority running request always fits once every other is preempted,
and when nothing runs the head waiting request fits the empty pool.

A policy may also cut a step's token budget (``token_budget``), learn
from each step's time (``observe_step``, measured by ``clock`` from the
plan to the sampled tokens) and, with every sequence slot taken, name a
running request to preempt for the head waiting request's slot
(``slot_victim``). The ``slo`` policy (slo_policy.py) cuts the budget so
that chunked prefill stays within running requests' TPOT targets, and
preempts for a slot a request whose deadline would be missed waiting; it
learns from its latency model, which its driver feeds (the scheduler actor).

Finished and aborted requests release their blocks in the next batch;
``free_finished(block_manager)`` releases them at once in process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

import attrs

from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.core.chunks import append_tokens, chunk_for
from trioserve.engine.core.drafts import Drafts
from trioserve.engine.core.kv_batch import KVBatch, KVResult
from trioserve.engine.core.kv_ledger import KVLedger
from trioserve.engine.core.request_queues import RequestQueues
from trioserve.engine.core.scheduler_output import SchedulerOutput, SchedulerStatistics
from trioserve.engine.core.sequence import FinishReason, Request, RequestStatus
from trioserve.engine.core.slo_policy import StepLimits
from trioserve.engine.core.step_planner import StepPlanner
from trioserve.engine.errors import InvalidRequestError, RequestTooLongError
from trioserve.engine.plugins import PriorityPolicy, SchedulingPolicy
from trioserve.engine.runtime.step_plan import ScheduledChunk, StepPlan
from trioserve.engine.sampling.speculative import NgramProposer

__all__ = ["Scheduler", "SchedulerOutput", "SchedulerStatistics"]


@attrs.define
class _InFlight:
    batch: KVBatch
    preempted: tuple[str, ...]
    finished: tuple[Request, ...]


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
    _drafts: Drafts = attrs.field(init=False, factory=Drafts)  # engine/core/drafts.py
    # The order of waiting requests and the choice of victims (engine/plugins.py);
    # None: the built-in PriorityPolicy with aging_interval.
    policy: SchedulingPolicy | None = attrs.field(default=None, kw_only=True)
    # The time steps are measured by, for a policy that learns their cost
    # (``observe_step``); tests give a fake one.
    clock: Callable[[], float] = attrs.field(default=time.monotonic, kw_only=True)
    _step_started: tuple[float, int] | None = attrs.field(init=False, default=None)  # (clock, tokens)
    # The unfinished requests: waiting (in _key order), running, paused.
    _queues: RequestQueues = attrs.field(init=False)
    # The pool as this scheduler knows it, and the commits and frees it owes
    # it (engine/core/kv_ledger.py).
    _kv: KVLedger = attrs.field(init=False)
    _finished: list[Request] = attrs.field(init=False, factory=list)  # to report in the next output
    # Ended sequences the runner has not been told of (it keeps their
    # sampling state until a plan lists them in ``released``).
    _released: list[str] = attrs.field(init=False, factory=list)
    _in_flight: _InFlight | None = attrs.field(init=False, default=None)
    _num_steps: int = attrs.field(init=False, default=0)
    _admitted_step: dict[str, int] = attrs.field(init=False, factory=dict)  # for aging
    _running_limit: int | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.aging_interval is not None and self.aging_interval <= 0:
            raise ValueError(f"aging_interval must be > 0 or None, got {self.aging_interval!r}")
        if self.policy is None:
            self.policy = PriorityPolicy(self.aging_interval)
        self._kv = KVLedger(self.num_blocks, self.block_size)
        self._queues = RequestQueues(self._key)

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
        if request.request_id in self._queues.requests or self._kv.owes_free(request.request_id):
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use", field="request_id")
        assert request.num_tokens + 1 <= self.max_context_len, f"request {request.request_id!r} can never fit"
        self._admitted_step[request.request_id] = self._num_steps
        self._queues.add(request)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._queues.requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._queues.requests)

    @property
    def num_waiting(self) -> int:
        return len(self._queues.waiting)

    @property
    def num_running(self) -> int:
        return len(self._queues.running)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish an unfinished request from outside (a stop string, a
        deadline, an error). Its blocks are released by the next batch.
        Return the request, or None if there is no such unfinished request."""
        request = self._queues.requests.get(request_id)
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
        self._queues.remove(request)
        self._admitted_step.pop(request.request_id, None)
        self._kv.free_finished(request)
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
        return self._kv.has_finished()

    def propose_release(self) -> KVBatch:
        """A batch that only commits and frees, for releasing blocks between
        steps. Must be followed by ``finalize``."""
        self._check_not_in_flight()
        commits, frees, _ = self._kv.take_release(self._queues.running)
        batch = KVBatch(commits=commits, frees=frees, forget_cache=self._kv.take_forget())
        self._in_flight = _InFlight(batch, (), self._take_finished())
        return batch

    def propose(self) -> KVBatch:
        """Decide this step's work and preemptions (step_planner.py); return
        the pool's batch. Must be followed by ``finalize`` with the pool's answer."""
        self._check_not_in_flight()
        self._num_steps += 1
        if self.aging_interval or not isinstance(self.policy, PriorityPolicy):
            self._queues.resort()  # effective priorities moved on
        commits, frees, num_freed = self._kv.take_release(self._queues.running)
        self._drafts.clear()
        assert self.policy is not None
        step = StepPlanner(
            self._queues,
            self._kv,
            self._drafts,
            self._key,
            self.policy,
            self.proposer,
            self.block_size,
            self.max_context_len,
            tokens=self._token_budget(),
            free_blocks=self._kv.budget.num_free_blocks + num_freed,
            slot_victim=self._slot_victim if hasattr(self.policy, "slot_victim") else None,
        )
        step.plan_running()
        admissions = [] if step.preempted else step.plan_admissions(self.running_limit)
        batch = KVBatch(
            commits=commits,
            frees=frees + step.preempted,
            allocations=step.allocations() + admissions,
            forget_cache=self._kv.take_forget(),
        )
        self._in_flight = _InFlight(batch, tuple(step.preempted), self._take_finished())
        return batch

    def finalize(self, batch: KVBatch, result: KVResult) -> SchedulerOutput:
        """Turn the pool's answer to ``batch`` into this step's plan."""
        if self._in_flight is None or self._in_flight.batch is not batch:
            raise ValueError("finalize() needs the batch the last propose() returned")
        if len(result.block_tables) != len(batch.allocations):
            raise ValueError(
                f"result has {len(result.block_tables)} block tables for {len(batch.allocations)} allocations"
            )
        in_flight, self._in_flight = self._in_flight, None
        self._kv.budget = result.budget
        chunks: list[ScheduledChunk] = []
        # The window group's tables (block_manager.py) go to the plan as the
        # pool gave them: the scheduler plans against the first group only.
        window_tables = result.window_tables or (None,) * len(batch.allocations)
        for allocation, table, num_cached, window_table in zip(
            batch.allocations, result.block_tables, result.num_cached_tokens, window_tables
        ):
            if table is None:
                continue  # an admission stays waiting; a running request sits this step out
            rid = allocation.request_id
            self._kv.tables.set(rid, table)
            request = self._queues.requests.get(rid)
            if request is None:
                # Finished while the batch was in flight: _finish queued its
                # free, which the next batch sends after this allocation.
                assert self._kv.owes_free(rid), f"request {rid!r} got blocks but is unknown"
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
                self._kv.tables.set_committed(rid, num_cached)
                self._queues.start(request)
            chunks.append(chunk_for(request, start, num_tokens, table, self._drafts.take(rid), window_table))
        released = ()
        self._step_started = (self.clock(), sum(c.num_tokens for c in chunks)) if chunks else None
        if chunks:
            # A plan without chunks never reaches the runner: keep them for the next.
            released, self._released = tuple(self._released), []
        return SchedulerOutput(
            plan=StepPlan(chunks=tuple(chunks), released=released),
            preempted=in_flight.preempted,
            finished=in_flight.finished,
        )

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
        self._observe_step()
        finished: list[Request] = []
        for chunk in output.chunks:
            request = self._queues.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            assert request.num_computed_tokens == chunk.start, (
                f"request {request.request_id!r} has {request.num_computed_tokens} computed tokens, "
                f"chunk starts at {chunk.start}"
            )
            if not chunk.samples:
                request.num_computed_tokens += chunk.num_tokens
                if request.pooling is not None and request.num_computed_tokens == request.num_tokens:
                    # An embedding request ends with its prompt: its vector is pooled.
                    self._finish(request, FinishReason.STOP)
                    finished.append(request)
                continue
            if request.request_id not in sampled:
                raise ValueError(f"no sampled token for request {request.request_id!r}, whose chunk samples")
            tokens = [sampled[request.request_id]]
            if chunk.num_draft_tokens:
                tokens.extend((extra_tokens or {}).get(request.request_id, ()))
                assert self.proposer is not None
                self._drafts.verified(request, self.proposer, chunk.num_draft_tokens, len(tokens) - 1)
            reason = append_tokens(request, chunk, tokens, self.max_context_len)
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)
        return finished

    # -- helpers --------------------------------------------------------------

    def _check_not_in_flight(self) -> None:
        if self._in_flight is not None:
            raise RuntimeError("the previous batch is still in flight: call finalize() first")

    def _token_budget(self) -> int:
        """``max_num_batched_tokens``, or less where the policy cuts it
        (``token_budget``: the slo policy keeps a step within its running
        requests' TPOT targets)."""
        token_budget = getattr(self.policy, "token_budget", None)
        if token_budget is None:
            return self.max_num_batched_tokens
        budget = token_budget(self._queues.running, self.max_num_batched_tokens, self.clock())
        return max(1, min(self.max_num_batched_tokens, budget))

    def _slot_limits(self) -> StepLimits:
        return StepLimits(self.max_num_batched_tokens, self.running_limit, self.max_context_len)

    def _slot_victim(self, request: Request, admitted: Sequence[Request]) -> Request | None:
        """The policy's ``slot_victim`` for ``request``, among the running
        requests it is not outranked by (the step's admissions hold slots too)."""
        key = self._key(request)
        candidates = [r for r in self._queues.running if not self.policy.outranks(self._key(r), key)]
        if not candidates:
            return None
        running = [*self._queues.running, *admitted]
        return self.policy.slot_victim(request, candidates, running=running, now=self.clock(), limits=self._slot_limits())

    def slot_victim_for(self, request: Request) -> Request | None:
        """The running request the policy would preempt this step so that
        ``request`` (not yet added; ahead of every waiting one) gets a
        sequence slot, or None: slots are free, no victim would save its
        deadline, or the policy has no ``slot_victim``. The scheduler actor
        asks it of a request that its bound keeps out of the core."""
        if not hasattr(self.policy, "slot_victim") or len(self._queues.running) < self.running_limit:
            return None
        return self._slot_victim(request, ())

    def slot_victims(self, request: Request) -> list[Request]:
        """The running requests the policy would let ``request`` (not yet
        added) preempt for a sequence slot, most slack first (``victims``
        of the slo policy); none with another policy. SLO admission asks,
        to predict the TTFT of a request that a full batch would delay."""
        victims = getattr(self.policy, "victims", None)
        if victims is None:
            return []
        key = self._key(request)
        candidates = [r for r in self._queues.running if not self.policy.outranks(self._key(r), key)]
        running = list(self._queues.running)
        return victims(request, candidates, running=running, now=self.clock(), limits=self._slot_limits())

    def _observe_step(self) -> None:
        """Tell a policy that learns step costs (``observe_step``) how long
        the step just run took, from its plan to its sampled tokens."""
        started, self._step_started = self._step_started, None
        observe = getattr(self.policy, "observe_step", None)
        if started is not None and observe is not None:
            observe(started[1], self.clock() - started[0])

    def _take_finished(self) -> tuple[Request, ...]:
        finished, self._finished = tuple(self._finished), []
        return finished

    def _key(self, request: Request) -> tuple[float, ...]:
        """The policy's key: lower runs first and is preempted last. The
        built-in one is (effective priority, arrival), aging taking one level
        off per ``aging_interval`` steps since admission."""
        age = self._num_steps - self._admitted_step.get(request.request_id, self._num_steps)
        return self.policy.key(request, age)

    def recompute_all(self) -> list[str]:
        """The KV cache's content is lost (the worker process that held it
        died): preempt every running request by recompute, its output kept,
        and have the next batch free their blocks and make the pool forget
        its prefix cache (``KVBatch.forget_cache``), so nothing is read from
        the lost tensors. Returns the preempted ids."""
        self._check_not_in_flight()
        preempted = []
        for request in list(self._queues.running):
            self._kv.free_lost(request.request_id)
            self._queues.preempt(request)
            preempted.append(request.request_id)
        self._kv.forget_cache()
        return preempted

    # -- pausing ----------------------------------------------------------------

    def pause(self, request_id: str) -> bool:
        """Preempt an unfinished request by recompute and skip it until
        ``resume``; its output is kept and its computed full blocks are
        committed to the prefix cache with the next batch, which also frees
        its blocks. False if it is not unfinished or already paused."""
        self._check_not_in_flight()
        request = self._queues.requests.get(request_id)
        if request is None or request_id in self._queues.paused:
            return False
        if request.status is RequestStatus.RUNNING:
            self._kv.free_paused(request)
        self._queues.pause(request)
        return True

    def resume(self, request_id: str) -> bool:
        """Let a paused request be scheduled again; False if not paused."""
        return self._queues.resume(request_id)

    @property
    def num_paused(self) -> int:
        return len(self._queues.paused)

    @property
    def waiting_requests(self) -> tuple[Request, ...]:
        """The waiting requests, in the order the policy runs them (a copy:
        admission reads it to predict a new request's wait)."""
        return tuple(self._queues.waiting)

    @property
    def running_requests(self) -> tuple[Request, ...]:
        """The running requests (a copy), in the order they started."""
        return tuple(self._queues.running)

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
        return self._kv.tables.as_dict()

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            num_preemptions=self._queues.num_preemptions,
            kv=self._kv.budget,
            num_paused=self.num_paused,
            num_draft_tokens=self._drafts.num_draft_tokens,
            num_accepted_tokens=self._drafts.num_accepted_tokens,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the queues or block tables are
        inconsistent (tests call it after every step)."""
        if self._in_flight is not None:
            raise AssertionError("a batch is in flight")
        queues = self._queues
        if len(queues.running) > self.max_num_seqs:
            raise AssertionError(f"{len(queues.running)} running requests exceed max_num_seqs ({self.max_num_seqs})")
        queues.check()
        for request in [*queues.waiting, *queues.paused.values()]:
            owed = self._kv.owes_free(request.request_id)  # its free goes with the next batch
            if request.block_ids or request.num_computed_tokens or (request.request_id in self._kv.tables and not owed):
                raise AssertionError(f"waiting request {request.request_id!r} holds blocks or computed tokens")
        for request in queues.running:
            table = self._kv.tables.get(request.request_id)
            if table is None or tuple(request.block_ids) != table:
                raise AssertionError(f"running request {request.request_id!r} has no or a stale block table")
            if request.num_computed_tokens > len(table) * self.block_size:
                raise AssertionError(f"request {request.request_id!r} computed more tokens than its blocks hold")
            if request.num_tokens > self.max_context_len:
                raise AssertionError(f"request {request.request_id!r} grew past max_context_len")
        self._kv.tables.check()
