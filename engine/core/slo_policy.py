"""The ``slo`` scheduling policy (``--scheduling-policy slo``, issue #44):
within a priority class, earliest deadline first, by the requests' latency
objectives (engine/latency_objectives.py).

- **Waiting order.** A request's key is (class, deadline, arrival). Its
  class is its ``priority``, aged as ``PriorityPolicy`` ages it; its
  deadline is when its next token is due: the first token's deadline
  (arrival + TTFT target) until it has one, then the TPOT budget
  (arrival + TTFT + TPOT x tokens so far). A request without a target of the
  kind that applies has an infinite deadline: it goes after those with, in
  arrival order (first come, first served). The deadline is absolute, so
  the order is the order of slack (deadline - now) at any ``now``, and the
  key needs no clock.
- **Preemption for KV blocks.** The victim is the running request with the
  highest key: the lowest class, then the most slack (without a target:
  infinite slack, preempted first in its class). As with ``PriorityPolicy``
  only a strictly better class preempts for blocks (``outranks``).
- **Preemption for a sequence slot** (``slot_victim``). With every slot
  taken, the waiting request at the head may preempt, by recompute, a
  running request of its class or a lower one when the latency model
  predicts that waiting for a slot would miss its next token's deadline
  and that a slot now would meet it (within ``margin`` of its target). The
  victim is the one with the most slack whose own deadline still holds
  once it has waited for a slot again and recomputed its tokens, as the
  model predicts; a request is preempted at most ``max_preemptions`` times,
  so two requests cannot take a slot from each other for ever.
- **Chunked prefill.** ``token_budget`` shrinks a step's token budget while
  a running request decodes under a TPOT target, so that the step's
  predicted time (the latency model's, for the step's decodes and prefill)
  stays within the least time such a request may wait for its next token
  (its TPOT budget's slack, at least one TPOT target): a long prompt is
  then chunked finer instead of stalling those decodes. Before the model
  has seen ``min_steps`` steps the budget is not cut. A step keeps its
  decodes and at least ``min_chunk`` prompt tokens, so a prompt always
  progresses.

The latency model (``latency``, engine/core/latency_model.py) is the one
SLO admission predicts with: the scheduler actor feeds it every step's
plan and time (actors/scheduler.py), so the door and the scheduler judge
from the same law.

The hard deadline (``deadline`` of a request) is enforced by the actors
(actors/deadlines.py) and is not seen by the engine core, so it does not
enter the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trioserve.engine.core.latency_model import LatencyModel, StepShape
from trioserve.engine.latency_objectives import LatencyObjectives

# A request preempted this many times is not preempted for a slot again.
DEFAULT_MAX_PREEMPTIONS = 2
# Slot preemption still pays when the first token comes within this share
# of its target after the deadline (the bench counts such a token on time).
DEFAULT_MARGIN = 0.2
# Victims whose own deadline is checked (a simulation each), most slack first.
MAX_VICTIMS_CHECKED = 4


def next_token_deadline(request: Any) -> float:
    """When ``request``'s next token is due (its arrival's clock), by its
    objectives: the first token's deadline until it has output, then its
    TPOT budget; inf without the target that applies."""
    objectives: LatencyObjectives = request.objectives
    if request.num_output_tokens == 0:
        return objectives.first_token_deadline(request.arrival_time)
    if objectives.tpot is None:
        return math.inf
    return request.arrival_time + (objectives.ttft or 0.0) + objectives.tpot * request.num_output_tokens


def output_left(request: Any, max_context_len: int) -> int:
    """Tokens ``request`` may still generate: up to its ``max_tokens``,
    else to the context's end; an EOS may end it sooner."""
    room = max_context_len - request.num_tokens
    max_tokens = request.sampling_params.max_tokens
    left = room if max_tokens is None else min(room, max_tokens - request.num_output_tokens)
    return max(1, left)


def running_load(
    running: Sequence[Any], *, max_context_len: int, in_flight: Mapping[str, int] | None = None
) -> list[tuple[int, int, int]]:
    """Requests holding a slot, as ``LatencyModel.predict_ttft`` takes them:
    ``(context, prefill left, output left)``, the tokens computed, the known
    tokens not yet computed but the one a decode step computes, and the
    tokens they may still generate. ``in_flight``: the tokens the step
    running now computes, per request: counted as computed, a request it
    completes as having its next token, and one whose last token it
    samples as gone (its slot is free for a request arriving now)."""
    load = []
    for request in running:
        computed = request.num_computed_tokens
        left = request.num_tokens - computed
        prefill = left - 1 if request.num_output_tokens > 0 else left
        output = output_left(request, max_context_len)
        running_now = 0 if in_flight is None else in_flight.get(request.request_id, 0)
        if running_now:
            computed += running_now
            prefill -= running_now
            if prefill <= 0:  # the step samples its next token
                if output == 1:  # its last: it leaves with the step
                    continue
                prefill, output = 0, output - 1
        load.append((computed, max(0, prefill), output))
    return load


@attrs.frozen
class StepLimits:
    """The scheduler's bounds a prediction simulates under."""

    token_budget: int
    max_num_seqs: int
    max_context_len: int


