"""PNG plots of benchmark runs; needs matplotlib (the ``plot`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from trioserve.engine.errors import TrioserveError

from .client import RunResult
from .metrics import calculate_metrics

THROUGHPUT_PNG = "throughput_vs_concurrency.png"
LATENCY_CDF_PNG = "latency_cdf.png"


class PlotUnavailableError(TrioserveError):
    """--plot was asked for but matplotlib is not installed."""


def require_matplotlib():
    """Import matplotlib's pyplot on the file-only Agg backend, or explain
    how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailableError(
            "--plot needs matplotlib, which is not installed; install it with: pip install 'trioserve[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (its folder made if missing), close
    it, and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(run: RunResult) -> str:
    return "unbounded" if run.max_concurrency is None else f"concurrency {run.max_concurrency}"


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


def _plot_throughput(plt, runs: Sequence[RunResult], path: Path) -> None:
    points = sorted(
        ((run.max_concurrency, calculate_metrics(run.outputs, run.duration_s)) for run in runs), key=lambda p: p[0]
    )
    xs = [c for c, _ in points]
    fig, (tokens, requests) = plt.subplots(1, 2, figsize=(11, 4.2))
    tokens.plot(xs, [m.output_throughput for _, m in points], marker="o", label="output")
    tokens.plot(xs, [m.total_token_throughput for _, m in points], marker="s", label="total (prompt + output)")
    tokens.set(title="Token throughput", xlabel="max concurrency", ylabel="tokens/s")
    tokens.legend()
    requests.plot(xs, [m.request_throughput for _, m in points], marker="o")
    requests.set(title="Request throughput", xlabel="max concurrency", ylabel="requests/s")
    for ax in (tokens, requests):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_cdfs(plt, runs: Sequence[RunResult], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, attr, title in zip(axes, ("ttft", "e2el"), ("TTFT", "End-to-end latency")):
        for run in runs:
            values = [getattr(o, attr) * 1000.0 for o in run.outputs if o.success]
            if values:
                xs, ys = _cdf(values)
                ax.step(xs, ys, where="post", label=_label(run))
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(directory: str | Path, runs: Sequence[RunResult]) -> list[Path]:
    """Write the plots of ``runs`` into ``directory`` and return their paths.

    ``latency_cdf.png`` (TTFT and E2E CDFs, one line per run) is always
    written; ``throughput_vs_concurrency.png`` only when every run had a
    concurrency limit, since an unbounded run has no place on that axis.
    """
    if not runs:
        raise ValueError("no runs to plot")
    plt = require_matplotlib()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    if all(run.max_concurrency is not None for run in runs):
        _plot_throughput(plt, runs, directory / THROUGHPUT_PNG)
        written.append(directory / THROUGHPUT_PNG)
    _plot_cdfs(plt, runs, directory / LATENCY_CDF_PNG)
    written.append(directory / LATENCY_CDF_PNG)
    return written
