"""A request's state as the engine core tracks it."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import attrs

from trioserve.engine.lora.registry import LoraRef
from trioserve.engine.latency_objectives import NO_OBJECTIVES, LatencyObjectives
from trioserve.engine.sampling.pooling import Pooling
from trioserve.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from trioserve.engine.core.new_request import NewRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # admitted, never scheduled
    RUNNING = "running"  # holds KV blocks and is scheduled every step it can be
    PREEMPTED = "preempted"  # lost its blocks to make room; waits to be recomputed
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended; the value is what the OpenAI API reports."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the caller went away or asked for it
    DEADLINE = "deadline"  # its deadline passed
    ERROR = "error"  # the model step failed
    # Dropped under overload before anything was computed for it (the
    # actors raise QueueTimeout / RequestShed; a started HTTP stream ends
    # with these):
    QUEUE_TIMEOUT = "queue_timeout"  # waited longer than max_queue_time
    SHED = "shed"  # displaced from the full admission queue by a higher priority


@attrs.define(eq=False)
class Request:
    """One sequence being generated.

    There is no prefill or decode phase: the request holds
    ``all_token_ids`` (prompt, then output) and ``num_computed_tokens`` of
    them have their K/V in the cache. Each step the scheduler gives it some
    of the rest; once all are computed the next token is sampled.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs first
    arrival_time: float = attrs.field(factory=time.monotonic)
    arrival_index: int = 0  # tie-breaker set by the scheduler: order of admission
    output_token_ids: list[int] = attrs.field(factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    block_ids: list[int] = attrs.field(factory=list)
    # Speculative decoding: the most tokens the next proposal may have, set
    # from how many of the last one were accepted (None: the proposer's k).
    draft_limit: int | None = None
    # An embedding request (engine/sampling/pooling.py): it finishes once its
    # prompt is computed, with its hidden states pooled, and samples nothing.
    pooling: Pooling | None = None
    # Its latency targets (engine/latency_objectives.py): the ``slo``
    # scheduling policy orders by them; NO_OBJECTIVES: none.
    objectives: LatencyObjectives = NO_OBJECTIVES
    # The LoRA adapter it runs with (engine/lora); None: the base model.
    # Its KV blocks hash from the adapter's root (``LoraRef.root_hash``).
    lora: LoraRef | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def completion_requests(new: NewRequest, eos_token_ids: tuple[int, ...], arrival_time: float) -> list[Request]:
    """One ``Request`` per completion of ``new``, named by its sequence ids.
    With ``n > 1`` each is its own sequence of ``n == 1``, and a seed gives
    each its own (``seed + index``): ``n`` seeded completions differ, and
    stay reproducible."""
    params = new.params
    requests = []
    for index, sequence_id in enumerate(new.sequence_ids()):
        own = params
        if params.n > 1:
            own = attrs.evolve(params, n=1, seed=None if params.seed is None else params.seed + index)
        requests.append(
            Request(
                request_id=sequence_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=own,
                eos_token_ids=eos_token_ids,
                priority=new.priority,
                arrival_time=arrival_time,
                pooling=new.pooling,
                objectives=new.objectives,
                lora=new.lora,
            )
        )
    return requests