@attrs.define
class SloPolicy:
    """Earliest deadline first within a priority class (the module's doc).
    ``aging_interval``: a request's class improves by one every that many
    steps since admission, as in ``PriorityPolicy`` (None: no aging)."""

    aging_interval: int | None = None
    min_chunk: int = 16
    latency: LatencyModel = attrs.field(factory=LatencyModel)
    # Before this many steps the model is the prior: it cuts no chunk.
    min_steps: int = 8
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    margin: float = DEFAULT_MARGIN

    def key(self, request: Any, age: int) -> tuple[float, ...]:
        level = request.priority
        if self.aging_interval:
            level -= age // self.aging_interval
        return (level, next_token_deadline(request), request.arrival_index)

    def outranks(self, key_a: tuple[float, ...], key_b: tuple[float, ...]) -> bool:
        return key_a[0] < key_b[0]

    # -- chunked prefill ----------------------------------------------------------

    def token_budget(self, running: Sequence[Any], tokens: int, now: float) -> int:
        """This step's token budget out of ``tokens``: cut so that the step
        should last no longer than the least time a running request that
        decodes under a TPOT target may wait for its next token at ``now``
        (the slack of its TPOT budget, at least one TPOT target: the mean is
        what is promised, so a request ahead of it may take a longer step),
        but never below the decodes plus ``min_chunk``. The step's time is
        the latency model's for its decodes (their number and context) and
        a prefill chunk starting where the first running prompt stands."""
        decodes = [r for r in running if r.num_output_tokens > 0 and r.num_tokens - r.num_computed_tokens == 1]
        tightest = min(
            (max(r.objectives.tpot, next_token_deadline(r) - now) for r in decodes if r.objectives.tpot is not None),
            default=None,
        )
        if tightest is None or self.latency.num_steps < self.min_steps:
            return tokens
        context = sum(r.num_computed_tokens + 1 for r in decodes)
        start = next((r.num_computed_tokens for r in running if r.num_tokens - r.num_computed_tokens > 1), 0)

        def seconds(prefill: int) -> float:
            pairs = prefill * (start + (prefill + 1) // 2)
            return self.latency.step_seconds(StepShape(prefill, pairs, len(decodes), context))

        # The most prefill tokens within ``tightest``: the law grows with
        # them (a fit may not, where it has no data: then nothing is cut).
        most = max(0, tokens - len(decodes))
        if seconds(most) <= tightest or seconds(most) <= seconds(0):
            return tokens
        low, high = 0, most  # seconds(low) may exceed it too: the floor below applies
        while low < high:
            mid = (low + high + 1) // 2
            if seconds(mid) <= tightest:
                low = mid
            else:
                high = mid - 1
        return min(tokens, len(decodes) + max(low, self.min_chunk))

    # -- preemption for a sequence slot ------------------------------------------------

    def slot_victim(
        self,
        request: Any,
        candidates: Sequence[Any],
        *,
        running: Sequence[Any],
        now: float,
        limits: StepLimits,
    ) -> Any | None:
        """The running request (of ``candidates``, those ``request`` may
        displace) to preempt so that ``request`` gets a sequence slot this
        step, or None: none when waiting for a slot is predicted to meet
        its next token's deadline, or a slot now to miss it anyway (by
        more than ``margin`` of its target), or no candidate's own deadline
        would hold (``victims``). ``running``: every request holding a slot
        this step, the candidates among them."""
        deadline = next_token_deadline(request)
        if math.isinf(deadline):
            return None
        own = request.num_tokens - request.num_computed_tokens
        load = running_load(running, max_context_len=limits.max_context_len)
        waiting = self._ttft(own, load, limits)
        if now + waiting <= deadline:
            return None
        victims = self.victims(request, candidates, running=running, now=now, limits=limits)
        if not victims:
            return None
        kept = running_load([r for r in running if r is not victims[0]], max_context_len=limits.max_context_len)
        tolerance = self.margin * max(0.0, deadline - request.arrival_time)
        if now + self._ttft(own, kept, limits) > deadline + tolerance:
            return None  # late even with a slot: nobody else's work is thrown away for it
        return victims[0]

    def victims(
        self,
        request: Any,
        candidates: Sequence[Any],
        *,
        running: Sequence[Any],
        now: float,
        limits: StepLimits,
    ) -> list[Any]:
        """The ``candidates`` that may be preempted for ``request``'s slot,
        most slack first: preempted fewer than ``max_preemptions`` times,
        and whose next token, once it has waited for a slot behind
        ``request`` and recomputed its tokens, is predicted within its own
        deadline (always, without one). At most ``MAX_VICTIMS_CHECKED`` are
        simulated. SLO admission asks it too, for a request at the door."""
        ordered = sorted(
            (c for c in candidates if c.num_preemptions < self.max_preemptions),
            key=lambda c: (-(next_token_deadline(c) - now), c.num_computed_tokens),
        )
        own_load = (0, request.num_tokens - request.num_computed_tokens, output_left(request, limits.max_context_len))
        chosen = []
        for victim in ordered[:MAX_VICTIMS_CHECKED]:
            deadline = next_token_deadline(victim)
            if not math.isinf(deadline):
                others = [r for r in running if r is not victim]
                load = [*running_load(others, max_context_len=limits.max_context_len), own_load]
                if now + self._ttft(victim.num_tokens, load, limits) > deadline:
                    continue
            chosen.append(victim)
        return chosen

    def _ttft(self, tokens: int, load: list[tuple[int, int, int]], limits: StepLimits) -> float:
        """Seconds until the next token of a waiting request with ``tokens``
        to compute, behind the slots' ``load``."""
        return self.latency.predict_ttft(
            tokens, running=load, token_budget=limits.token_budget, max_num_seqs=limits.max_num_seqs
        )
