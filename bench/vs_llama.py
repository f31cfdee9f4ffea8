"""trioserve against llama.cpp's ``llama-server``, side by side: the parts of
``trioserve bench vs-llama`` that need no server running.

They are the two command lines (the same GGUF file, context, slots and
threads for both servers), the check that every request produced as many
tokens as asked, and the comparison's table and plot built from its JSON.
The resident memory of a server's process tree is ``memory.tree_memory``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from .plot import require_matplotlib, save_figure

QUANTIZATIONS = ("auto", "none", "int8", "int4")
TRIOSERVE = "trioserve"
LLAMA_SERVER = "llama-server"

# What each --quantization keeps of a quantized GGUF, for the labels.
_QUANT_LABELS = {"none": "float32", "int8": "int8", "int4": "int4", "auto": "auto"}
# GGUF weight types as llama.cpp names them in file names (Q4_1, Q8_0, F16, ...).
_GGUF_TYPE = re.compile(r"(?:^|[.\-_])((?:I?Q\d+_[0-9A-Z_]+?)|F16|F32|BF16)$", re.IGNORECASE)


def gguf_weight_type(path: str | Path) -> str | None:
    """The weight type a GGUF file's name announces (``Q4_1`` for
    ``SmolLM2-135M-Instruct.Q4_1.gguf``), or None."""
    match = _GGUF_TYPE.search(Path(path).name.removesuffix(".gguf"))
    return match.group(1).upper() if match else None


def parse_quantizations(text: str) -> tuple[str, ...]:
    """``"none,int8,int4"`` -> the trioserve configurations to run, in order;
    an empty string runs none."""
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [v for v in values if v not in QUANTIZATIONS]
    if unknown:
        raise ValueError(f"--trioserve-quantization: unknown {', '.join(unknown)}; choose from {', '.join(QUANTIZATIONS)}")
    if len(set(values)) != len(values):
        raise ValueError(f"--trioserve-quantization: {text!r} names a configuration twice")
    return values


@attrs.frozen
class Layout:
    """What both servers are given alike: ``slots`` sequences at once
    (trioserve's ``--max-num-seqs``, llama-server's ``-np``), each up to
    ``ctx_per_slot`` tokens (trioserve's ``--max-model-len``; llama-server
    splits ``-c`` evenly over its slots), on ``threads`` threads."""

    slots: int = attrs.field(validator=attrs.validators.ge(1))
    ctx_per_slot: int = attrs.field(validator=attrs.validators.ge(1))
    threads: int = attrs.field(validator=attrs.validators.ge(1))

    @property
    def total_context(self) -> int:
        return self.slots * self.ctx_per_slot


@attrs.frozen
class Contender:
    """One server configuration of the comparison."""

    kind: str = attrs.field(validator=attrs.validators.in_((TRIOSERVE, LLAMA_SERVER)))
    label: str
    quantization: str | None = None  # trioserve's --quantization
    extra_args: tuple[str, ...] = ()

    @classmethod
    def trioserve(cls, quantization: str, extra_args: Sequence[str] = ()) -> Contender:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        return cls(TRIOSERVE, f"trioserve {_QUANT_LABELS[quantization]}", quantization, tuple(extra_args))

    @classmethod
    def llama_server(cls, model: str | Path, extra_args: Sequence[str] = ()) -> Contender:
        weights = gguf_weight_type(model)
        return cls(LLAMA_SERVER, LLAMA_SERVER + (f" {weights}" if weights else ""), None, tuple(extra_args))

    @property
    def slug(self) -> str:
        """The label as a file name part."""
        return re.sub(r"[^a-z0-9]+", "-", self.label.lower()).strip("-")


def trioserve_command(binary: str | Path, contender: Contender, layout: Layout, port: int) -> list[str]:
    """``trioserve serve`` on the default model (``--model`` may come in the
    extra arguments) with the layout's sequences, context and threads."""
    assert contender.kind == TRIOSERVE and contender.quantization is not None
    return [
        str(binary), "serve", "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", "5",
        "--quantization", contender.quantization,
        "--max-num-seqs", str(layout.slots), "--max-model-len", str(layout.ctx_per_slot),
        "--num-threads", str(layout.threads),
        *contender.extra_args,
    ]  # fmt: skip


