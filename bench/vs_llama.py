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

from .paired import paired_lines
from .plot import require_matplotlib, save_figure

QUANTIZATIONS = ("auto", "none", "int8", "int4")
TRIOSERVE = "trioserve"
LLAMA_SERVER = "llama-server"
# The instruction set classes a comparison runs at: "native" is all the CPU
# has; a lower class holds trioserve to it by capability.held_environment
# and runs a llama-server built for it (scripts/build_llama_server.sh --isa).
NATIVE = "native"
ISA_CLASSES = (NATIVE, "avx2")
# llama.cpp's CPU features (its system_info line) above the AVX2 class.
_ABOVE_AVX2 = ("AVX512", "AVX_VNNI", "AVX10", "AMX")

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


def parse_isas(text: str) -> tuple[str, ...]:
    """``"native,avx2"`` -> the instruction set classes to run, in order."""
    values = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    unknown = [v for v in values if v not in ISA_CLASSES]
    if unknown or not values:
        raise ValueError(f"--isa: unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(ISA_CLASSES)}")
    if len(set(values)) != len(values):
        raise ValueError(f"--isa: {text!r} names a class twice")
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
    isa: str = attrs.field(default=NATIVE, validator=attrs.validators.in_(ISA_CLASSES))

    @classmethod
    def trioserve(cls, quantization: str, extra_args: Sequence[str] = ()) -> Contender:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        return cls(TRIOSERVE, f"trioserve {_QUANT_LABELS[quantization]}", quantization, tuple(extra_args))

    @classmethod
    def llama_server(cls, model: str | Path, extra_args: Sequence[str] = ()) -> Contender:
        weights = gguf_weight_type(model)
        return cls(LLAMA_SERVER, LLAMA_SERVER + (f" {weights}" if weights else ""), None, tuple(extra_args))

    def at(self, isa: str) -> Contender:
        """This configuration run at instruction set class ``isa``."""
        return attrs.evolve(self, isa=isa)

    @property
    def slug(self) -> str:
        """The label (and a class other than native) as a file name part."""
        label = self.label if self.isa == NATIVE else f"{self.label} {self.isa}"
        return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def isa_environment(isa: str) -> list[str]:
    """What ``env`` is given before trioserve's command at class ``isa``:
    the variables that hold a process lower are unset (a bench started held
    to AVX2 still runs its native row at the CPU's best), then a class
    below native sets its own (``capability.held_environment``), for the
    child alone, since they must be there before torch loads."""
    from trioserve.engine.kernels import capability  # torch: only where a server starts

    held = {} if isa == NATIVE else capability.held_environment(isa)
    unset = [arg for name in (capability.ASSUME_ENV, *capability.LIBRARY_CAPS) if name not in held
             for arg in ("-u", name)]  # fmt: skip
    return unset + [f"{name}={value}" for name, value in held.items()]


