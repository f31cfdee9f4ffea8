"""A request's latency objectives: the time to its first token and the
time per output token it asks for (issue #44's contract).

The deadline stays the hard bound (a request past it ends with
``DEADLINE``); objectives are what admission predicts against and the
``slo`` scheduling policy orders by. ``best_effort``: a request that
cannot meet them is still admitted and served as well as the load allows,
instead of being refused at the door.
"""

from __future__ import annotations

import math

import attrs

from trioserve.engine.errors import InvalidRequestError

# An objective longer than a day is a mistake in units, not a wish.
MAX_OBJECTIVE_S = 86_400.0


def check_objective(value: object, field: str) -> float | None:
    """``value`` in seconds if it is a usable objective (a finite number
    > 0 and at most a day) or None, else ``InvalidRequestError`` naming
    ``field``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{field} must be a number, got {value!r}", field=field)
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequestError(f"{field} must be > 0, got {value!r}", field=field)
    if seconds > MAX_OBJECTIVE_S:
        raise InvalidRequestError(f"{field} must be at most a day ({MAX_OBJECTIVE_S:.0f} s), got {value!r}", field=field)
    return seconds


@attrs.frozen
class LatencyObjectives:
    """Targets for one request, in seconds: ``ttft`` for its first token
    (from its arrival), ``tpot`` for each output token after it (the mean
    over the request). None: no target of that kind."""

    ttft: float | None = attrs.field(default=None, validator=lambda _, a, v: check_objective(v, a.name))
    tpot: float | None = attrs.field(default=None, validator=lambda _, a, v: check_objective(v, a.name))
    best_effort: bool = False

    @property
    def empty(self) -> bool:
        """No target at all."""
        return self.ttft is None and self.tpot is None

    def first_token_deadline(self, arrival: float) -> float:
        """When the first token is due (inf without a TTFT target)."""
        return math.inf if self.ttft is None else arrival + self.ttft


NO_OBJECTIVES = LatencyObjectives()
