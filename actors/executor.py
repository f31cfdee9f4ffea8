"""The executor actor: runs the model step, one at a time, under a watchdog.

``ModelExecutor`` runs ``ModelRunner.execute`` on the engine's
``StepThread`` (one long-lived thread for all its torch work; see
``trioserve.engine.runtime.step_thread``), so the event loop goes on admitting,
aborting and delivering while the step computes. A step is not cancellable
once started: its thread finishes, and aborts are applied after it.

Faults (docs/reliability.md):

- a step that raises becomes ``StepFailed``: only that step's requests
  fail; the actor keeps serving;
- a step that does not return within ``watchdog_timeout`` seconds is
  *hung*: the actor answers ``StepFailed`` with a ``StepHung`` error and a
  ``released`` event, and stops waiting for it. A thread cannot be killed,
  and the hung step may still write its requests' KV blocks when it wakes,
  so the scheduler keeps those blocks quarantined until ``released`` is set
  (the step returned). ``ModelExecutor`` abandons the hung thread and runs
  the next steps on a fresh one (the weights are only read, so two threads
  may run the model at once);
- a step thread that died (``StepThreadDied``) fails the step it was
  running and is replaced; one found closed or dead before a step is
  replaced and the step runs on the new thread, so no request is affected.

A plan that ``awaits_mask`` (structured output: docs/architecture.md) is
followed in the inbox by its ``StepMask``: the step's forward starts at
once, and the actor hands the step the mask when it arrives; the step
samples with it.

``FakeExecutor`` awaits ``trio.sleep`` instead of computing and answers
deterministic tokens, so tests can drive the engine, its faults included,
on trio's ``autojump_clock`` (a worker thread would make virtual time jump
while it runs).
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import outcome
import trio

from trioserve.engine.faults import Fault
from trioserve.engine.sampling.grammar import unpack_bitmask
from trioserve.engine.runtime.model_runner import RunnerOutput, StepLogits
from trioserve.engine.runtime.step_plan import ScheduledChunk, StepPlan
from trioserve.engine.sampling.rows import TokenMask
from trioserve.engine.runtime.step_thread import StepThread, StepThreadClosed, StepThreadDied

from .errors import StepHung
from .messages import RunStep, StepDone, StepFailed, StepMask
from .statistics import ExecutorStatistics
from .step_calls import run_in_step_thread

log = logging.getLogger(__name__)

# One step in flight: the scheduler plans the next step from this one's tokens
# (and the step's StepMask, when it has one, waits here while it computes).
INBOX_CAPACITY = 1

Masks = trio.MemoryReceiveChannel[TokenMask]


class MaskNotSent(RuntimeError):
    """The scheduler's end closed before the step's mask came (shutdown)."""


class Runner(Protocol):
    def execute(self, plan: StepPlan) -> RunnerOutput: ...

    def forward_step(self, plan: StepPlan) -> StepLogits: ...

    def sample_step(self, step: StepLogits, token_mask: TokenMask | None) -> RunnerOutput: ...


class Executor(abc.ABC):
    """The actor loop shared by the real and the fake executor.

    ``watchdog_timeout``: seconds a step may run before it is declared hung
    (None: never).
    """

    def __init__(self, *, watchdog_timeout: float | None = None) -> None:
        if watchdog_timeout is not None and not watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be > 0, got {watchdog_timeout!r}")
        self.watchdog_timeout = watchdog_timeout
        self._num_steps = 0
        self._num_failed = 0
        self._num_hung = 0
        self._num_restarts = 0
        self._busy = 0.0
        self._last = 0.0
        self._in_flight = False
        self._last_fault: Fault | None = None
        self._steps: trio.Nursery | None = None
        self._inbox: trio.MemoryReceiveChannel[RunStep | StepMask] | None = None
        # The cancel scopes of hung steps that have not returned yet.
        self._hung: set[trio.CancelScope] = set()

    async def run(
        self,
        replies: trio.MemorySendChannel[StepDone | StepFailed],
        *,
        task_status: trio.TaskStatus[trio.MemorySendChannel[RunStep | StepMask]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Answer each ``RunStep`` on ``replies``; return when the scheduler
        closes the inbox (without waiting for hung steps)."""
        inbox_send, inbox = trio.open_memory_channel[RunStep | StepMask](INBOX_CAPACITY)
        self._inbox = inbox  # a step that awaits its mask takes it from here
        # The channels close last, once the error (if any) is ready to
        # leave: the scheduler then finds the engine cancelled, not a
        # vanished executor.
        with inbox, replies:
            try:
                async with trio.open_nursery() as steps:
                    self._steps = steps
                    try:
                        task_status.started(inbox_send)
                        async for message in inbox:
                            if isinstance(message, StepMask):
                                # Its step hung past the watchdog before it came.
                                log.warning("the mask of step %d came after its step was given up", message.step_id)
                                continue
                            await replies.send(await self._step(message))
                    finally:
                        # Every step is answered or hung by now: stop waiting for the hung.
                        for scope in self._hung:
                            scope.shield = False
                            scope.cancel()
            except BaseExceptionGroup as group:
                # The steps' nursery is this actor's own business: an error
                # leaves it as it would leave a plain loop.
                if len(group.exceptions) == 1:
                    raise group.exceptions[0] from None
                raise

    async def _step(self, message: RunStep) -> StepDone | StepFailed:
        assert self._steps is not None and self._inbox is not None
        self._in_flight = True
        start = trio.current_time()
        returned = trio.Event()
        result: list[outcome.Outcome[RunnerOutput]] = []
        # Shielded: a step is not abandoned when the engine is cancelled,
        # only by the watchdog (which cancels this scope).
        scope = trio.CancelScope(shield=True)
        masks_send: trio.MemorySendChannel[TokenMask] | None = None
        masks: Masks | None = None
        if message.plan.awaits_mask:
            masks_send, masks = trio.open_memory_channel[TokenMask](1)

        async def run_step() -> None:
            with scope:
                try:
                    if masks is None:
                        output = await self.execute(message.plan)
                    else:
                        output = await self.execute(message.plan, masks)
                    result.append(outcome.Value(output))
                except Exception as exc:
                    result.append(outcome.Error(exc))
            if scope in self._hung:
                self._hung.discard(scope)
                log.warning("the hung step %d returned after %.1f s", message.step_id, trio.current_time() - start)
            returned.set()

        self._steps.start_soon(run_step)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(math.inf if self.watchdog_timeout is None else self.watchdog_timeout):
                if masks_send is not None:
                    await self._pass_mask(self._inbox, message.step_id, masks_send)
                await returned.wait()
        self._in_flight = False
        seconds = self._account(start)
        if not result:
            self._hung.add(scope)
            self._num_hung += 1
            error = StepHung(f"the model step did not return within the watchdog timeout ({self.watchdog_timeout:g} s)")
            self._fault("step_hung", str(error))
            self.step_hung()
            return StepFailed(message.step_id, error, seconds, released=returned)
        if isinstance(result[0], outcome.Error):
            error = result[0].error
            self._num_failed += 1
            died = isinstance(error, (StepThreadDied, StepThreadClosed))
            kind = "step_thread_died" if died else "step_failed"
            self._fault(kind, f"the model step failed: {type(error).__name__}", error)
            self.step_failed(error)
            return StepFailed(message.step_id, error, seconds)
        return StepDone(message.step_id, result[0].unwrap(), seconds)

    @staticmethod
    async def _pass_mask(
        inbox: trio.MemoryReceiveChannel[RunStep | StepMask], step_id: int, masks: trio.MemorySendChannel[TokenMask]
    ) -> None:
        """Hand the running step its mask: the scheduler's next message.
        Closing ``masks`` without one tells the step it never comes."""
        with masks:
            try:
                message = await inbox.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return
            assert isinstance(message, StepMask) and message.step_id == step_id, (
                f"step {step_id} awaits its mask, got {type(message).__name__}"
            )
            try:
                masks.send_nowait(message.mask)
            except trio.BrokenResourceError:
                pass  # the step failed before it needed the mask

    def _account(self, start: float) -> float:
        seconds = trio.current_time() - start
        self._num_steps += 1
        self._busy += seconds
        self._last = seconds
        return seconds

    def _fault(self, kind: str, message: str, error: Exception | None = None) -> None:
        self._last_fault = Fault(kind, message)
        log.error("%s", message, exc_info=error)

    @abc.abstractmethod
    async def execute(self, plan: StepPlan, masks: Masks | None = None) -> RunnerOutput:
        """Run one step and return its sampled tokens. A cancel (only ever
        the watchdog's, at shutdown, for a hung step) must return promptly.

        ``masks`` is given when the plan ``awaits_mask``: its one value is
        the step's ``TokenMask``, which comes while the step computes; the
        forward must not wait for it, the sampling must. Its end without a
        value (``MaskNotSent``) means the scheduler is gone."""

    def step_hung(self) -> None:
        """The step in flight hung past the watchdog and is left behind:
        make ready for the next one."""

    def step_failed(self, error: Exception) -> None:
        """The step raised ``error``: recover if it says the worker is gone."""

    def statistics(self) -> ExecutorStatistics:
        return ExecutorStatistics(
            num_steps=self._num_steps,
            num_failed_steps=self._num_failed,
            busy_seconds=self._busy,
            last_step_seconds=self._last,
            step_in_flight=self._in_flight,
            num_hung_steps=self._num_hung,
            num_hung_steps_running=len(self._hung),
            num_thread_restarts=self._num_restarts,
            last_fault=self._last_fault,
        )


