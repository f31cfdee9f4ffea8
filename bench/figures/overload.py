"""``trioserve bench overload``: goodput under overload, with and without
overload control.

    trioserve bench overload [--duration 60] [--factor 2] [--out overload-results]

1. Starts ``trioserve serve`` (the default model) on a free loopback port and
   measures what it sustains: ``--calibration-requests`` requests in a closed
   loop at ``--max-num-seqs`` concurrency; R = completed requests per second.
   Unless given, the SLO comes from the same run, so that a server that is
   full but not queueing meets it: TTFT within twice the calibration's TTFT
   p90 (at least 1 s), TPOT within 1.5 times its TPOT p90.
2. Offers ``factor * R`` requests per second (Poisson arrivals) for
   ``--duration`` seconds, the same requests to three servers in turn: one as
   started by default (no queue-time bound, no adaptive concurrency), one
   with ``--max-queue-time`` only, and one with ``--max-queue-time`` and
   ``--adaptive-concurrency``.
3. Reports goodput: requests that completed within the SLO (TTFT and TPOT),
   per second of the run, and their output tokens per second; all output
   tokens per second; and what each server refused and why.

Clients give up after ``--client-timeout`` seconds (as a proxy or a user
would), which closes the connection: the server then aborts the request.
Everything talks only to 127.0.0.1; the servers are stopped at the end, also
on failure. Speeds depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import httpx
import trio

from trioserve.engine.loading.sources import DEFAULT_MODEL_NAME

from ..arguments import positive_float, positive_int
from ..client import RunResult, Target, run_benchmark
from ..datasets import SampleRequest, load_tokenizer, random_dataset
from ..metrics import SLO, calculate_metrics, tpot_of
from ..process import serving_process
from ..scrape import metric_values
from ..stats import percentile

# The overload metrics and refusals reported of each server.
_OVERLOAD = ("trioserve:overload_actions_total", "trioserve:request_rejected_total", "trioserve:concurrency_limit")


def overload_counters(url: str) -> dict[str, float]:
    """The server's overload metrics and refusals that are not zero, from /metrics."""
    values = metric_values(httpx.get(f"{url}/metrics", timeout=10).text, DEFAULT_MODEL_NAME)
    return {key: value for key, value in values.items() if key.startswith(_OVERLOAD) and value}


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "overload",
        help="goodput under twice the load a server sustains, with and without overload control",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench overload``: "),
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    load = p.add_argument_group("load")
    load.add_argument("--duration", type=positive_float, default=60.0, help="seconds of offered load per server (default: 60)")
    load.add_argument("--factor", type=positive_float, default=2.0, help="offered load over what the server sustains (default: 2)")
    load.add_argument("--input-len", type=positive_int, default=64, help="prompt tokens (default: 64)")
    load.add_argument("--output-len", type=positive_int, default=64, help="tokens out, ignore_eos (default: 64)")
    load.add_argument("--calibration-requests", type=positive_int, default=64,
                      help="requests of the closed-loop run that measures the sustained rate (default: 64)")  # fmt: skip
    load.add_argument("--rate", type=positive_float, default=None, help="skip calibration: the sustained requests/s")
    load.add_argument("--client-timeout", type=positive_float, default=30.0,
                      help="seconds a client waits before it hangs up (default: 30)")  # fmt: skip
    load.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals (default: 0)")
    slo = p.add_argument_group("SLO and control")
    slo.add_argument("--slo-ttft-ms", type=positive_float, default=None, help="default: from the calibration")
    slo.add_argument("--slo-tpot-ms", type=positive_float, default=None, help="default: from the calibration")
    slo.add_argument("--max-queue-time", type=positive_float, default=None, help="seconds (default: half the TTFT SLO)")
    slo.add_argument("--target-tpot-ms", type=positive_float, default=None, help="default: 0.8 of the TPOT SLO")
    server = p.add_argument_group("server")
    server.add_argument("--max-num-seqs", type=positive_int, default=32, help="every server's --max-num-seqs (default: 32)")
    server.add_argument("--num-threads", type=positive_int, default=None, help="every server's --num-threads")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("overload-results"), help="folder for logs and summary.json")
    p.set_defaults(func=run)
    return p


def summarize(run: RunResult, slo: SLO, offered_rate: float) -> dict:
    metrics = calculate_metrics(run.outputs, run.duration_s, slo)
    done = [o for o in run.outputs if o.success]
    good = [o for o in done if slo.met_by(o.ttft, tpot_of(o) or 0.0, o.e2el)]
    statuses: dict[str, int] = {}
    for output in run.outputs:
        if not output.success:
            if output.error.startswith("HTTP"):
                key = output.error.split(":", 1)[0]  # "HTTP 503"
            elif output.error.startswith("timed out"):
                key = "client timeout"
            else:
                key = output.error[:60]
            statuses[key] = statuses.get(key, 0) + 1
    ttfts = [o.ttft for o in done]
    return {
        "offered_rps": offered_rate,
        "requests": len(run.outputs),
        "duration_s": run.duration_s,
        "completed": len(done),
        "met_slo": len(good),
        "goodput_rps": len(good) / run.duration_s,
        "goodput_tokens_per_s": sum(o.output_tokens for o in good) / run.duration_s,
        "output_tokens_per_s": metrics.output_throughput,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000 if ttfts else None,
        "ttft_p99_ms": percentile(ttfts, 99) * 1000 if ttfts else None,
        "tpot_p50_ms": metrics.tpot.median if metrics.tpot else None,
        "tpot_p99_ms": metrics.tpot.p99 if metrics.tpot else None,
        "failed": statuses,
    }


