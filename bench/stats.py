"""Percentiles: the one definition every benchmark, the soak and the tests use.

A percentile is interpolated linearly between the two closest ranks
(numpy's default, ``method="linear"``, and type 7 of Hyndman and Fan). It is
the definition vLLM's ``benchmark_serving`` reports (``np.percentile``), so
``trioserve bench serve`` figures compare with vLLM's as they are, and its
p50 is ``statistics.median``, which the measurements of ``bench`` use for
their medians. Nearest rank (what scripts/soak.py used) jumps from one
sample to the next: with the few dozen latencies of a soak's minute, its
p99 is simply the largest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile of ``values`` (``p`` in [0, 100]),
    interpolated linearly between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError("p must be in [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