class ModelExecutor(Executor):
    """Runs ``runner.execute`` on ``step_thread``, one step at a time.

    ``runner.execute`` enters ``torch.inference_mode`` itself (grad mode is
    per thread). A step is never abandoned except by the watchdog: it has
    side effects on the KV cache, so a cancel waits for it to finish.
    """

    def __init__(
        self, runner: Runner, step_thread: StepThread | None = None, *, watchdog_timeout: float | None = None
    ) -> None:
        """``step_thread``: the thread that loaded the model (None: a thread
        of the executor's own). Threads the executor starts are its own and
        closed when ``run`` returns; a replaced thread is left to whoever
        made it (closing an abandoned one does not wait)."""
        super().__init__(watchdog_timeout=watchdog_timeout)
        self.runner = runner
        self._owns_thread = step_thread is None
        self.step_thread = StepThread() if step_thread is None else step_thread

    async def run(self, replies: trio.MemorySendChannel[StepDone | StepFailed], **kwargs: Any) -> None:
        try:
            await super().run(replies, **kwargs)
        finally:
            if self._owns_thread:
                self.step_thread.close()  # no step is in flight: they are not cancellable

    async def execute(self, plan: StepPlan, masks: Masks | None = None) -> RunnerOutput:
        if not self.step_thread.usable:
            # Closed or dead between steps: this step has not run, so it
            # runs on a fresh thread and no request notices.
            self._replace_thread(f"the step thread was found {'dead' if not self.step_thread.alive else 'closed'}")
        if masks is None:
            return await run_in_step_thread(self.step_thread, self.runner.execute, plan, abandon_on_cancel=True)
        # The forward starts now; the sampling queues behind it on the same
        # thread as soon as the mask is here (usually before the forward ends).
        with masks:
            forward = self.step_thread.submit(self.runner.forward_step, plan)
            try:
                token_mask = await masks.receive()
            except trio.EndOfChannel:
                # The forward writes the KV cache: let it finish before leaving.
                await run_in_step_thread(self.step_thread, _wait, forward, abandon_on_cancel=True)
                raise MaskNotSent("the scheduler ended before the step's token mask came") from None
        return await run_in_step_thread(
            self.step_thread, _sample_after, self.runner, forward, token_mask, abandon_on_cancel=True
        )

    def step_hung(self) -> None:
        self.step_thread.abandon()
        self._replace_thread("the step thread is hung in a step")

    def step_failed(self, error: Exception) -> None:
        if isinstance(error, (StepThreadDied, StepThreadClosed)):
            self._replace_thread(f"the step thread ended during a step ({type(error).__name__})")

    def _replace_thread(self, why: str) -> None:
        old = self.step_thread
        if self._owns_thread and not old.abandoned:
            old.close()  # closed or dead: nothing runs there
        self.step_thread = old.fresh()
        self._owns_thread = True
        self._num_restarts += 1
        log.warning("%s; the next steps run on a new step thread", why)


