"""Serving metrics from request outputs, with vLLM's ``benchmark_serving`` definitions.

- request throughput: completed requests / duration;
- output throughput: output tokens of completed requests / duration;
- total token throughput: their prompt and output tokens / duration;
- TTFT and E2E latency: one value per completed request;
- TPOT: ``(e2el - ttft) / (output_tokens - 1)``, for requests of more than
  one output token;
- ITL: every gap between two token chunks, of all completed requests;
- goodput: completed requests meeting every given SLO, per second; a
  request of one output token counts as TPOT 0 there, as in vLLM.

Distributions are in milliseconds: mean, std (population), median (= p50),
p90, p99, percentiles as ``stats.percentile`` defines them (interpolated
linearly, numpy's default).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import attrs

from .measurement import RequestMeasurement
from .stats import percentile

# Counter names, newest first; the first pair a server exports is used.
_PREFIX_CACHE_COUNTERS = (
    ("trioserve:prefix_cache_hits_total", "trioserve:prefix_cache_queries_total"),
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
)
_SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")


@attrs.frozen
class Distribution:
    """Summary of a latency in milliseconds."""

    mean: float
    std: float
    median: float
    p90: float
    p99: float

    @classmethod
    def from_seconds(cls, values: Sequence[float]) -> Distribution | None:
        """Summarize values in seconds; ``None`` when there are none."""
        if not values:
            return None
        ms = [v * 1000.0 for v in values]
        mean = sum(ms) / len(ms)
        std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
        return cls(mean, std, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@attrs.frozen
class SLO:
    """Service-level objectives for goodput, in milliseconds; ``None`` is unset."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, specs: Sequence[str]) -> SLO:
        """From ``["ttft:200", "tpot:50", "e2el:2000"]``."""
        values: dict[str, float] = {}
        for spec in specs:
            key, sep, value = spec.partition(":")
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"bad SLO {spec!r}: expected ttft:MS, tpot:MS or e2el:MS")
            try:
                values[f"{key}_ms"] = float(value)
            except ValueError:
                raise ValueError(f"bad SLO {spec!r}: {value!r} is not a number of milliseconds") from None
            if values[f"{key}_ms"] < 0:
                raise ValueError(f"bad SLO {spec!r}: must be >= 0")
        return cls(**values)

    def is_empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def met_by(self, ttft: float, tpot: float, e2el: float) -> bool:
        """Whether a request with these times (seconds) meets every set SLO."""
        pairs = ((self.ttft_ms, ttft), (self.tpot_ms, tpot), (self.e2el_ms, e2el))
        return all(limit is None or value * 1000.0 <= limit for limit, value in pairs)


@attrs.frozen
class BenchmarkMetrics:
    """Everything the report shows about one run."""

    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    # None when no SLO was given.
    request_goodput: float | None
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2el: Distribution | None
    prefix_cache_hit_rate: float | None = None
    # Distinct error texts of the failed requests, with how often each occurred.
    errors: dict[str, int] = attrs.field(factory=dict)


def tpot_of(output: RequestMeasurement) -> float | None:
    """Mean time per output token after the first; ``None`` for one token."""
    if output.output_tokens <= 1:
        return None
    return (output.e2el - output.ttft) / (output.output_tokens - 1)


def _per_second(count: float, duration_s: float) -> float:
    # A run where every request failed at once can take no time at all.
    if duration_s == 0:
        return 0.0 if count == 0 else math.inf
    return count / duration_s


def calculate_metrics(
    outputs: Sequence[RequestMeasurement],
    duration_s: float,
    slo: SLO | None = None,
    prefix_cache_hit_rate: float | None = None,
) -> BenchmarkMetrics:
    """The metrics of one run of ``outputs`` that took ``duration_s``."""
    if duration_s < 0:
        raise ValueError("duration_s must be >= 0")
    done = [o for o in outputs if o.success]
    errors: dict[str, int] = {}
    for o in outputs:
        if not o.success:
            errors[o.error] = errors.get(o.error, 0) + 1
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_tokens for o in done)
    tpots = [t for t in map(tpot_of, done) if t is not None]
    goodput = None
    if slo is not None and not slo.is_empty():
        good = sum(slo.met_by(o.ttft, tpot_of(o) or 0.0, o.e2el) for o in done)
        goodput = _per_second(good, duration_s)
    return BenchmarkMetrics(
        duration_s=duration_s,
        completed=len(done),
        failed=len(outputs) - len(done),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=_per_second(len(done), duration_s),
        output_throughput=_per_second(total_out, duration_s),
        total_token_throughput=_per_second(total_in + total_out, duration_s),
        request_goodput=goodput,
        ttft=Distribution.from_seconds([o.ttft for o in done]),
        tpot=Distribution.from_seconds(tpots),
        itl=Distribution.from_seconds([gap for o in done for gap in o.itl]),
        e2el=Distribution.from_seconds([o.e2el for o in done]),
        prefix_cache_hit_rate=prefix_cache_hit_rate,
        errors=errors,
    )


@attrs.frozen
class PrefixCacheCounters:
    """A server's cumulative prefix-cache counters (tokens hit, tokens queried)."""

    hits: float
    queries: float


def parse_prefix_cache_counters(text: str) -> PrefixCacheCounters | None:
    """Read the prefix-cache counters from a Prometheus exposition, summed
    over label sets (vLLM labels them by engine); ``None`` if absent."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE_LINE.match(line)
        if match:
            try:
                sums[match[1]] = sums.get(match[1], 0.0) + float(match[3])
            except ValueError:
                continue
    for hits, queries in _PREFIX_CACHE_COUNTERS:
        if hits in sums and queries in sums:
            return PrefixCacheCounters(sums[hits], sums[queries])
    return None


def prefix_cache_hit_rate(before: PrefixCacheCounters | None, after: PrefixCacheCounters | None) -> float | None:
    """Share of queried prompt tokens that hit the cache between two reads;
    ``None`` when either read lacks the counters or nothing was queried."""
    if before is None or after is None:
        return None
    queries = after.queries - before.queries
    if queries <= 0:
        return None
    return (after.hits - before.hits) / queries
