"""``trioserve bench slo``: goodput under latency objectives, for the slo
scheduling policy against first come, first served and the priority policy.

    trioserve bench slo [--rates 0.5,1,1.5] [--burstiness 1,0.25] [--requests 60] [--out slo-results]

For each setup in ``--setups``, a fresh ``trioserve serve`` (the default
model) on a free loopback port: ``fcfs`` (``--scheduling-policy priority``,
the requests send no priority: one class, arrival order), ``priority``
(the same server flag, the requests send their class's priority) and
``slo`` (``--scheduling-policy slo``, priorities sent: earliest deadline
first in a class, refusal at the door of what cannot meet its targets).
Every setup gets the same requests: a mix of classes (bench/slo.py:
interactive, TTFT 1 s and TPOT 200 ms at priority 0; batch, TTFT 20 s and
TPOT 1 s at priority 1), each sending its ``ttft_ms`` / ``tpot_ms``, at each
rate of ``--rates`` and each arrival shape of ``--burstiness`` (1: Poisson;
lower: burstier), ``--requests`` requests a run, or with ``--duration``
rate x duration requests, so every rate holds its load for as long (a
short burst never lets a queue grow past a loose target).

Reported per run: goodput (requests that met both targets per second of
offered load), the share refused at the door, and per class the admitted
requests whose TTFT overran its target by more than 20%; where the server
predicted TTFTs (slo), how far the admitted requests' predictions were
from the TTFTs it measured (p50 and p90 relative error, bias). With
``--plots``: goodput against offered load, the TTFT CDF per class at the
highest rate, and the refused share against load. Where fcfs and slo
both ran, the issue's goal is read off: FCFS's capacity (the highest rate
up to which it met 90% of targets) and, at the lowest rate run of at least
1.5 times that, the two goodputs, their ratio (goal 1.5x) and the slo
policy's late admitted requests (goal none). Clients give up after
``--client-timeout`` seconds. Speeds depend on the machine and on what else
runs on it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from trioserve.engine.loading.sources import DEFAULT_MODEL_NAME

from ..arguments import name_list, positive_float, positive_int
from ..client import Target
from ..datasets import load_tokenizer
from ..plot import require_matplotlib, save_figure
from ..process import serving_process
from ..slo import (
    DEFAULT_CLASSES,
    GOAL_GOODPUT,
    GOAL_LOAD,
    MixedRequest,
    MixRun,
    goal,
    mixed_requests,
    run_mix,
    summarize,
)

# Setup -> (the server's --scheduling-policy, whether requests send their priority).
SETUPS = {"fcfs": ("priority", False), "priority": ("priority", True), "slo": ("slo", True)}

GOODPUT_PNG = "slo_goodput.png"
TTFT_CDF_PNG = "slo_ttft_cdf.png"
REFUSED_PNG = "slo_refused.png"


def float_list(text: str) -> list[float]:
    """``"0.5,1,2"`` -> ``[0.5, 1.0, 2.0]``: numbers > 0."""
    return [positive_float(part) for part in name_list(text)]


def setup_list(text: str) -> list[str]:
    names = name_list(text)
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown setup {unknown[0]!r}; choose from {', '.join(SETUPS)}")
    return names


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "slo",
        help="goodput under per-request latency objectives: the slo policy against FCFS and priorities",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench slo``: "),
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    load = p.add_argument_group("load")
    load.add_argument("--rates", type=float_list, default=[0.5, 1.0, 1.5], help="requests/s to offer (default: 0.5,1,1.5)")
    load.add_argument("--burstiness", type=float_list, default=[1.0],
                      help="arrival shapes: 1 Poisson, lower burstier (default: 1)")  # fmt: skip
    load.add_argument("--requests", type=positive_int, default=60, help="requests a run (default: 60)")
    load.add_argument("--duration", type=positive_float, default=None,
                      help="seconds of arrivals a run: each rate sends rate x duration requests, so every "
                           "rate holds its load as long (overrides --requests)")  # fmt: skip
    load.add_argument("--client-timeout", type=positive_float, default=120.0,
                      help="seconds a client waits before it hangs up (default: 120)")  # fmt: skip
    load.add_argument("--seed", type=int, default=0, help="seeds prompts, classes and arrivals (default: 0)")
    server = p.add_argument_group("server")
    server.add_argument("--setups", type=setup_list, default=list(SETUPS), help="default: fcfs,priority,slo")
    server.add_argument("--max-num-seqs", type=positive_int, default=8, help="every server's --max-num-seqs (default: 8)")
    server.add_argument("--num-threads", type=positive_int, default=None, help="every server's --num-threads")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("slo-results"), help="folder for logs and summary.json")
    out.add_argument("--plots", type=Path, default=None, help="folder for the PNG plots (default: none)")
    p.set_defaults(func=run)
    return p


def requests_for(
    rate: float, requests: Sequence[MixedRequest], duration: float | None
) -> Sequence[MixedRequest]:
    """A run's requests at ``rate``: all of ``requests``, or with a
    ``duration`` the first ``ceil(rate * duration)`` of them."""
    return requests if duration is None else requests[: math.ceil(rate * duration)]


async def sweep(
    target: Target, requests, rates, burstinesses, *, with_priority: bool, seed: int, duration: float | None = None
) -> list[dict]:
    """One run of ``requests`` (``requests_for`` each rate) per (burstiness,
    rate), summarized, after a warm-up of two requests of each class, sent
    at once and left out."""
    warmups = [r for c in {r.request_class for r in requests} for r in [x for x in requests if x.request_class == c][:2]]
    await run_mix(target, warmups, request_rate=math.inf, with_priority=with_priority)
    results = []
    for burstiness in burstinesses:
        for rate in rates:
            mix: MixRun = await run_mix(
                target,
                requests_for(rate, requests, duration),
                request_rate=rate,
                burstiness=burstiness,
                with_priority=with_priority,
                seed=seed,
            )
            results.append(summarize(mix))
            line = {k: results[-1][k] for k in ("offered_rps", "burstiness", "goodput_rps", "refused", "late")}
            if results[-1]["ttft_prediction"] is not None:
                line["ttft_prediction_p90"] = results[-1]["ttft_prediction"]["rel_err_p90"]
            print(json.dumps(line), flush=True)
    return results


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["--max-num-seqs", str(args.max_num_seqs)]
    if args.num_threads is not None:
        common += ["--num-threads", str(args.num_threads)]
    count = args.requests if args.duration is None else math.ceil(max(args.rates) * args.duration)
    requests = mixed_requests(load_tokenizer(), DEFAULT_CLASSES, count, seed=args.seed)
    summary: dict = {
        "command": " ".join(["trioserve", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "classes": [attrs.asdict(c) for c in DEFAULT_CLASSES],
        "setups": {},
    }
    for name in args.setups:
        policy, with_priority = SETUPS[name]
        with serving_process([*common, "--scheduling-policy", policy], args.out / f"{name}.log") as (url, _):
            target = Target(base_url=url, model=DEFAULT_MODEL_NAME, ignore_eos=True, request_timeout=args.client_timeout)
            print(f"{name}: --scheduling-policy {policy}, priorities {'sent' if with_priority else 'not sent'}", flush=True)
            summary["setups"][name] = trio.run(
                lambda: sweep(
                    target, requests, args.rates, args.burstiness, with_priority=with_priority, seed=args.seed,
                    duration=args.duration,
                )
            )
    summary["load_average_after"] = os.getloadavg()
    summary["goal"] = goals(summary)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    print_predictions(summary)
    print_goals(summary)
    if args.plots is not None:
        for path in write_plots(summary, args.plots):
            print(f"wrote {path}")
    return 0


def goals(summary: dict) -> list[dict]:
    """``slo.goal`` per arrival shape, where the sweep ran both fcfs and slo."""
    setups = summary["setups"]
    if "fcfs" not in setups or "slo" not in setups:
        return []
    shapes = sorted({r["burstiness"] for r in setups["fcfs"]}, reverse=True)
    return [
        {"burstiness": shape, **goal([r for r in setups["fcfs"] if r["burstiness"] == shape],
                                     [r for r in setups["slo"] if r["burstiness"] == shape])}
        for shape in shapes
    ]  # fmt: skip


def print_goals(summary: dict) -> None:
    """A line per arrival shape: FCFS's capacity and the goal's figures."""
    for g in summary.get("goal", []):
        shape = "Poisson" if g["burstiness"] == 1 else f"gamma {g['burstiness']:g}"
        if g["fcfs_capacity_rps"] is None:
            print(f"{shape}: fcfs met {g['attainment']:.0%} of targets at no rate run")
        elif g["at_rps"] is None:
            print(f"{shape}: fcfs capacity {g['fcfs_capacity_rps']:g} req/s (>= {g['attainment']:.0%} met); "
                  f"run a rate of at least {GOAL_LOAD * g['fcfs_capacity_rps']:g} for the goal")  # fmt: skip
        else:
            print(f"{shape}: fcfs capacity {g['fcfs_capacity_rps']:g} req/s (>= {g['attainment']:.0%} met); "
                  f"at {g['at_rps']:g} req/s slo {g['slo_goodput_rps']:.2f} / fcfs {g['fcfs_goodput_rps']:.2f} "
                  f"= {g['ratio']:.2f}x (goal {GOAL_GOODPUT:g}x), slo late {g['slo_late']}: "
                  f"{'met' if g['met'] else 'not met'}")  # fmt: skip


def print_table(summary: dict) -> None:
    """A markdown table: a row per (burstiness, rate), per setup goodput,
    refused share and late admitted requests."""
    names = list(summary["setups"])
    print("| arrivals | offered (req/s) | " + " | ".join(f"{n}: goodput / refused / late" for n in names) + " |")
    print("| --- | --- |" + " --- |" * len(names))
    for i, first in enumerate(summary["setups"][names[0]]):
        shape = "Poisson" if first["burstiness"] == 1 else f"gamma {first['burstiness']:g}"
        cells = []
        for name in names:
            r = summary["setups"][name][i]
            cells.append(f"{r['goodput_rps']:.2f} / {r['refused_fraction']:.0%} / {r['late']}")
        print(f"| {shape} | {first['offered_rps']:g} | " + " | ".join(cells) + " |")


def print_predictions(summary: dict) -> None:
    """A markdown table of the TTFT predictions' relative error on the
    admitted requests (p50 / p90 / bias, bench/slo.py's
    ``prediction_error``), in all and per class, for every run whose
    server predicted (the slo policy); nothing where none did."""
    rows = [(name, r) for name, runs in summary["setups"].items() for r in runs if r.get("ttft_prediction")]
    if not rows:
        return
    classes = [c["name"] for c in summary["classes"]]

    def cell(error: dict | None) -> str:
        if error is None:
            return "-"
        return f"{error['rel_err_p50']:.2f} / {error['rel_err_p90']:.2f} / {error['bias']:.2f} ({error['n']})"

    print()
    print("| setup | arrivals | offered (req/s) | TTFT prediction error p50 / p90 / bias (n): all | "
          + " | ".join(classes) + " |")  # fmt: skip
    print("| --- | --- | --- | --- |" + " --- |" * len(classes))
    for name, r in rows:
        shape = "Poisson" if r["burstiness"] == 1 else f"gamma {r['burstiness']:g}"
        per_class = [cell(r["classes"].get(c, {}).get("ttft_prediction")) for c in classes]
        print(f"| {name} | {shape} | {r['offered_rps']:g} | {cell(r['ttft_prediction'])} | " + " | ".join(per_class) + " |")


def write_plots(summary: dict, directory: Path) -> list[Path]:
    """Goodput and refused share against offered load (a panel per arrival
    shape), and the TTFT CDF per class at the highest rate (first shape)."""
    plt = require_matplotlib()
    setups = summary["setups"]
    shapes = sorted({r["burstiness"] for runs in setups.values() for r in runs}, reverse=True)
    written = []
    for png, key, ylabel in (
        (GOODPUT_PNG, "goodput_rps", "goodput (requests/s within both targets)"),
        (REFUSED_PNG, "refused_fraction", "share refused at the door"),
    ):
        fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.2), squeeze=False)
        for ax, shape in zip(axes[0], shapes):
            for name, runs in setups.items():
                points = sorted((r["offered_rps"], r[key]) for r in runs if r["burstiness"] == shape)
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
            if key == "goodput_rps":
                top = max(r["offered_rps"] for runs in setups.values() for r in runs)
                ax.plot([0, top], [0, top], ls=":", color="grey", label="offered")
            title = "Poisson arrivals" if shape == 1 else f"bursty arrivals (gamma shape {shape:g})"
            ax.set(title=title, xlabel="offered load (requests/s)", ylabel=ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        written.append(save_figure(plt, fig, directory / png))
    classes = [c["name"] for c in summary["classes"]]
    fig, axes = plt.subplots(1, len(classes), figsize=(5.5 * len(classes), 4.2), squeeze=False)
    for ax, class_name in zip(axes[0], classes):
        target = None
        for name, runs in setups.items():
            at = [r for r in runs if r["burstiness"] == shapes[0]]
            highest = max(at, key=lambda r: r["offered_rps"])
            entry = highest["classes"].get(class_name)
            if entry is None:
                continue
            target = entry["ttft_target_ms"]
            values = entry["ttft_ms"]
            if values:
                # The CDF over all the class's requests: the refused and
                # those that never got a token stay above the curve's end.
                ys = [(i + 1) / entry["requests"] for i in range(len(values))]
                ax.step(values, ys, where="post", label=f"{name} ({highest['offered_rps']:g} req/s)")
        if target is not None:
            ax.axvline(target, ls="--", color="grey", label="TTFT target")
        ax.set(title=f"TTFT CDF: {class_name}", xlabel="TTFT (ms)", ylabel="fraction of the class's requests", ylim=(0, 1.02))
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    written.append(save_figure(plt, fig, directory / TTFT_CDF_PNG))
    return written
