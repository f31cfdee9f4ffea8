"""Admission by latency objectives: decided at the door (issue #44).

With ``--scheduling-policy slo`` each arriving request with objectives
gets a predicted TTFT and TPOT from the engine's latency model
(engine/core/latency_model.py), the prefill queued ahead of it (the
admission queue and the core's waiting requests that the policy runs
first: a lower priority value, or the same with a first-token deadline no
later than its own) and the running batch. One that cannot meet an
objective, with ``margin``, is refused at once (``SloRefused``: 429, or
503 while the engine is degraded) before any compute, unless it asked for
best effort, or, refused for its TPOT only, it allows a shorter answer
and a lower ``max_tokens`` fits (``SloDecision.max_tokens``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from trioserve.engine.core.latency_model import LatencyModel
from trioserve.engine.core.latency_objectives import LatencyObjectives
from trioserve.engine.core.new_request import NewRequest
from trioserve.engine.core.sequence import Request

from .errors import EngineOverloaded

# A prediction is refused only when it exceeds the target by more than
# this fraction: the model's own error (docs/reliability.md) should not
# refuse a request that would have made it.
DEFAULT_MARGIN = 0.1
# The fewest tokens a shortened answer keeps: below it the answer is not
# worth giving, and the request is refused instead.
MIN_SHORTENED_TOKENS = 16
# Retry-After's bounds, in seconds.
MIN_RETRY_AFTER, MAX_RETRY_AFTER = 1.0, 600.0


@attrs.frozen
class SloPrediction:
    """What the model predicts for a request at its arrival, in seconds."""

    ttft: float
    tpot: float
    # The prefill queued ahead of it, in tokens (for Retry-After and traces).
    tokens_ahead: int = 0


@attrs.frozen
class SloDecision:
    """The door's answer: ``prediction`` and, when the request was
    admitted at a lower ``max_tokens`` than it asked, that cap (else None)."""

    prediction: SloPrediction
    max_tokens: int | None = None


class SloRefused(EngineOverloaded):
    """A request that cannot meet its latency objective, refused before any
    compute. ``objective`` names the field (``ttft_ms`` / ``tpot_ms``),
    ``predicted`` and ``target`` are in seconds, ``degraded`` says the
    engine is running degraded (a hung step, a worker down): the web layer
    answers 503 then, else 429, with ``retry_after``."""

    def __init__(
        self, *, objective: str, predicted: float, target: float, retry_after: float, degraded: bool = False
    ) -> None:
        over = predicted - target
        super().__init__(
            f"predicted {'TTFT' if objective == 'ttft_ms' else 'TPOT'} {predicted * 1000:.0f} ms exceeds "
            f"{objective} {target * 1000:g} by {over * 1000:.0f} ms; retry after {retry_after:.0f} s, "
            'or send "slo_mode": "best_effort"',
            retry_after=retry_after,
        )
        self.objective = objective
        self.predicted = predicted
        self.target = target
        self.degraded = degraded

    @property
    def reason(self) -> str:
        """``ttft`` or ``tpot``: the metrics' label."""
        return self.objective.removesuffix("_ms")


def _runs_before(priority: int, deadline: float, own_priority: int, own_deadline: float) -> bool:
    return priority < own_priority or (priority == own_priority and deadline <= own_deadline)


def tokens_ahead(
    new: NewRequest,
    now: float,
    waiting: Iterable[Request],
    queued: Iterable[NewRequest] = (),
    queued_arrivals: Iterable[float] = (),
) -> list[int]:
    """The prefill tokens each request ahead of ``new`` still has to
    compute, in the order the policy runs them: the core's ``waiting``
    (already in the policy's order) then the admission queue's ``queued``
    (arrived at ``queued_arrivals``), those that run before ``new``."""
    own = new.objectives.first_token_deadline(now)
    ahead = []
    for request in waiting:
        if _runs_before(request.priority, request.objectives.first_token_deadline(request.arrival_time), new.priority, own):
            ahead.append(request.num_tokens - request.num_computed_tokens)
    for other, arrival in zip(queued, queued_arrivals, strict=True):
        if _runs_before(other.priority, other.objectives.first_token_deadline(arrival), new.priority, own):
            ahead.extend([other.num_tokens] * other.params.n)
    return ahead


def predict(
    model: LatencyModel,
    new: NewRequest,
    ahead: list[int],
    running: Iterable[Request],
    *,
    token_budget: int,
    max_num_seqs: int,
) -> SloPrediction:
    """``new``'s predicted TTFT (its prefill after ``ahead``'s, beside the
    ``running`` decodes) and TPOT (a decode step of the batch it joins)."""
    running = list(running)
    context = sum(request.num_tokens for request in running)
    ttft = model.predict_ttft(
        new.num_tokens,
        ahead=ahead,
        num_running=len(running),
        running_context=context,
        token_budget=token_budget,
        max_num_seqs=max_num_seqs,
    )
    batch = min(max_num_seqs, len(running) + len(ahead) + new.params.n)
    mean_context = (context + sum(ahead) + new.num_tokens) / max(1, len(running) + len(ahead) + 1)
    # Over the answer, each sequence's context grows by half its length on average.
    mean_context += (new.params.max_tokens or 0) / 2
    tpot = model.predict_tpot(batch, int(batch * mean_context))
    return SloPrediction(ttft, tpot, sum(ahead))


def retry_after(prediction: SloPrediction, target: float) -> float:
    """When a retry could meet ``target``: once the prefill ahead has
    drained by the fraction the prediction overshoots."""
    over = prediction.ttft - target
    return min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, math.ceil(over)))


def decide(
    objectives: LatencyObjectives,
    prediction: SloPrediction,
    *,
    max_tokens: int | None,
    degraded: bool = False,
    margin: float = DEFAULT_MARGIN,
) -> SloDecision:
    """Admit (``SloDecision``) or raise ``SloRefused``. A TPOT target is a
    mean over the answer: a request refused for it that allows a shorter
    answer is admitted with ``max_tokens`` cut so the answer ends about as
    long as a TTFT-met, TPOT-met one would have taken (its time budget,
    ``ttft + tpot * max_tokens``, over the predicted TPOT)."""
    if objectives.best_effort:
        return SloDecision(prediction)
    if objectives.ttft is not None and prediction.ttft > objectives.ttft * (1 + margin):
        raise SloRefused(
            objective="ttft_ms",
            predicted=prediction.ttft,
            target=objectives.ttft,
            retry_after=retry_after(prediction, objectives.ttft),
            degraded=degraded,
        )
    if objectives.tpot is not None and prediction.tpot > objectives.tpot * (1 + margin):
        if objectives.allow_shorter and max_tokens is not None:
            budget = (objectives.ttft or prediction.ttft) + objectives.tpot * max_tokens
            shorter = int((budget - prediction.ttft) / prediction.tpot)
            if MIN_SHORTENED_TOKENS <= shorter < max_tokens:
                return SloDecision(prediction, max_tokens=shorter)
        raise SloRefused(
            objective="tpot_ms",
            predicted=prediction.tpot,
            target=objectives.tpot,
            retry_after=MIN_RETRY_AFTER,
            degraded=degraded,
        )
    return SloDecision(prediction)


