"""``trioserve bench``: benchmarks of a running server and of the engine.

``bench serve`` (the names exported here) streams ``/v1/completions`` (or
``/v1/chat/completions``) requests from a random, prefix-sharing or file
dataset, under a concurrency limit and a Poisson arrival rate, and reports
throughput, TTFT, TPOT, ITL, E2E latency, goodput and prefix-cache reuse
with vLLM's ``benchmark_serving`` definitions. Its client imports nothing
from ``trioserve.web``: any OpenAI-compatible server will do. ``bench
offline`` (``offline.py``) runs the engine core against transformers
``generate`` in one process; the other commands, the figures of
docs/benchmarks.md, are ``figures/``, one module each. ``cli.py`` adds them
all to ``trioserve`` through an entry point.

Shared by them, the soak and the tests: ``stats`` (the one percentile),
``memory`` (resident memory from /proc), ``scrape`` (a server's /metrics,
and waiting until it is idle), ``process`` (a server in a process of its
own).
"""

from .serve import add_bench_serve_parser, bench_serve, run_bench_serve
from .client import RunResult, ServerError, Target, arrival_offsets, run_benchmark, send_request
from .datasets import DatasetError, SampleRequest, file_dataset, load_tokenizer, prefix_dataset, random_dataset
from .measurement import RequestMeasurement
from .metrics import SLO, BenchmarkMetrics, Distribution, calculate_metrics
from .plot import PlotUnavailableError, write_plots
from .report import ProgressBar, format_table, result_json

__all__ = [
    "SLO",
    "BenchmarkMetrics",
    "DatasetError",
    "Distribution",
    "PlotUnavailableError",
    "ProgressBar",
    "RequestMeasurement",
    "RunResult",
    "SampleRequest",
    "ServerError",
    "Target",
    "add_bench_serve_parser",
    "arrival_offsets",
    "bench_serve",
    "calculate_metrics",
    "file_dataset",
    "format_table",
    "load_tokenizer",
    "prefix_dataset",
    "random_dataset",
    "result_json",
    "run_bench_serve",
    "run_benchmark",
    "send_request",
    "write_plots",
]