def trioserve_command(binary: str | Path, contender: Contender, layout: Layout, port: int) -> list[str]:
    """``trioserve serve`` on the default model (``--model`` may come in the
    extra arguments) with the layout's sequences, context and threads, under
    ``env`` with the contender's class's variables (``isa_environment``)."""
    assert contender.kind == TRIOSERVE and contender.quantization is not None
    return [
        "env", *isa_environment(contender.isa),
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
class IsaCheck:
    """Whether a server really ran at the class it was ``asked`` for:
    ``found`` is what its own report shows (trioserve's ``/version``,
    llama-server's system_info line), ``proven`` that nothing in it is
    above ``asked`` (always true of native, which is whatever the CPU has),
    ``reason`` why not."""

    asked: str
    proven: bool
    found: str
    reason: str = ""

    def to_json(self) -> dict:
        return attrs.asdict(self)


def _level_index(level: str) -> int:
    from trioserve.engine.kernels.capability import ISA_LEVELS

    return ISA_LEVELS.index(level)


def check_trioserve_isa(asked: str, cpu: Mapping | None, needs: Mapping[str, str] | None = None) -> IsaCheck:
    """What trioserve's ``/version`` ``cpu`` block shows of the class it ran
    at: torch's dispatch level and the highest level (``capability.ISA_LEVELS``)
    any path it could choose needs (``needs``: path name to level, default
    ``capability.PROBES``'). Below native it is proven only where both are at
    most ``asked``, and the switch and the library caps are the ones
    ``capability.held_environment(asked)`` sets."""
    from trioserve.engine.kernels import capability

    if cpu is None:
        return IsaCheck(asked, False, "nothing", "/version shows no CPU paths (no model loaded on the CPU)")
    needs = {p.name: p.needs for p in capability.PROBES} if needs is None else needs
    torch_level = str(cpu.get("capability", "")).lower()
    available = sorted(name for name, path in cpu.get("paths", {}).items() if path.get("available"))
    unknown = [name for name in available if name not in needs]
    if torch_level not in capability.ISA_LEVELS or unknown:
        what = f"torch capability {cpu.get('capability')!r}" if not unknown else f"paths {', '.join(unknown)}"
        return IsaCheck(asked, asked == NATIVE, f"torch {cpu.get('capability')}", f"{what} of no known level")
    top = max(available, key=lambda name: _level_index(needs[name]), default=None)
    top_level = "default" if top is None else needs[top]
    found = f"torch {cpu['capability']}, paths up to {top_level}" + (f" ({top})" if top else "")
    if asked == NATIVE:
        return IsaCheck(asked, True, found)
    held = capability.held_environment(asked)
    caps = cpu.get("library_caps") or {}
    wrong = [f"{name}={caps.get(name)!r}" for name, value in held.items()
             if name != capability.ASSUME_ENV and caps.get(name) != value]  # fmt: skip
    if cpu.get("assume") != asked:
        wrong.insert(0, f"{capability.ASSUME_ENV}={cpu.get('assume')!r}")
    above = [what for what, level in (("torch", torch_level), (top, top_level))
             if _level_index(level) > _level_index(asked)]  # fmt: skip
    reasons = ([f"not held: {', '.join(wrong)}"] if wrong else []) + (
        [f"above {asked}: {', '.join(above)}"] if above else [])  # fmt: skip
    return IsaCheck(asked, not reasons, found, "; ".join(reasons))


def llama_cpu_features(system_info: str) -> list[str]:
    """The CPU features llama.cpp's system_info line says it runs (``AVX2 = 1``)."""
    return re.findall(r"\b([A-Z][A-Z0-9_]*) = 1\b", system_info.partition("CPU :")[2])


def check_llama_isa(asked: str, system_info: str | None) -> IsaCheck:
    """What llama-server's system_info line shows of the class it ran at:
    below native, proven where it runs AVX2 and nothing above (AVX-512 of
    any kind, AVX-VNNI, AMX)."""
    if not system_info:
        return IsaCheck(asked, asked == NATIVE, "nothing", "no system_info line from llama-server")
    features = llama_cpu_features(system_info)
    above = [f for f in features if f.startswith(_ABOVE_AVX2)]
    found = ", ".join(f for f in features if f.startswith(("AVX", "AMX", "F16C", "FMA"))) or "no AVX"
    if asked == NATIVE:
        return IsaCheck(asked, True, found)
    if "AVX2" not in features:
        return IsaCheck(asked, False, found, "its CPU backend does not run AVX2")
    return IsaCheck(asked, not above, found, f"above avx2: {', '.join(above)}" if above else "")


def server_label(server: Mapping) -> str:
    """A result's label with the class it ran at: below native, only where
    its ``isa_check`` proved it (else the label says so)."""
    isa = server.get("isa", NATIVE)
    if isa == NATIVE:
        return server["label"]
    if (server.get("isa_check") or {}).get("proven"):
        return f"{server['label']}, {isa.upper()}"
    return f"{server['label']}, {isa.upper()} asked, not proven"


def proven(server: Mapping) -> bool:
    """Whether ``server`` ran at the class it asked for (native always)."""
    return server.get("isa", NATIVE) == NATIVE or bool((server.get("isa_check") or {}).get("proven"))


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
    concurrency, memory per server, ratios to llama-server, and the paired
    one-stream rounds where it has them (``--paired-rounds``)."""
    servers = document["servers"]
    lines = [
        "| server | concurrency | TPOT p50 (ms) | TPOT p99 (ms) | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s "
        "| tokens per request | completed / failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for server in servers:
        if server.get("error"):
            lines.append(f"| {server_label(server)} | | failed: {server['error'].splitlines()[0][:120]} | | | | | | |")
            continue
        for concurrency, run in server["runs"].items():
            lines.append(
                f"| {server_label(server)} | {concurrency} | {_ms(run['median_tpot_ms'])} | {_ms(run['p99_tpot_ms'])} "
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
            f"| {server_label(server)} | {_mib(ready.get('rss'))} | {_mib(after.get('rss'))} "
            f"| {_mib(after.get('hwm'))} "
            f"| {_mib(after.get('rss_anon'))} / {_mib(after.get('rss_file'))} |"
        )
    ratios = ratio_rows(document)
    if ratios:
        lines += ["", "| against llama-server | " + " | ".join(label for label, _ in RATIOS) + " |",
                  "| --- |" + " ---: |" * len(RATIOS)]  # fmt: skip
        for label, values in ratios:
            lines.append(f"| {label} | " + " | ".join("n/a" if v is None else f"{v:.2f}x" for v in values) + " |")
        lines.append("| target (issue #13) | " + " | ".join(target for _, target in RATIOS) + " |")
    paired = paired_lines(document.get("paired") or [], server_label)
    if paired:
        lines += ["", *paired]
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


def references(servers: Sequence[Mapping]) -> dict[str, Mapping]:
    """The first finished llama-server of each class, among ``servers``
    that ran at the class they asked for: each trioserve row's reference."""
    found: dict[str, Mapping] = {}
    for server in servers:
        if server["kind"] == LLAMA_SERVER and not server.get("error") and proven(server):
            found.setdefault(server.get("isa", NATIVE), server)
    return found


def ratio_rows(document: Mapping) -> list[tuple[str, list[float | None]]]:
    """Each trioserve row's figures over llama-server's of the same class
    (the ``RATIOS``); none for a row without such a llama-server row, or
    not proven to have run at its class."""
    servers = [s for s in document["servers"] if not s.get("error") and proven(s)]
    reference_of = references(servers)
    low, high = min(document["info"]["concurrency"]), max(document["info"]["concurrency"])

    def rss(server: Mapping) -> float | None:
        return ((server.get("memory") or {}).get("after") or {}).get("rss")

    rows = []
    for server in servers:
        reference = reference_of.get(server.get("isa", NATIVE))
        if server["kind"] != TRIOSERVE or reference is None:
            continue
        rows.append((server_label(server), [
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
    servers = [s for s in document["servers"] if not s.get("error") and proven(s)]
    if not servers:
        raise ValueError("no server finished its runs: nothing to plot")
    labels = [server_label(s) for s in servers]
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
        for bar, server in zip(bars, servers):
            if server.get("isa", NATIVE) != NATIVE:
                bar.set_hatch("//")  # a lower class than the CPU has, beside its native bar
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
