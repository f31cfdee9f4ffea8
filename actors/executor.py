"""The executor actor: runs the model step, one at a time.

``ModelExecutor`` runs ``ModelRunner.execute`` on the engine's
``StepThread`` (one long-lived thread for all its torch work; see
``trioserve.engine.step_thread``), so the event loop goes on admitting,
aborting and delivering while the step computes. A
step is not cancellable once started: its thread finishes, and aborts are
applied after it. An exception in the step becomes ``StepFailed`` (only that
step's requests fail); the actor keeps serving.

``FakeExecutor`` awaits ``trio.sleep`` instead of computing and answers
deterministic tokens, so tests can drive the engine on trio's
``autojump_clock`` (a worker thread would make virtual time jump while it
runs).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import trio

from trioserve.engine.model_runner import RunnerOutput
from trioserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from trioserve.engine.step_thread import StepThread

from .messages import RunStep, StepDone, StepFailed
from .statistics import ExecutorStatistics
from .step_calls import run_in_step_thread

# One step in flight: the scheduler plans the next step from this one's tokens.
INBOX_CAPACITY = 1


class Runner(Protocol):
    def execute(self, plan: SchedulerOutput, states: Mapping[str, Any]) -> RunnerOutput: ...


class Executor(abc.ABC):
    """The actor loop shared by the real and the fake executor."""

    def __init__(self) -> None:
        self._num_steps = 0
        self._num_failed = 0
        self._busy = 0.0
        self._last = 0.0
        self._in_flight = False

    async def run(
        self,
        replies: trio.MemorySendChannel[StepDone | StepFailed],
        *,
        task_status: trio.TaskStatus[trio.MemorySendChannel[RunStep]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Answer each ``RunStep`` on ``replies``; return when the scheduler
        closes the inbox."""
        inbox_send, inbox = trio.open_memory_channel[RunStep](INBOX_CAPACITY)
        with inbox, replies:
            task_status.started(inbox_send)
            async for message in inbox:
                await replies.send(await self._step(message))

    async def _step(self, message: RunStep) -> StepDone | StepFailed:
        self._in_flight = True
        start = trio.current_time()
        try:
            output = await self.execute(message.plan, message.states)
        except Exception as exc:
            self._num_failed += 1
            return StepFailed(message.step_id, exc, self._account(start))
        finally:
            self._in_flight = False
        return StepDone(message.step_id, output, self._account(start))

    def _account(self, start: float) -> float:
        seconds = trio.current_time() - start
        self._num_steps += 1
        self._busy += seconds
        self._last = seconds
        return seconds

    @abc.abstractmethod
    async def execute(self, plan: SchedulerOutput, states: Mapping[str, Any]) -> RunnerOutput:
        """Run one step and return its sampled tokens."""

    def statistics(self) -> ExecutorStatistics:
        return ExecutorStatistics(
            num_steps=self._num_steps,
            num_failed_steps=self._num_failed,
            busy_seconds=self._busy,
            last_step_seconds=self._last,
            step_in_flight=self._in_flight,
        )


class ModelExecutor(Executor):
    """Runs ``runner.execute`` on ``step_thread``, one step at a time.

    ``runner.execute`` enters ``torch.inference_mode`` itself (grad mode is
    per thread). A step is never abandoned: it has side effects on the KV
    cache, so a cancel waits for it to finish.
    """

    def __init__(self, runner: Runner, step_thread: StepThread | None = None) -> None:
        """``step_thread``: the thread that loaded the model (None: a thread
        of the executor's own, closed when ``run`` returns)."""
        super().__init__()
        self.runner = runner
        self._owns_thread = step_thread is None
        self.step_thread = StepThread() if step_thread is None else step_thread

    async def run(self, replies: trio.MemorySendChannel[StepDone | StepFailed], **kwargs: Any) -> None:
        try:
            await super().run(replies, **kwargs)
        finally:
            if self._owns_thread:
                self.step_thread.close()  # no step is in flight: they are not cancellable

    async def execute(self, plan: SchedulerOutput, states: Mapping[str, Any]) -> RunnerOutput:
        return await run_in_step_thread(self.step_thread, self.runner.execute, plan, states)


def fake_token(chunk: ScheduledChunk, vocab_size: int) -> int:
    """A deterministic 'next token' of a chunk: a function of its request's
    tokens, in [100, min(vocab_size, 1100))."""
    tokens = chunk.request.all_token_ids
    span = max(1, min(vocab_size, 1100) - 100)
    return 100 + (sum(tokens) * 31 + len(tokens) * 7) % span


class FakeExecutor(Executor):
    """Sleeps ``step_time + token_time * num_batched_tokens`` (trio time)
    and samples ``token(chunk)`` for each sampling chunk.

    ``fail(step_index, plan)`` may return an exception to raise from that
    step (injected failures); ``step_index`` counts from 0.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        step_time: float = 0.01,
        token_time: float = 0.0,
        token: Callable[[ScheduledChunk], int] | None = None,
        fail: Callable[[int, SchedulerOutput], Exception | None] | None = None,
    ) -> None:
        super().__init__()
        self.step_time = step_time
        self.token_time = token_time
        self._token = token or (lambda chunk: fake_token(chunk, vocab_size))
        self._fail = fail
        self._index = 0
        self.plans: list[SchedulerOutput] = []  # every plan run, for tests

    async def execute(self, plan: SchedulerOutput, states: Mapping[str, Any]) -> RunnerOutput:
        index, self._index = self._index, self._index + 1
        self.plans.append(plan)
        await trio.sleep(self.step_time + self.token_time * plan.num_batched_tokens)
        if self._fail is not None and (error := self._fail(index, plan)) is not None:
            raise error
        sampled = {c.request.request_id: self._token(c) for c in plan.chunks if c.samples}
        return RunnerOutput(sampled=sampled, logprobs={})
