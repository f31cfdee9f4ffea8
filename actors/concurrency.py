"""Adaptive concurrency: how many sequences may run at once, from latency.

More sequences in a step make every step longer; past some point each
running request streams slower than its users accept, and the requests behind
it would be better served by waiting (or by being told to retry elsewhere).
``AdaptiveConcurrency`` finds that point by additive increase and
multiplicative decrease (AIMD, as TCP's congestion window):

- a *sample* is the time between the ends of two consecutive steps of one
  busy stretch when the later one computed a token for sequences that were
  already decoding: the gap those sequences saw between two tokens (TPOT as a
  client measures it, prefill chunks sharing the step included);
- samples count only while no more sequences run than the limit allows:
  lowering the limit preempts nothing, so the sequences running beyond it
  first finish, and latency measured before that shows the old concurrency,
  not a reason to cut again (TCP cuts once per round trip for the same
  reason); a change of the limit starts a new window;
- every ``window`` samples it takes their p90 (nearest rank);
- p90 above ``target``: the limit becomes ``decrease`` times what runs now
  (rounded down, at least 1);
- p90 at or below ``target`` while requests wait and the limit is reached:
  the limit grows by ``increase``, up to ``max_limit``.

The scheduler actor feeds it each step and applies ``limit`` with
``Scheduler.limit_running``. Nothing here reads a clock: times are passed in.
"""

from __future__ import annotations

import math

import attrs


def _p90(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


@attrs.define
class AdaptiveConcurrency:
    """An AIMD limit on running sequences in [1, ``max_limit``], steered by
    the p90 time per output token towards ``target`` seconds."""

    max_limit: int
    target: float
    window: int = 16
    decrease: float = 0.75
    increase: int = 1
    limit: int = attrs.field(init=False)
    last_p90: float | None = attrs.field(init=False, default=None)  # of the last full window
    num_decreases: int = attrs.field(init=False, default=0)
    num_increases: int = attrs.field(init=False, default=0)
    _samples: list[float] = attrs.field(init=False, factory=list)
    _last_end: float | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.max_limit < 1:
            raise ValueError(f"max_limit must be >= 1, got {self.max_limit!r}")
        if not (math.isfinite(self.target) and self.target > 0):
            raise ValueError(f"target must be a finite number of seconds > 0, got {self.target!r}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window!r}")
        if not 0 < self.decrease < 1:
            raise ValueError(f"decrease must be in (0, 1), got {self.decrease!r}")
        if self.increase < 1:
            raise ValueError(f"increase must be >= 1, got {self.increase!r}")
        self.limit = self.max_limit

    def observe(self, now: float, *, decoding: bool, num_running: int, num_waiting: int) -> None:
        """A step ended at ``now``. ``decoding``: it computed a token for
        sequences that were already decoding. ``num_running``: the sequences
        it ran (the concurrency its time reflects); ``num_waiting``: requests
        waiting to start."""
        if num_running > self.limit:
            self._samples.clear()  # the latency of a concurrency above the limit
        elif decoding and self._last_end is not None:
            self._samples.append(now - self._last_end)
        self._last_end = now
        if len(self._samples) >= self.window:
            self._decide(num_running, num_waiting)

    def idle(self) -> None:
        """The engine ran out of work: the next step starts a new busy
        stretch (the idle time is no one's time per token)."""
        self._last_end = None

    def _decide(self, num_running: int, num_waiting: int) -> None:
        p90 = self.last_p90 = _p90(self._samples)
        self._samples.clear()
        if p90 > self.target:
            lower = max(1, math.floor(num_running * self.decrease))
            if lower < self.limit:
                self.limit = lower
                self.num_decreases += 1
        elif num_waiting > 0 and num_running >= self.limit and self.limit < self.max_limit:
            self.limit = min(self.max_limit, self.limit + self.increase)
            self.num_increases += 1