def llama_server_command(binary: str | Path, model: str | Path, contender: Contender, layout: Layout,
                         port: int) -> list[str]:  # fmt: skip
    """``llama-server`` on ``model``: ``-c`` is the whole context, which it
    splits evenly over ``-np`` slots, so each slot gets ``ctx_per_slot``."""
    assert contender.kind == LLAMA_SERVER
    threads = str(layout.threads)
    return [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-c", str(layout.total_context), "-np", str(layout.slots), "-t", threads, "-tb", threads,
        *contender.extra_args,
    ]  # fmt: skip


@attrs.frozen
class TokenCheck:
    """Output tokens per completed request of one ``bench serve`` run: as
    the server counted them (``usage``) and as text chunks streamed."""

    expected: int
    completed: int
    usage_min: int
    usage_max: int
    chunks_min: int
    chunks_max: int

    @property
    def exact(self) -> bool:
        """Every completed request produced exactly ``expected`` tokens."""
        return self.completed > 0 and self.usage_min == self.usage_max == self.expected

    def to_json(self) -> dict:
        return {**attrs.asdict(self), "exact": self.exact}


def check_tokens(result: Mapping, expected: int) -> TokenCheck:
    """The token counts of a ``bench serve --save-detailed`` JSON result."""
    if "output_lens" not in result:
        raise ValueError("the bench result has no per-request lists: run bench serve with --save-detailed")
    ok = [i for i, error in enumerate(result["request_errors"]) if not error]
    usage = [result["output_lens"][i] for i in ok] or [0]
    chunks = [len(result["itls"][i]) + 1 for i in ok] or [0]
    return TokenCheck(expected, len(ok), min(usage), max(usage), min(chunks), max(chunks))


def logprob_token_count(body: Mapping) -> int | None:
    """How many tokens a non-streamed completion's logprobs list: OpenAI's
    ``logprobs.tokens`` (trioserve) or ``logprobs.content`` (llama-server)."""
    choices = body.get("choices") or []
    logprobs = choices[0].get("logprobs") if choices else None
    if not isinstance(logprobs, Mapping):
        return None
    for key in ("tokens", "content"):
        if isinstance(logprobs.get(key), list):
            return len(logprobs[key])
    return None


# The figures a row keeps of each concurrency's bench result.
RUN_FIELDS = ("median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms", "output_throughput",
              "completed", "failed", "duration")  # fmt: skip


def run_summary(result: Mapping, expected_tokens: int) -> dict:
    """The comparison's figures of one ``bench serve`` result."""
    return {**{key: result.get(key) for key in RUN_FIELDS}, "tokens": check_tokens(result, expected_tokens).to_json()}


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f}"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f}"


def _tokens(tokens: Mapping | None) -> str:
    if not tokens:
        return "n/a"
    if tokens["usage_min"] == tokens["usage_max"]:
        text = str(tokens["usage_min"])
    else:
        text = f"{tokens['usage_min']}-{tokens['usage_max']}"
    return text if tokens["exact"] else f"**{text}** (asked {tokens['expected']})"


