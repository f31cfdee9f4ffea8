"""What a benchmark shows: a JSON result, a printed table, a progress bar."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TextIO

from .client import RunResult
from .measurement import RequestMeasurement
from .metrics import BenchmarkMetrics, Distribution

_LATENCIES = (
    ("ttft", "Time to First Token"),
    ("tpot", "Time per Output Token (excl. 1st token)"),
    ("itl", "Inter-token Latency"),
    ("e2el", "End-to-end Latency"),
)
_WIDTH = 50


def _finite(value: float) -> float | None:
    # JSON has no infinity: an unlimited request rate (or a rate over a run
    # that took no time) is written as null.
    return None if math.isinf(value) else value


def result_json(
    run: RunResult, metrics: BenchmarkMetrics, info: Mapping[str, object], *, detailed: bool = False
) -> dict:
    """The result of one run as JSON-ready data, keyed like vLLM's result
    files (``request_throughput``, ``mean_ttft_ms``, ``p99_itl_ms``, ...).

    ``info`` (model, dataset, ...) is copied in first. ``detailed`` adds the
    per-request lists: lengths, TTFT, E2E latency, ITLs (seconds), errors.
    """
    result: dict = dict(info)
    result.update(
        max_concurrency=run.max_concurrency,
        request_rate=_finite(run.request_rate),
        burstiness=_finite(run.burstiness),
        duration=metrics.duration_s,
        completed=metrics.completed,
        failed=metrics.failed,
        total_input_tokens=metrics.total_input_tokens,
        total_output_tokens=metrics.total_output_tokens,
        request_throughput=_finite(metrics.request_throughput),
        request_goodput=None if metrics.request_goodput is None else _finite(metrics.request_goodput),
        output_throughput=_finite(metrics.output_throughput),
        total_token_throughput=_finite(metrics.total_token_throughput),
        prefix_cache_hit_rate=metrics.prefix_cache_hit_rate,
    )
    for key, _ in _LATENCIES:
        dist: Distribution | None = getattr(metrics, key)
        for stat in ("mean", "std", "median", "p50", "p90", "p99"):
            attr = "median" if stat == "p50" else stat
            result[f"{stat}_{key}_ms"] = None if dist is None else getattr(dist, attr)
    result["errors"] = dict(metrics.errors)
    if detailed:
        outs: Sequence[RequestMeasurement] = run.outputs
        result.update(
            input_lens=[o.prompt_len for o in outs],
            output_lens=[o.output_tokens for o in outs],
            ttfts=[o.ttft for o in outs],
            e2els=[o.e2el for o in outs],
            itls=[list(o.itl) for o in outs],
            request_errors=[o.error for o in outs],
        )
    return result


def _row(label: str, value: object) -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label:<40} {text:>10}"


def format_table(metrics: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """A text table in the layout of vLLM's report."""
    lines = [f" {title} ".center(_WIDTH, "=")]
    lines += [
        _row("Successful requests:", metrics.completed),
        _row("Failed requests:", metrics.failed),
        _row("Benchmark duration (s):", metrics.duration_s),
        _row("Total input tokens:", metrics.total_input_tokens),
        _row("Total generated tokens:", metrics.total_output_tokens),
        _row("Request throughput (req/s):", metrics.request_throughput),
        _row("Request goodput (req/s):", metrics.request_goodput),
        _row("Output token throughput (tok/s):", metrics.output_throughput),
        _row("Total token throughput (tok/s):", metrics.total_token_throughput),
        _row(
            "Prefix cache hit rate (%):",
            None if metrics.prefix_cache_hit_rate is None else 100.0 * metrics.prefix_cache_hit_rate,
        ),
    ]
    for key, heading in _LATENCIES:
        dist: Distribution | None = getattr(metrics, key)
        name = key.upper()
        lines.append(heading.center(_WIDTH, "-"))
        for label, attr in (("Mean", "mean"), ("P50", "median"), ("P90", "p90"), ("P99", "p99")):
            lines.append(_row(f"{label} {name} (ms):", None if dist is None else getattr(dist, attr)))
    if metrics.errors:
        lines.append(" Errors ".center(_WIDTH, "-"))
        for error, count in sorted(metrics.errors.items(), key=lambda item: -item[1])[:10]:
            lines.append(f"{count:>6} x {error.splitlines()[0][:120] if error else '(no message)'}")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _mean(dist: Distribution | None) -> str:
    return "n/a" if dist is None else f"{dist.mean:.1f}"


def format_sweep(rows: Sequence[tuple[int | None, BenchmarkMetrics]]) -> str:
    """One line per concurrency of a sweep: throughputs and mean latencies."""
    header = (
        f"{'conc':>6} {'ok':>6} {'fail':>5} {'req/s':>8} {'out tok/s':>10} "
        f"{'TTFT ms':>9} {'TPOT ms':>9} {'E2E ms':>9}"
    )
    lines = [header, "-" * len(header)]
    for concurrency, m in rows:
        lines.append(
            f"{concurrency if concurrency is not None else 'inf':>6} {m.completed:>6} {m.failed:>5} "
            f"{m.request_throughput:>8.2f} {m.output_throughput:>10.1f} "
            f"{_mean(m.ttft):>9} {_mean(m.tpot):>9} {_mean(m.e2el):>9}"
        )
    return "\n".join(lines)


class ProgressBar:
    """A one-line text progress bar, redrawn in place on a stream (stderr)."""

    def __init__(self, total: int, stream: TextIO, *, label: str = "bench", width: int = 30) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self._stream = stream
        self._label = label
        self._width = width

    def __call__(self, output: RequestMeasurement) -> None:
        """Count one finished request and redraw."""
        self.done += 1
        self.failed += not output.success
        filled = self._width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self._width - filled)
        failed = f", {self.failed} failed" if self.failed else ""
        self._stream.write(f"\r{self._label} [{bar}] {self.done}/{self.total}{failed}")
        if self.done >= self.total:
            self._stream.write("\n")
        self._stream.flush()
