"""Admission by latency objectives: decided at the door (issue #44).

With ``--scheduling-policy slo`` each arriving request with objectives
gets a predicted TTFT and TPOT from the engine's latency model
(engine/core/latency_model.py), the prefill queued ahead of it (the
admission queue and the core's waiting requests that the policy runs
first: a lower priority value, or the same with a first-token deadline no
later than its own) and the running batch, its prompt's prefix-cache hit
counted at a cached prefix's cost (``cached_prefix``). Behind a batch that
holds every slot it is predicted as the policy will run it: with a running
request of slack preempted for its slot (``predict_on``). One that cannot
meet an objective, with ``margin``, is refused at once (``SloRefused``: 429, or
503 while the engine is degraded) before any compute, unless it asked for
best effort, or, refused for its TPOT only, it allows a shorter answer
and a lower ``max_tokens`` fits (``SloDecision.max_tokens``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.core.latency_model import LatencyModel
from trioserve.engine.core.new_request import NewRequest
from trioserve.engine.core.scheduler import Scheduler
from trioserve.engine.core.sequence import Request
from trioserve.engine.core.slo_policy import next_token_deadline, output_left, running_load
from trioserve.engine.latency_objectives import LatencyObjectives

from .errors import EngineOverloaded
from .messages import AddRequest

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
    # Running requests the slo policy is predicted to preempt for a slot
    # (for it and the requests ahead of it).
    preempts: int = 0


@attrs.frozen
class StepInFlight:
    """The step running when a request arrives (``SchedulerActor.step_in_flight``):
    the seconds it still needs, and the tokens it computes per request (the
    running load's state once it ends)."""

    left: float = 0.0
    tokens: Mapping[str, int] = attrs.field(factory=dict)


@attrs.frozen
class SloDecision:
    """The door's answer: ``prediction`` and, when the request was
    admitted at a lower ``max_tokens`` than it asked, that cap (else None)."""

    prediction: SloPrediction
    max_tokens: int | None = None
    # With several replicas, the TTFT predicted on each (the router sends
    # the request to the soonest: actors/router.py).
    replica_ttfts: tuple[float, ...] = ()


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


def admission_order(message: AddRequest) -> tuple[float, ...]:
    """The order the slo policy's admission queue hands requests to the
    scheduler (``AdmissionQueue.order``): its key without aging, (priority,
    first token's deadline). ``requests_around`` predicts by it."""
    request = message.request
    return (request.priority, request.objectives.first_token_deadline(message.arrival_time))


def _runs_before(priority: int, deadline: float, own_priority: int, own_deadline: float) -> bool:
    return priority < own_priority or (priority == own_priority and deadline <= own_deadline)


def _output_left(params_max_tokens: int | None, num_output: int, room: int) -> int:
    """Tokens a request may still generate: up to its ``max_tokens``, else
    to the context's end (``room``); an EOS may end it sooner."""
    left = room if params_max_tokens is None else min(room, params_max_tokens - num_output)
    return max(1, left)


def output_budget(new: NewRequest, max_model_len: int) -> int:
    """Tokens ``new`` may generate, each of its ``n`` answers: up to its
    ``max_tokens``, else to the context's end."""
    return _output_left(new.params.max_tokens, 0, max_model_len - new.num_tokens)


def arrivals_horizon(seen_for: float, objectives: LatencyObjectives) -> float:
    """For how long the door expects the higher classes to keep arriving
    while a request with ``objectives`` waits: as long as they have been
    seen to (``RecentArrivals.horizon``), and at least until its first
    token is due. Admission promises that token by its target if the load
    goes on as it is, so the load is assumed to go on that long: at the
    start of a run at 22.5 req/s of the bench's mix, batch requests were
    predicted at a third of their TTFT (4-10 s for 13-30 s) while the
    interactive arrivals had been seen for seconds, and were admitted to
    miss their 20 s target."""
    return max(seen_for, objectives.ttft or 0.0)


def requests_around(
    new: NewRequest,
    now: float,
    waiting: Iterable[Request],
    queued: Iterable[NewRequest] = (),
    queued_arrivals: Iterable[float] = (),
    *,
    max_model_len: int,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The waiting requests as ``(prefill tokens left, output tokens
    left)``, in the order the policy runs them: the core's ``waiting``
    (already in the policy's order) then the admission queue's ``queued``
    (arrived at ``queued_arrivals``), split into those that run before
    ``new`` by the ``slo`` policy's key (engine/core/slo_policy.py: a lower
    priority value, or the same and a deadline no later than its first
    token's) and those after it, whose prompts take what a step's token
    budget leaves after ``new``'s."""
    own = new.objectives.first_token_deadline(now)
    ahead: list[tuple[int, int]] = []
    behind: list[tuple[int, int]] = []
    for request in waiting:
        into = ahead if _runs_before(request.priority, next_token_deadline(request), new.priority, own) else behind
        into.append((request.num_tokens - request.num_computed_tokens, output_left(request, max_model_len)))
    for other, arrival in zip(queued, queued_arrivals, strict=True):
        runs_before = _runs_before(other.priority, other.objectives.first_token_deadline(arrival), new.priority, own)
        output = _output_left(other.params.max_tokens, 0, max_model_len - other.num_tokens)
        (ahead if runs_before else behind).extend([(other.num_tokens, output)] * other.params.n)
    return ahead, behind


def predict(
    model: LatencyModel,
    new: NewRequest,
    ahead: list[tuple[int, int]],
    running: list[tuple[int, int, int]],
    *,
    token_budget: int,
    max_num_seqs: int,
    behind: Sequence[tuple[int, int]] = (),
    cached_tokens: int = 0,
    step_left: float = 0.0,
    arrivals: Sequence[tuple[float, int, int]] = (),
    arrivals_for: float = math.inf,
) -> SloPrediction:
    """``new``'s predicted TTFT (``LatencyModel.predict_ttft`` over the
    ``running`` load, the requests ``ahead``, those ``behind`` that share
    its prompt's step where slots are free for them now (a full batch
    frees its slots one at a time, and a prompt that waits for one is
    computed alone), and those of higher classes
    yet to arrive in the next ``arrivals_for`` seconds, ``arrivals``
    (``RecentArrivals``), its prompt's
    ``cached_tokens`` at a cached prefix's cost: none, after the
    ``step_left`` seconds the step in flight still runs) and TPOT (a decode
    step of the batch it joins, at the context halfway through its answer)."""
    room = max(0, max_num_seqs - len(running) - len(ahead) - new.params.n)
    ttft = step_left + model.predict_ttft(
        new.num_tokens,
        cached_tokens=cached_tokens,
        ahead=ahead,
        behind=behind[:room],
        running=running,
        arrivals=arrivals,
        arrivals_for=arrivals_for,
        token_budget=token_budget,
        max_num_seqs=max_num_seqs,
    )
    members = len(running) + len(ahead) + 1
    batch = min(max_num_seqs, len(running) + len(ahead) + new.params.n)
    context = sum(c + p for c, p, _ in running) + sum(p for p, _ in ahead) + new.num_tokens
    # Over the answer, each sequence's context grows by half its length on average.
    mean_context = context / members + (new.params.max_tokens or 0) / 2
    tpot = model.predict_tpot(batch, int(batch * mean_context))
    return SloPrediction(ttft, tpot, sum(p for p, _ in ahead))


def cached_prefix(pool: BlockManager, new: NewRequest) -> int:
    """The tokens of ``new``'s prompt the prefix cache holds now, as its
    admission would find them (none where the whole prompt is computed:
    prompt logprobs, or pooling every position). A LoRA request's blocks
    hash from its adapter: it is predicted without a hit."""
    if new.params.prompt_logprobs is not None or new.lora is not None:
        return 0
    if new.pooling is not None and new.pooling.method.needs_every_position:
        return 0
    return pool.cached_prefix_len(new.prompt_token_ids)


def predict_on(
    scheduler: Scheduler,
    model: LatencyModel,
    new: NewRequest,
    now: float,
    queued: Sequence[NewRequest] = (),
    queued_arrivals: Sequence[float] = (),
    *,
    cached_tokens: int = 0,
    in_flight: StepInFlight = StepInFlight(),
    arrivals: Sequence[tuple[float, int, int]] = (),
    arrivals_for: float = math.inf,
) -> SloPrediction:
    """``new``'s prediction on one engine: after the step ``in_flight``
    (what is left of it; the running load as it leaves it), behind its
    core's waiting requests that run first, the admission queue's
    (``queued``), the running batch and the higher classes' ``arrivals``
    while it waits (for ``arrivals_for`` seconds at most). When the batch holds every slot and
    ``new`` would miss its TTFT target waiting, the slo policy preempts a
    running request with slack for its slot (``Scheduler.slot_victims``)
    if a slot then meets the target within the policy's margin
    (``SloPolicy.slot_victim``): it is then predicted with that request
    gone, and so is each request ahead of it, one victim each while they
    last (``SloPrediction.preempts``)."""
    limit = scheduler.running_limit
    waiting, running = scheduler.waiting_requests, scheduler.running_requests
    if in_flight.tokens:
        # A step still being planned starts its admissions from the waiting
        # queue: they run in it, so they are running, not ahead.
        started = tuple(r for r in waiting if r.request_id in in_flight.tokens)
        if started:
            waiting = tuple(r for r in waiting if r.request_id not in in_flight.tokens)
            running = (*running, *started)
    ahead, behind = requests_around(
        new, now, waiting, queued, queued_arrivals, max_model_len=scheduler.max_context_len
    )

    def on(load: Sequence[Request]) -> SloPrediction:
        return predict(
            model,
            new,
            ahead,
            running_load(load, max_context_len=scheduler.max_context_len, in_flight=in_flight.tokens),
            token_budget=scheduler.max_num_batched_tokens,
            max_num_seqs=limit,
            behind=behind,
            cached_tokens=cached_tokens,
            step_left=in_flight.left,
            arrivals=arrivals,
            arrivals_for=arrivals_for,
        )

    prediction = on(running)
    target = new.objectives.ttft
    if target is None or prediction.ttft <= target or len(running) < limit:
        return prediction
    own = Request(
        request_id=new.request_id,
        prompt_token_ids=list(new.prompt_token_ids),
        sampling_params=new.params,
        priority=new.priority,
        arrival_time=now,
        objectives=new.objectives,
    )
    victims = scheduler.slot_victims(own)[: 1 + len(ahead)]
    if not victims:
        return prediction
    preempting = on([r for r in running if all(r is not v for v in victims)])
    # The policy preempts only for a first token that a slot makes on time,
    # within its margin; a request late anyway waits, and is predicted so.
    margin = getattr(scheduler.policy, "margin", 0.0)
    if preempting.ttft >= prediction.ttft or preempting.ttft > target * (1 + margin):
        return prediction
    return attrs.evolve(preempting, preempts=len(victims))


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