def format_tables(document: Mapping) -> str:
    """The script's JSON as markdown: latency and throughput per server and
    concurrency, memory per server, and ratios to llama-server."""
    servers = document["servers"]
    lines = [
        "| server | concurrency | TPOT p50 (ms) | TPOT p99 (ms) | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s "
        "| tokens per request | completed / failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for server in servers:
        if server.get("error"):
            lines.append(f"| {server['label']} | | failed: {server['error'].splitlines()[0][:120]} | | | | | | |")
            continue
        for concurrency, run in server["runs"].items():
            lines.append(
                f"| {server['label']} | {concurrency} | {_ms(run['median_tpot_ms'])} | {_ms(run['p99_tpot_ms'])} "
                f"| {_ms(run['median_ttft_ms'])} | {_ms(run['p99_ttft_ms'])} | {_ms(run['output_throughput'])} "
                f"| {_tokens(run.get('tokens'))} | {run['completed']} / {run['failed']} |"
            )
    requests = document["info"].get("memory_after_requests")
    lines += [
        "",
        f"| server | RSS when ready (MiB) | RSS after {f'{requests} requests' if requests else 'the runs'} (MiB) "
        "| peak RSS (VmHWM, MiB) "
        "| anonymous / file-backed (MiB) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for server in servers:
        memory = server.get("memory") or {}
        ready, after = memory.get("ready") or {}, memory.get("after") or {}
        lines.append(
            f"| {server['label']} | {_mib(ready.get('rss'))} | {_mib(after.get('rss'))} | {_mib(after.get('hwm'))} "
            f"| {_mib(after.get('rss_anon'))} / {_mib(after.get('rss_file'))} |"
        )
    ratios = ratio_rows(document)
    if ratios:
        lines += ["", "| against llama-server | " + " | ".join(label for label, _ in RATIOS) + " |",
                  "| --- |" + " ---: |" * len(RATIOS)]  # fmt: skip
        for label, values in ratios:
            lines.append(f"| {label} | " + " | ".join("n/a" if v is None else f"{v:.2f}x" for v in values) + " |")
        lines.append("| target (issue #13) | " + " | ".join(target for _, target in RATIOS) + " |")
    return "\n".join(lines) + "\n"


# (column, target): trioserve's figure over llama-server's, same run.
RATIOS = (
    ("TPOT p50, concurrency 1", "<= 1.0x (aim 0.8x)"),
    ("output tok/s, concurrency 32", ">= 4x"),
    ("TTFT p99, concurrency 32", "<= 0.3x"),
    ("RSS after the requests", "<= 1.5x"),
)


def _figure(server: Mapping, concurrency: int, key: str) -> float | None:
    run = server.get("runs", {}).get(str(concurrency))
    return None if run is None else run.get(key)


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs == 0 or math.isnan(theirs):
        return None
    return ours / theirs


def ratio_rows(document: Mapping) -> list[tuple[str, list[float | None]]]:
    """Each trioserve row's figures over llama-server's (the ``RATIOS``);
    empty without a successful llama-server row."""
    servers = [s for s in document["servers"] if not s.get("error")]
    reference = next((s for s in servers if s["kind"] == LLAMA_SERVER), None)
    if reference is None:
        return []
    low, high = min(document["info"]["concurrency"]), max(document["info"]["concurrency"])

    def rss(server: Mapping) -> float | None:
        return ((server.get("memory") or {}).get("after") or {}).get("rss")

    rows = []
    for server in servers:
        if server["kind"] != TRIOSERVE:
            continue
        rows.append((server["label"], [
            _ratio(_figure(server, low, "median_tpot_ms"), _figure(reference, low, "median_tpot_ms")),
            _ratio(_figure(server, high, "output_throughput"), _figure(reference, high, "output_throughput")),
            _ratio(_figure(server, high, "p99_ttft_ms"), _figure(reference, high, "p99_ttft_ms")),
            _ratio(rss(server), rss(reference)),
        ]))  # fmt: skip
    return rows


def plot_comparison(document: Mapping, path: str | Path) -> Path:
    """Two bar charts from the script's JSON: TPOT p50 at the lowest
    concurrency and output throughput at the highest, one bar per server.
    Needs matplotlib (the ``plot`` extra)."""
    plt = require_matplotlib()
    low, high = min(document["info"]["concurrency"]), max(document["info"]["concurrency"])
    servers = [s for s in document["servers"] if not s.get("error")]
    if not servers:
        raise ValueError("no server finished its runs: nothing to plot")
    labels = [s["label"] for s in servers]
    colors = ["#c44e52" if s["kind"] == LLAMA_SERVER else "#4c72b0" for s in servers]
    fig, (tpot, throughput) = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (
        (tpot, [_figure(s, low, "median_tpot_ms") for s in servers], f"TPOT p50 at concurrency {low}",
         "ms per output token (lower is better)", "{:.1f}"),
        (throughput, [_figure(s, high, "output_throughput") for s in servers], f"Output throughput at concurrency {high}",
         "tokens/s (higher is better)", "{:.1f}"),
    )  # fmt: skip
    for ax, values, title, ylabel, fmt in panels:
        heights = [0.0 if v is None else v for v in values]
        bars = ax.bar(range(len(labels)), heights, color=colors)
        for bar, value in zip(bars, values):
            text = "n/a" if value is None else fmt.format(value)
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
        ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right")
        ax.set(title=title, ylabel=ylabel)
        ax.set_ylim(0, max(heights + [1.0]) * 1.15)
        ax.grid(axis="y", alpha=0.3)
    info = document["info"]
    fig.suptitle(f"{info.get('model_name', 'model')}: {info['input_len']} tokens in, {info['output_len']} out, "
                 f"greedy, same GGUF; {info.get('threads')} threads")  # fmt: skip
    fig.tight_layout()
    return save_figure(plt, fig, path)