def _wait(forward: concurrent.futures.Future[StepLogits]) -> None:
    forward.exception()


def _sample_after(runner: Runner, forward: concurrent.futures.Future[StepLogits], token_mask: TokenMask) -> RunnerOutput:
    # Queued behind the forward on the step thread, so it is done by now;
    # its error, if it raised, is this step's.
    return runner.sample_step(forward.result(), token_mask)


def fake_token(context: Sequence[int], vocab_size: int) -> int:
    """A deterministic 'next token': a function of the whole context (the
    sequence's tokens so far), in [100, min(vocab_size, 1100))."""
    span = max(1, min(vocab_size, 1100) - 100)
    return 100 + (sum(context) * 31 + len(context) * 7) % span


class FakeExecutor(Executor):
    """Sleeps ``step_time + token_time * num_batched_tokens`` (trio time)
    and samples ``token(chunk, context)`` for each sampling chunk.

    Like a real step it keeps a paged KV cache, of token ids: each chunk
    writes its tokens into the slots of its block table, and a sampling
    chunk reads its whole context back from them. So its tokens depend on
    the context only (not on how the plan cut it into chunks), and a plan
    that points a sequence at the wrong blocks gets different tokens.

    Injected faults, by ``step_index`` (counting from 0): ``fail(step_index,
    plan)`` may return an exception to raise from that step; ``delay(
    step_index, plan)`` may return extra seconds that step takes (past the
    watchdog: a hung step).

    A structured output's mask is honoured as a sampler would: a row's
    token is the first allowed one at or after ``token(...)`` (wrapping
    around the vocabulary). A plan that ``awaits_mask`` sleeps its step
    time first (the forward), then waits for the mask; ``masks`` records
    each mask received that way.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        block_size: int,
        step_time: float = 0.01,
        token_time: float = 0.0,
        token: Callable[[ScheduledChunk, Sequence[int]], int] | None = None,
        fail: Callable[[int, StepPlan], Exception | None] | None = None,
        delay: Callable[[int, StepPlan], float] | None = None,
        watchdog_timeout: float | None = None,
    ) -> None:
        super().__init__(watchdog_timeout=watchdog_timeout)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.step_time = step_time
        self.token_time = token_time
        self._token = token or (lambda chunk, context: fake_token(context, vocab_size))
        self._fail = fail
        self._delay = delay
        self._index = 0
        self._slots: dict[int, int] = {}  # slot -> token id written there
        self.plans: list[StepPlan] = []  # every plan run, for tests
        self.masks: list[TokenMask] = []  # every mask that came after its plan, for tests

    @classmethod
    def for_core(cls, core: Any, **kwargs: Any) -> FakeExecutor:
        """A fake executor for ``core``'s vocabulary and block size."""
        return cls(vocab_size=core.model_config.vocab_size, block_size=core.config.block_size, **kwargs)

    def _slot(self, block_ids: Sequence[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    async def execute(self, plan: StepPlan, masks: Masks | None = None) -> RunnerOutput:
        index, self._index = self._index, self._index + 1
        self.plans.append(plan)
        extra = 0.0 if self._delay is None else self._delay(index, plan)
        await trio.sleep(self.step_time + self.token_time * plan.num_batched_tokens + extra)
        token_mask = plan.token_mask
        if masks is not None:
            with masks:
                try:
                    token_mask = await masks.receive()
                except trio.EndOfChannel:
                    raise MaskNotSent("the scheduler ended before the step's token mask came") from None
            self.masks.append(token_mask)
        if self._fail is not None and (error := self._fail(index, plan)) is not None:
            raise error
        for chunk in plan.chunks:
            for offset, token_id in enumerate(chunk.token_ids):
                self._slots[self._slot(chunk.block_ids, chunk.start + offset)] = token_id
        sampled = {}
        extra = {}
        for chunk in plan.chunks:
            if chunk.samples:
                end = chunk.start + chunk.num_tokens - chunk.num_draft_tokens
                context = [self._slots[self._slot(chunk.block_ids, p)] for p in range(end)]
                tokens = [self._token(chunk, context)]
                # A speculating chunk is verified greedily, as the model runner would.
                for draft in chunk.draft_token_ids:
                    if tokens[-1] != draft:
                        break
                    context.append(draft)
                    tokens.append(self._token(chunk, context))
                if token_mask is not None and chunk.request_id in token_mask.request_ids:
                    tokens[0] = self._allowed(token_mask, chunk.request_id, tokens[0])
                sampled[chunk.request_id] = tokens[0]
                if chunk.num_draft_tokens:
                    extra[chunk.request_id] = tuple(tokens[1:])
        return RunnerOutput(sampled=sampled, logprobs={}, extra_tokens=extra)

    def _allowed(self, token_mask: TokenMask, request_id: str, token_id: int) -> int:
        """The first token ``token_mask`` allows ``request_id`` at or after ``token_id``, wrapping."""
        row = token_mask.request_ids.index(request_id)
        allowed = unpack_bitmask(token_mask.bitmask[row : row + 1], self.vocab_size)[0].nonzero().flatten().tolist()
        return next((t for t in allowed if t >= token_id), allowed[0])
