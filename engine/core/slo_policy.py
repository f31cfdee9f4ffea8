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
- **Preemption.** The victim is the running request with the highest key:
  the lowest class, then the most slack (without a target: infinite slack,
  preempted first in its class). As with ``PriorityPolicy`` only a
  strictly better class preempts (``outranks``): a tighter deadline of the
  same class waits for the next free slot instead of throwing away a
  running request's computed tokens.
- **Chunked prefill.** ``token_budget`` shrinks a step's token budget while
  a running request decodes under a TPOT target, so that the step's
  predicted time stays within the least time such a request may wait for
  its next token (its TPOT budget's slack, at least one TPOT target): a
  long prompt is then chunked finer instead of stalling those decodes. The prediction is
  ``StepCost``, a line (seconds = fixed + per token x tokens) fitted online
  to the engine's own step times, which the scheduler reports through
  ``observe_step``. Before it has seen enough steps the budget is not cut.
  A step keeps its decodes and at least ``min_chunk`` prompt tokens, so a
  prompt always progresses.

The hard deadline (``deadline`` of a request) is enforced by the actors
(actors/deadlines.py) and is not seen by the engine core, so it does not
enter the key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from trioserve.engine.latency_objectives import LatencyObjectives


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


@attrs.define
class StepCost:
    """A step's time as a line in its tokens, fitted online by least
    squares over the recent steps (each weighs ``decay`` times the one
    after it), so it follows the machine's load. ``tokens_within(seconds)``
    is the most tokens a step may take to last at most ``seconds``."""

    decay: float = 0.95
    min_steps: int = 8
    _n: float = 0.0  # weighted sums: count, x, y, x^2, xy
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    _steps: int = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` tokens took ``seconds``."""
        if num_tokens <= 0 or not seconds >= 0:
            return
        d = self.decay
        self._n = self._n * d + 1.0
        self._sx = self._sx * d + num_tokens
        self._sy = self._sy * d + seconds
        self._sxx = self._sxx * d + num_tokens * num_tokens
        self._sxy = self._sxy * d + num_tokens * seconds
        self._steps += 1

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before ``min_steps``
        steps. Steps all of one size cannot separate the two: the time is
        then taken as all per token (fixed 0), which overestimates longer
        steps' cost less than it underestimates none."""
        if self._steps < self.min_steps:
            return None
        mean_x, mean_y = self._sx / self._n, self._sy / self._n
        var_x = self._sxx / self._n - mean_x * mean_x
        if var_x > 1e-9 * max(1.0, mean_x * mean_x):
            slope = (self._sxy / self._n - mean_x * mean_y) / var_x
            if slope > 0:
                return max(0.0, mean_y - slope * mean_x), slope
        return 0.0, mean_y / mean_x

    def predict(self, num_tokens: int) -> float | None:
        """Seconds a step of ``num_tokens`` tokens should take; None before ``min_steps`` steps."""
        line = self.line()
        return None if line is None else line[0] + line[1] * num_tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may hold to take at most ``seconds``
        (0 if even the fixed cost exceeds it); None before ``min_steps`` steps."""
        line = self.line()
        if line is None:
            return None
        fixed, per_token = line
        return max(0, math.floor((seconds - fixed) / per_token))


@attrs.define
class SloPolicy:
    """Earliest deadline first within a priority class (the module's doc).
    ``aging_interval``: a request's class improves by one every that many
    steps since admission, as in ``PriorityPolicy`` (None: no aging)."""

    aging_interval: int | None = None
    min_chunk: int = 16
    cost: StepCost = attrs.field(factory=StepCost)

    def key(self, request: Any, age: int) -> tuple[float, ...]:
        level = request.priority
        if self.aging_interval:
            level -= age // self.aging_interval
        return (level, next_token_deadline(request), request.arrival_index)

    def outranks(self, key_a: tuple[float, ...], key_b: tuple[float, ...]) -> bool:
        return key_a[0] < key_b[0]

    def token_budget(self, running: Sequence[Any], tokens: int, now: float) -> int:
        """This step's token budget out of ``tokens``: cut so that the step
        should last no longer than the least time a running request that
        decodes under a TPOT target may wait for its next token at ``now``
        (the slack of its TPOT budget, at least one TPOT target: the mean is
        what is promised, so a request ahead of it may take a longer step),
        but never below the decodes plus ``min_chunk``."""
        decodes = [r for r in running if r.num_output_tokens > 0 and r.num_tokens - r.num_computed_tokens == 1]
        tightest = min(
            (max(r.objectives.tpot, next_token_deadline(r) - now) for r in decodes if r.objectives.tpot is not None),
            default=None,
        )
        if tightest is None:
            return tokens
        allowed = self.cost.tokens_within(tightest)
        if allowed is None:
            return tokens
        return min(tokens, max(allowed, len(decodes) + self.min_chunk))

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The scheduler's report of a step it planned: its tokens and how
        long it took from its plan to its sampled tokens."""
        self.cost.observe(num_tokens, seconds)
