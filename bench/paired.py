"""Paired one-stream rounds: the order of the servers' runs in each round,
and what the rounds sum up to. The part of ``--paired-rounds`` that needs
no server (``trioserve.bench.figures.vs_llama`` runs the rounds).

On a shared VM the host's memory bandwidth moves over minutes, and one
stream's time per token follows it, so two servers timed minutes apart
measure the host as much as the engines. Run with every server up at once,
each round times each server once, back to back; the ratio within a round
sees one state of the host, and the median over rounds is the figure.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import TypeVar

import attrs

T = TypeVar("T")


def abba_order(servers: Sequence[T], round_index: int) -> list[T]:
    """The order ``servers`` run in, in round ``round_index`` (from 0): as
    given in even rounds, reversed in odd ones (A B, B A, A B, ...), so none
    always goes first, or always runs right after another."""
    return list(servers) if round_index % 2 == 0 else list(reversed(servers))


@attrs.frozen
class RatioSummary:
    """Per-round ratios ours / theirs over the rounds both have: their
    ``median``, ``low`` (min) and ``high`` (max), over ``rounds`` rounds."""

    median: float
    low: float
    high: float
    rounds: int

    def to_json(self) -> dict:
        return {"median": self.median, "min": self.low, "max": self.high, "rounds": self.rounds}


def round_ratios(ours: Sequence[float | None], theirs: Sequence[float | None]) -> list[float]:
    """Round by round, ours over theirs; rounds where either has no figure
    (or theirs is 0) are left out."""
    return [a / b for a, b in zip(ours, theirs) if a is not None and b]


def ratio_summary(ours: Sequence[float | None], theirs: Sequence[float | None]) -> RatioSummary | None:
    """The ratios of ``round_ratios`` summed up; None if there are none."""
    ratios = round_ratios(ours, theirs)
    if not ratios:
        return None
    return RatioSummary(statistics.median(ratios), min(ratios), max(ratios), len(ratios))


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(servers: Sequence[Mapping], reference: str | None) -> list[dict]:
    """Per server of one class's rounds (``label``, ``tpot_ms``, ``ttft_ms``
    lists, one figure a round): the median TPOT and TTFT over rounds, and,
    for every server but the ``reference`` (llama-server's label; None: no
    ratios), the ratios of its TPOT to the reference's, round by round."""
    theirs = next((s["tpot_ms"] for s in servers if s["label"] == reference), None)
    rows = []
    for server in servers:
        ratio = None
        if theirs is not None and server["label"] != reference:
            summary = ratio_summary(server["tpot_ms"], theirs)
            ratio = None if summary is None else summary.to_json()
        rows.append({"label": server["label"], "median_tpot_ms": _median(server["tpot_ms"]),
                     "median_ttft_ms": _median(server["ttft_ms"]), "ratio": ratio})  # fmt: skip
    return rows


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "n/a" if value is None else format(value, fmt) + suffix


def paired_lines(paired: Sequence[Mapping], label_of) -> list[str]:
    """results.json's ``paired`` (one entry per class) as a markdown table:
    per server its median TPOT and TTFT over the rounds and its TPOT over
    llama-server's (median, min, max of the per-round ratios), and the
    range of the read bandwidth measured before the runs. ``label_of``
    names a server entry (its class included). Empty without entries."""
    if not paired:
        return []
    lines = [
        "one stream, paired rounds (every server up at once, one run each a round, order ABBA):",
        "",
        "| server | rounds | TPOT p50, median (ms) | TTFT p50, median (ms) | TPOT over llama-server, median "
        "| min | max | read bandwidth (GB/s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]  # fmt: skip
    for entry in paired:
        if entry.get("error"):
            lines.append(f"| {entry.get('isa', '')} | | failed: {entry['error'].splitlines()[0][:120]} "
                         "| | | | | |")  # fmt: skip
        summary = {row["label"]: row for row in entry.get("summary") or []}
        for server in entry.get("servers") or []:
            row = summary.get(server["label"])
            if row is None:
                continue
            ratio = row.get("ratio") or {}
            bandwidth = [b for b in server.get("bandwidth_gbs") or [] if b is not None]
            spread = f"{min(bandwidth):.1f}-{max(bandwidth):.1f}" if bandwidth else "n/a"
            lines.append(
                f"| {label_of(server)} | {len(server['tpot_ms'])} | {_num(row['median_tpot_ms'], ',.1f')} "
                f"| {_num(row['median_ttft_ms'], ',.0f')} | {_num(ratio.get('median'), '.2f', 'x')} "
                f"| {_num(ratio.get('min'), '.2f', 'x')} | {_num(ratio.get('max'), '.2f', 'x')} | {spread} |"
            )
    return lines
