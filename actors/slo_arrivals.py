"""The recent arrivals at SLO admission's door, as streams of requests
yet to come (issue #44).

A request's wait is not only the load it meets at the door: under the
``slo`` policy a request of a higher class (a lower priority value) that
arrives while it waits runs before it. The door cannot see those, but it
has seen their like arrive: ``RecentArrivals`` keeps the requests judged
in the last ``window`` seconds (at most ``size``), and ``ahead_of`` gives, per class that outranks a new
request, the rate those arrive at and their mean prompt and answer, for
``LatencyModel.predict_ttft``'s ``arrivals``, for as long as they have
been seen to arrive (``horizon``: the time since the run of arrivals
began, with no gap of ``window`` seconds in it, however few of them are
kept; a burst that has lasted a second is not assumed to last a minute,
and one that ended ``window`` seconds ago is forgotten). Only a
strictly higher class
counts: within a class a later arrival with the same TTFT target has a
later deadline and runs after (one with a tighter target may pass; not
modelled).
"""

from __future__ import annotations

from collections import deque

import attrs

# The fewest arrivals of a class, in the window, that make a rate: fewer
# are too few to tell a rate from chance.
MIN_ARRIVALS = 3


@attrs.frozen
class _Arrival:
    time: float
    priority: int
    prefill: int
    output: int


@attrs.define
class RecentArrivals:
    """The requests judged at the door (``record``) in the last ``window``
    seconds, the last ``size`` at most, for the rates of the classes that
    outrank a new one (``ahead_of``). The rate of a class is its arrivals
    over the time since the oldest one kept: when arrivals stop, it falls
    as the window ages, and is gone after ``window`` seconds."""

    # Enough that at the loads a CPU server meets (tens a second) the window,
    # not the count, bounds what a rate is read from: 64 Poisson arrivals
    # at 15 a second (4 s of them) gave a class's rate a fifth to a third off
    # at p10 / p90, and a batch request waiting 10 s for that class's
    # arrivals a wait off by as much; 10 s of them, about a seventh.
    size: int = 256
    window: float = 10.0
    _arrivals: deque[_Arrival] = attrs.field(init=False)
    # When the run of arrivals kept began: the ``size`` cap must not shorten
    # the horizon (arrivals at 40 a second fill it in 6 s of a 20 s wait).
    _since: float = attrs.field(init=False, default=0.0)

    def __attrs_post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size!r}")
        if not self.window > 0:
            raise ValueError(f"window must be > 0, got {self.window!r}")
        self._arrivals = deque(maxlen=self.size)

    def _forget(self, now: float) -> None:
        while self._arrivals and self._arrivals[0].time < now - self.window:
            self._arrivals.popleft()

    def record(self, now: float, priority: int, prefill: int, output: int) -> None:
        """A request of class ``priority`` with ``prefill`` prompt tokens to
        compute and up to ``output`` to generate arrived at ``now``."""
        self._forget(now)
        if not self._arrivals:
            self._since = now
        self._arrivals.append(_Arrival(now, priority, prefill, output))

    def horizon(self, now: float) -> float:
        """How long the arrivals kept have been coming: the time since
        their run began (0 with none)."""
        self._forget(now)
        return max(0.0, now - self._since) if self._arrivals else 0.0

    def ahead_of(self, priority: int, now: float) -> list[tuple[float, int, int]]:
        """For each class that outranks ``priority``: ``(rate per second,
        mean prefill tokens, mean output tokens)`` of its recent arrivals
        (none before ``MIN_ARRIVALS`` of it, or while no time has passed)."""
        self._forget(now)
        if not self._arrivals:
            return []
        span = now - self._arrivals[0].time
        if not span > 0:
            return []
        by_class: dict[int, list[_Arrival]] = {}
        for arrival in self._arrivals:
            if arrival.priority < priority:
                by_class.setdefault(arrival.priority, []).append(arrival)
        streams = []
        for arrivals in by_class.values():
            if len(arrivals) >= MIN_ARRIVALS:
                prefill = sum(a.prefill for a in arrivals) / len(arrivals)
                output = sum(a.output for a in arrivals) / len(arrivals)
                streams.append((len(arrivals) / span, round(prefill), round(output)))
        return streams
