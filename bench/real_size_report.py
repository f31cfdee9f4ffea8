"""The tables and the plot of ``trioserve bench real-size``, drawn from its
results.json: the machine's roofline, the floors it sets per shape and
quantization, and each server's figures with their fraction of those floors
(1.00 is the floor reached)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .plot import require_matplotlib, save_figure
from .vs_llama import LLAMA_SERVER, NATIVE, TRIOSERVE, _figure, _ratio, proven, references, server_label

GB = 1e9


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _ok_servers(comparison: Mapping | None) -> list[Mapping]:
    """The servers that finished, at the class they were asked for."""
    return [s for s in (comparison or {}).get("servers", []) if not s.get("error") and proven(s)]


def floors_of(run: Mapping, isa: str = NATIVE) -> Mapping:
    """A run's floors at class ``isa``: its own peaks where they were
    measured (``floors_by_isa``), else native's."""
    return (run.get("floors_by_isa") or {}).get(isa, run["floors"])


def fractions(run: Mapping, server: Mapping, low: int, high: int) -> tuple[float | None, float | None]:
    """A server's fraction of the floors of its class: floor TPOT over its
    TPOT p50 at ``low`` streams, its output throughput over the ceiling at
    ``high``."""
    floors = floors_of(run, server.get("isa", NATIVE))
    tpot = _figure(server, low, "median_tpot_ms")
    throughput = _figure(server, high, "output_throughput")
    return (None if not tpot else floors["tpot_s"] * 1000 / tpot,
            None if throughput is None else throughput / floors["throughput"])  # fmt: skip


