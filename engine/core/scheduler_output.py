"""What the scheduler hands out: a step's plan with what the caller must
report (``SchedulerOutput``), and its counters (``SchedulerStatistics``)."""

from __future__ import annotations

import attrs

from trioserve.engine.core.kv_batch import KVBudget
from trioserve.engine.core.sequence import Request
from trioserve.engine.runtime.step_plan import ScheduledChunk, StepPlan


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