async def calibrate(target: Target, samples: list[SampleRequest], concurrency: int) -> dict:
    """Requests/s sustained at ``concurrency``, and the latencies seen."""
    run = await run_benchmark(target, samples, max_concurrency=concurrency, warmups=samples[:2])
    metrics = calculate_metrics(run.outputs, run.duration_s)
    if not metrics.completed or metrics.ttft is None or metrics.tpot is None:
        raise RuntimeError("no request completed during calibration")
    return {
        "rps": metrics.request_throughput,
        "output_tokens_per_s": metrics.output_throughput,
        "ttft_p90_ms": metrics.ttft.p90,
        "tpot_p90_ms": metrics.tpot.p90,
    }


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["--max-num-seqs", str(args.max_num_seqs)]
    if args.num_threads is not None:
        common += ["--num-threads", str(args.num_threads)]
    tokenizer = load_tokenizer()
    summary: dict = {
        "command": " ".join(["trioserve", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "client_timeout_s": args.client_timeout,
    }
    rate, slo_ttft, slo_tpot = args.rate, args.slo_ttft_ms, args.slo_tpot_ms
    if rate is None or slo_ttft is None or slo_tpot is None:
        calibration = random_dataset(
            tokenizer, num_prompts=args.calibration_requests, input_len=args.input_len, output_len=args.output_len,
            seed=args.seed + 1,
        )  # fmt: skip
        with serving_process(common, args.out / "calibration.log") as (url, _):
            target = Target(base_url=url, model=DEFAULT_MODEL_NAME, ignore_eos=True, request_timeout=600.0)
            measured = trio.run(calibrate, target, calibration, args.max_num_seqs)
        summary["calibration"] = measured
        print(f"calibration at concurrency {args.max_num_seqs}: {json.dumps(measured)}", flush=True)
        rate = rate or measured["rps"]
        slo_ttft = slo_ttft or max(1000.0, 2 * measured["ttft_p90_ms"])
        slo_tpot = slo_tpot or 1.5 * measured["tpot_p90_ms"]
    slo = SLO(ttft_ms=slo_ttft, tpot_ms=slo_tpot)
    max_queue_time = args.max_queue_time or slo_ttft / 2000
    target_tpot = args.target_tpot_ms or 0.8 * slo_tpot
    bound = ["--max-queue-time", f"{max_queue_time:.3g}"]
    setups = {
        "without control": common,
        "queue-time bound": [*common, *bound],
        "with control": [*common, *bound, "--adaptive-concurrency", "--target-tpot-ms", f"{target_tpot:.3g}"],
    }
    summary.update(sustained_rps=rate, slo_ms={"ttft": slo_ttft, "tpot": slo_tpot}, flags=setups)
    print(f"SLO: TTFT <= {slo_ttft:.0f} ms, TPOT <= {slo_tpot:.0f} ms; flags: {json.dumps(setups)}", flush=True)
    offered = args.factor * rate
    samples = random_dataset(
        tokenizer, num_prompts=max(1, math.ceil(offered * args.duration)), input_len=args.input_len,
        output_len=args.output_len, seed=args.seed,
    )  # fmt: skip
    for name, flags in setups.items():
        with serving_process(flags, args.out / f"{name.replace(' ', '_')}.log") as (url, _):
            target = Target(base_url=url, model=DEFAULT_MODEL_NAME, ignore_eos=True, request_timeout=args.client_timeout)
            print(f"{name}: {len(samples)} requests at {offered:.2f}/s", flush=True)
            result = trio.run(lambda: run_benchmark(target, samples, request_rate=offered, seed=args.seed))
            summary[name] = {**summarize(result, slo, offered), "server": overload_counters(url)}
        print(json.dumps(summary[name], indent=2), flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    return 0


def print_table(summary: dict) -> None:
    rows = [
        ("requests offered", "requests", "{:.0f}"),
        ("run length (s)", "duration_s", "{:.0f}"),
        ("completed", "completed", "{:.0f}"),
        ("met the SLO", "met_slo", "{:.0f}"),
        ("goodput (requests/s)", "goodput_rps", "{:.2f}"),
        ("goodput (tokens/s)", "goodput_tokens_per_s", "{:.1f}"),
        ("all output tokens/s", "output_tokens_per_s", "{:.1f}"),
        ("TTFT p50 / p99 (ms)", ("ttft_p50_ms", "ttft_p99_ms"), "{:.0f} / {:.0f}"),
        ("TPOT p50 / p99 (ms)", ("tpot_p50_ms", "tpot_p99_ms"), "{:.0f} / {:.0f}"),
    ]
    names = [name for name in summary["flags"] if name in summary]
    print("| | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for label, key, fmt in rows:
        cells = []
        for name in names:
            result = summary[name]
            values = [result[k] for k in key] if isinstance(key, tuple) else [result[key]]
            cells.append("n/a" if None in values else fmt.format(*values))
        print(f"| {label} | " + " | ".join(cells) + " |")
    for name in names:
        print(f"{name}: failed {summary[name]['failed']}; server {summary[name]['server']}")