def format_report(document: Mapping) -> str:
    """results.json as markdown: the machine, the floors, the servers."""
    info, machine = document["info"], document["machine"]
    low, high = min(info["concurrency"]), max(info["concurrency"])
    # The classes run (--isa; results.json files from before name none: native
    # alone); any but native alone adds a column naming the class.
    machines = dict(document.get("machines") or {NATIVE: machine})
    classes = list(machines) != [NATIVE]
    column, align = ("| CPU class ", "| --- ") if classes else ("", "")
    peaks = machine["peaks"]
    lines = [
        f"{info['cpu']}, {info['threads']} threads, {info['date']}; {info['input_len']} tokens in, "
        f"{info['output_len']} out, greedy, ignore_eos; concurrency {low} and {high}.",
        "",
        column + "| read bandwidth | " + " | ".join(f"{d} GEMM, {r} rows" for d in peaks for r in peaks[d]) + " |",
        align + "| ---: |" + " ---: |" * sum(len(p) for p in peaks.values()),
    ]
    for isa, measured in machines.items():
        # A held class's child measures fewer dtypes: n/a where it has none.
        values = [(measured["peaks"].get(d) or {}).get(r) for d in peaks for r in peaks[d]]
        units = ["GFLOP/s" if d == "bf16" else "GOP/s" for d in peaks for _ in peaks[d]]
        lines.append((f"| {isa} " if classes else "") + f"| {measured['bandwidth'] / GB:.1f} GB/s | " + " | ".join(
            "n/a" if v is None else f"{v / GB:.0f} {unit}" for v, unit in zip(values, units)) + " |")  # fmt: skip
    lines += [
        "",
        f"| shape | weights {column}| parameters (active) | GGUF file (MB) | read per token (MB) "
        f"| weights read per {high}-stream step (MB) "
        f"| floor TPOT, 1 stream (ms) | ceiling, {high} streams (tok/s) | {high}-stream step bound by |",
        f"| --- | --- {align}| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for run in document["runs"]:
        params = f"{run['parameters'] / GB:.2f}B" + (
            f" ({run['active_parameters'] / GB:.2f}B)" if run["active_parameters"] != run["parameters"] else "")
        for isa in machines:
            f = floors_of(run, isa)
            # A mixture's step reads every expert any of its tokens routes to
            # (roofline.experts_read); results.json files from before lack it.
            step = f.get("step_weight_bytes") or f["weight_bytes"]
            lines.append(
                f"| {run['shape']} | {run['quant']} " + (f"| {isa} " if classes else "")
                + f"| {params} | {run['gguf_bytes'] / 1e6:,.0f} "
                f"| {f['weight_bytes'] / 1e6:,.0f} | {step / 1e6:,.0f} | {f['tpot_s'] * 1000:.1f} "
                f"| {f['throughput']:.1f} | {f['bound']} |"
            )
    lines += [
        "",
        f"| shape | weights | server | TPOT p50, {low} stream (ms) | of floor | TTFT p50, {low} stream (ms) "
        f"| {high} streams (tok/s) | of ceiling | TTFT p99, {high} streams (ms) | RSS after (MiB) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in document["runs"]:
        if run.get("error"):
            lines.append(f"| {run['shape']} | {run['quant']} | failed: {run['error'].splitlines()[0][:120]} "
                         "| | | | | | | |")  # fmt: skip
            continue
        for server in (run.get("comparison") or {}).get("servers", []):
            if server.get("error") or not proven(server):
                why = ("failed " + server["error"] if server.get("error")
                       else (server.get("isa_check") or {}).get("reason") or "no check recorded")  # fmt: skip
                lines.append(f"| {run['shape']} | {run['quant']} | {server_label(server)}: "
                             f"{why.splitlines()[0][:100]} | | | | | | | |")  # fmt: skip
                continue
            one, many = fractions(run, server, low, high)
            rss = ((server.get("memory") or {}).get("after") or {}).get("rss")
            lines.append(
                f"| {run['shape']} | {run['quant']} | {server_label(server)} "
                f"| {_num(_figure(server, low, 'median_tpot_ms'), ',.1f')} | {_num(one, '.2f')} "
                f"| {_num(_figure(server, low, 'median_ttft_ms'), ',.0f')} "
                f"| {_num(_figure(server, high, 'output_throughput'), ',.1f')} | {_num(many, '.2f')} "
                f"| {_num(_figure(server, high, 'p99_ttft_ms'), ',.0f')} "
                f"| {_num(None if rss is None else rss / 2**20, ',.0f')} |"
            )
    ratios = [row for run in document["runs"] for row in ratio_rows(run, low, high)]
    # The paired rounds' one-stream ratio (--paired-rounds), where a run has them.
    paired = any(row[2] is not None for row in ratios)
    if ratios:
        lines += ["", f"| trioserve over llama-server | TPOT p50, {low} stream "
                      + ("| paired rounds: median (min-max) " if paired else "")
                      + f"| output tok/s, {high} streams | TTFT p99, {high} streams | RSS after |",
                  "| --- | ---: |" + (" ---: |" if paired else "") + " ---: | ---: | ---: |"]  # fmt: skip
        for label, values, ratio in ratios:
            cells = [_num(v, ".2f") + ("x" if v is not None else "") for v in values]
            if paired:
                cells.insert(1, "n/a" if ratio is None else
                             f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})")  # fmt: skip
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_ratio(comparison: Mapping | None, server: Mapping) -> Mapping | None:
    """A trioserve server's ratio to llama-server over the paired rounds of
    its class (median, min, max; ``trioserve.bench.paired``), or None."""
    for entry in (comparison or {}).get("paired") or []:
        if entry.get("isa", NATIVE) == server.get("isa", NATIVE):
            for row in entry.get("summary") or []:
                if row["label"] == server["label"]:
                    return row.get("ratio")
    return None


def ratio_rows(run: Mapping, low: int, high: int) -> list[tuple[str, list[float | None], Mapping | None]]:
    """Each trioserve row of one shape and quantization over llama-server's
    of the same class, and its ratio over the paired rounds (``paired_ratio``)."""
    servers = _ok_servers(run.get("comparison"))
    reference_of = references(servers)

    def rss(server: Mapping) -> float | None:
        return ((server.get("memory") or {}).get("after") or {}).get("rss")

    return [(f"{run['shape']} {run['quant']}, {server_label(s)}", [
        _ratio(_figure(s, low, "median_tpot_ms"), _figure(reference, low, "median_tpot_ms")),
        _ratio(_figure(s, high, "output_throughput"), _figure(reference, high, "output_throughput")),
        _ratio(_figure(s, high, "p99_ttft_ms"), _figure(reference, high, "p99_ttft_ms")),
        _ratio(rss(s), rss(reference)),
    ], paired_ratio(run.get("comparison"), s)) for s in servers if s["kind"] == TRIOSERVE
        for reference in [reference_of.get(s.get("isa", NATIVE))] if reference is not None]  # fmt: skip


def plot_report(document: Mapping, path: str | Path) -> Path:
    """Each server's fraction of the one-stream floor and of the many-stream
    ceiling, grouped by shape and quantization. Needs matplotlib."""
    plt = require_matplotlib()
    info = document["info"]
    low, high = min(info["concurrency"]), max(info["concurrency"])
    groups = [run for run in document["runs"] if _ok_servers(run.get("comparison"))]
    if not groups:
        raise ValueError("no shape has a finished server: nothing to plot")
    # Each server's label with its class: a configuration's AVX2 bar beside its native one.
    shown = {server_label(s): s for run in groups for s in _ok_servers(run["comparison"])}
    labels = sorted(shown, key=lambda label: (label.startswith(LLAMA_SERVER), label))
    # A configuration's colour at every class, hatched below native.
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    configurations = sorted({s["label"] for s in shown.values() if s["kind"] != LLAMA_SERVER})
    width = 0.8 / len(labels)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for panel, ax in enumerate(axes):
        top = 1.0
        for k, label in enumerate(labels):
            values = []
            for run in groups:
                server = next((s for s in _ok_servers(run["comparison"]) if server_label(s) == label), None)
                values.append(None if server is None else fractions(run, server, low, high)[panel])
            top = max([top] + [v for v in values if v is not None])
            xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(groups))]
            bars = ax.bar(xs, [v or 0.0 for v in values], width, label=label,
                          color="#c44e52" if shown[label]["kind"] == LLAMA_SERVER
                          else palette[configurations.index(shown[label]["label"]) % len(palette)],
                          hatch=None if shown[label].get("isa", NATIVE) == NATIVE else "//")  # fmt: skip
            for bar, value in zip(bars, values):
                ax.annotate(_num(value, ".2f"), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(groups)), [f"{r['shape']}\n{r['quant']}" for r in groups], fontsize=8)
        ax.set(ylim=(0, top * 1.15), title=(f"one stream: floor TPOT / TPOT p50 (concurrency {low})" if panel == 0
                                      else f"{high} streams: tok/s / ceiling"))  # fmt: skip
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Fraction of the roofline: {info['cpu']}, {info['threads']} threads, {info['date'][:10]}")
    fig.tight_layout()
    return save_figure(plt, fig, path)
