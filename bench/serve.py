"""``trioserve bench serve``: benchmark any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

import trio

from trioserve.engine.errors import TrioserveError

from .arguments import int_list, positive_float, positive_int
from .client import RunResult, Target, fetch_first_model, run_benchmark
from .datasets import SampleRequest, file_dataset, load_tokenizer, prefix_dataset, random_dataset
from .metrics import SLO, BenchmarkMetrics, calculate_metrics
from .plot import require_matplotlib, write_plots
from .report import ProgressBar, format_sweep, format_table, result_json


def add_bench_serve_parser(commands) -> argparse.ArgumentParser:
    """Add the ``serve`` command to the ``bench`` group's subparsers;
    ``args.func`` is set to :func:`run_bench_serve`."""
    p = commands.add_parser(
        "serve",
        help="load an OpenAI-compatible server and report throughput and latency",
        description="Stream requests to an OpenAI-compatible server (trioserve, vLLM, llama-server, ...) and "
        "report throughput, TTFT, TPOT, ITL and E2E latency as vLLM's benchmark_serving defines them.",
    )
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    server.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    server.add_argument("--model", default=None, help="model name to request (default: first id of GET /v1/models)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    server.add_argument("--request-timeout", type=positive_float, default=3600.0, help="seconds per request")
    server.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: every output is --output-len long")

    data = p.add_argument_group("dataset")
    data.add_argument(
        "--dataset",
        choices=["random", "prefix", "file"],
        default="random",
        help="random token prompts; prompts sharing --num-prefixes prefixes; or --dataset-path's (default: random)",
    )
    data.add_argument("--dataset-path", default=None, help="JSON list or JSONL of {prompt, output_len?}")
    data.add_argument("--tokenizer", default=None, help="tokenizer.json, HF folder or .gguf (default: SmolLM2-135M)")
    data.add_argument("--num-prompts", type=positive_int, default=100, help="requests to send (default: 100)")
    data.add_argument("--input-len", type=positive_int, default=256, help="prompt tokens (prefix: the distinct part)")
    data.add_argument("--output-len", type=positive_int, default=128, help="max_tokens of each request")
    data.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn from [len*(1-r), len*(1+r)]")
    data.add_argument("--prefix-len", type=positive_int, default=512, help="shared prefix tokens (--dataset prefix)")
    data.add_argument("--num-prefixes", type=positive_int, default=1, help="distinct shared prefixes")
    data.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrival times")

    load = p.add_argument_group("load")
    load.add_argument("--max-concurrency", type=positive_int, default=None, help="requests in flight at most")
    load.add_argument("--request-rate", type=positive_float, default=math.inf, help="requests/s (default: inf)")
    load.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent first and left out of the results")
    load.add_argument("--sweep-concurrency", type=int_list, default=None, metavar="1,8,16,32,64",
                      help="run once per max concurrency")

    out = p.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    out.add_argument("--result-json", default=None, help="write the results to this JSON file")
    out.add_argument("--save-detailed", action="store_true", help="add per-request lists to the JSON")
    out.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here (needs matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run_bench_serve)
    return p


def run_bench_serve(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed ``args`` describe; 0 when requests
    completed, 1 when none did, 2 on a usage or setup error."""
    return trio.run(bench_serve, args)


def _error(message: str) -> int:
    print(f"trioserve bench serve: error: {message}", file=sys.stderr)
    return 2


def _build_samples(args: argparse.Namespace) -> list[SampleRequest]:
    total = args.num_prompts + args.num_warmups
    tokenizer = load_tokenizer(args.tokenizer)
    if args.dataset == "random":
        return random_dataset(tokenizer, num_prompts=total, input_len=args.input_len, output_len=args.output_len,
                              range_ratio=args.range_ratio, seed=args.seed)
    if args.dataset == "prefix":
        return prefix_dataset(tokenizer, num_prompts=total, prefix_len=args.prefix_len, suffix_len=args.input_len,
                              output_len=args.output_len, num_prefixes=args.num_prefixes,
                              range_ratio=args.range_ratio, seed=args.seed)
    if args.dataset_path is None:
        raise ValueError("--dataset file needs --dataset-path")
    return file_dataset(args.dataset_path, tokenizer, output_len=args.output_len, num_prompts=total)


def _info(args: argparse.Namespace, model: str, slo: SLO) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "dataset": args.dataset,
        "dataset_path": args.dataset_path,
        "num_prompts": args.num_prompts,
        "num_warmups": args.num_warmups,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "prefix_len": args.prefix_len if args.dataset == "prefix" else None,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "goodput_slo_ms": {k: v for k, v in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms), ("e2el", slo.e2el_ms))
                           if v is not None},
    }


async def bench_serve(args: argparse.Namespace) -> int:
    """:func:`run_bench_serve` inside an already running trio loop."""
    try:
        slo = SLO.parse(args.goodput)
        if args.sweep_concurrency and args.max_concurrency is not None:
            raise ValueError("give --max-concurrency or --sweep-concurrency, not both")
        if not args.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
        if args.num_warmups < 0:
            raise ValueError("--num-warmups must be >= 0")
        if args.plot is not None:
            require_matplotlib()  # fail before the run, not after it
        samples = _build_samples(args)
        model = args.model or await fetch_first_model(args.base_url, args.api_key)
    except (TrioserveError, ValueError) as exc:
        return _error(str(exc))
    target = Target(
        base_url=args.base_url, model=model, endpoint=args.endpoint, api_key=args.api_key,
        ignore_eos=args.ignore_eos, request_timeout=args.request_timeout,
    )
    timed, warmups = samples[: args.num_prompts], samples[args.num_prompts :]
    info = _info(args, model, slo)

    results: list[tuple[RunResult, BenchmarkMetrics]] = []
    for concurrency in args.sweep_concurrency or [args.max_concurrency]:
        label = "bench" if concurrency is None else f"concurrency {concurrency}"
        progress = None if args.no_progress else ProgressBar(len(timed), sys.stderr, label=label)
        run = await run_benchmark(target, timed, max_concurrency=concurrency, request_rate=args.request_rate,
                                  burstiness=args.burstiness, seed=args.seed, warmups=warmups, on_done=progress)
        metrics = calculate_metrics(run.outputs, run.duration_s, slo, run.prefix_cache_hit_rate)
        title = "Serving Benchmark Result" + ("" if concurrency is None else f" (concurrency {concurrency})")
        print(format_table(metrics, title), flush=True)
        results.append((run, metrics))
    if len(results) > 1:
        print(format_sweep([(run.max_concurrency, m) for run, m in results]))

    if args.result_json is not None:
        runs = [result_json(run, m, info, detailed=args.save_detailed) for run, m in results]
        sweep = {"sweep_concurrency": args.sweep_concurrency, "runs": runs}
        document = sweep if args.sweep_concurrency else runs[0]
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(f"results written to {path}", file=sys.stderr)
    if args.plot is not None:
        for written in write_plots(args.plot, [run for run, _ in results]):
            print(f"plot written to {written}", file=sys.stderr)
    return 0 if any(m.completed for _, m in results) else 1
