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
    over the request). None: no target of that kind. ``best_effort``:
    admitted even when predicted to miss; ``allow_shorter``: refused for
    its TPOT, admitted with a lower ``max_tokens`` where one fits."""

    ttft: float | None = attrs.field(default=None, validator=lambda _, a, v: check_objective(v, a.name))
    tpot: float | None = attrs.field(default=None, validator=lambda _, a, v: check_objective(v, a.name))
    best_effort: bool = False
    # Refused for its TPOT target, it may be admitted with a lower
    # max_tokens instead (its answer then ends with finish reason length).
    allow_shorter: bool = False

    @property
    def empty(self) -> bool:
        """No target at all."""
        return self.ttft is None and self.tpot is None

    def first_token_deadline(self, arrival: float) -> float:
        """When the first token is due (inf without a TTFT target)."""
        return math.inf if self.ttft is None else arrival + self.ttft


NO_OBJECTIVES = LatencyObjectives()


def _objective_pairs(value: object) -> tuple:
    return tuple(sorted(dict(value).items())) if value else ()


@attrs.frozen
class ObjectiveDefaults:
    """The server's default objectives (``--slo-ttft-ms``, ``--slo-tpot-ms``,
    ``--slo-class-defaults``, ``--slo-model-defaults``): for a request that
    leaves a target unset, its priority class's default, else its model's,
    else the server's. The class is the most specific: an interactive class
    keeps its tight target whichever model it asks."""

    server: LatencyObjectives = NO_OBJECTIVES
    # (priority, objectives) pairs; a mapping is taken too.
    by_priority: tuple[tuple[int, LatencyObjectives], ...] = attrs.field(default=(), converter=_objective_pairs)
    # (model name, objectives) pairs: the served name or a LoRA adapter's.
    by_model: tuple[tuple[str, LatencyObjectives], ...] = attrs.field(default=(), converter=_objective_pairs)

    @property
    def empty(self) -> bool:
        """No default at all: requests carry only what they give."""
        return self.server.empty and not self.by_priority and not self.by_model

    def resolve(self, given: LatencyObjectives, *, model: str | None = None, priority: int = 0) -> LatencyObjectives:
        """``given`` with each target it leaves unset filled from the
        defaults (class, then model, then server); ``best_effort`` is the
        request's own, as is ``allow_shorter``."""
        if given.ttft is not None and given.tpot is not None:
            return given
        layers = [dict(self.by_priority).get(priority), dict(self.by_model).get(model), self.server]
        ttft, tpot = given.ttft, given.tpot
        for layer in layers:
            if layer is None:
                continue
            ttft = layer.ttft if ttft is None else ttft
            tpot = layer.tpot if tpot is None else tpot
        if ttft == given.ttft and tpot == given.tpot:
            return given
        return attrs.evolve(given, ttft=ttft, tpot=tpot)


NO_DEFAULTS = ObjectiveDefaults()
