"""``trioserve bench suite``: the float path's serving benchmarks in one
go, their JSON saved: the start, the engine against transformers, and a
server under ``trioserve bench serve``.

It measures the default model's start in a fresh process, runs ``trioserve
bench offline`` (the engine against transformers ``generate`` on the same
prompts), starts ``trioserve serve`` on a free loopback port, and drives it
with ``trioserve bench serve``: concurrency 32 and 1, a concurrency sweep
with plots, 32 requests arriving at once, prefix sharing with the prefix
cache on and off, and 2,000 requests while sampling the server's resident
memory. ``--quick`` runs small counts, to check that it runs. Everything
here talks only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..arguments import name_list
from ..memory import rss_bytes
from ..process import TRIOSERVE, serving_process

PARTS = ("start", "offline", "c32", "c1", "sweep", "burst", "prefix", "memory")


def _parts(text: str) -> set[str]:
    parts = set(name_list(text))
    if parts - set(PARTS):
        raise argparse.ArgumentTypeError(f"unknown {', '.join(sorted(parts - set(PARTS)))}; the parts: {','.join(PARTS)}")
    return parts


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "suite",
        help="the float path's figures in one go: start, bench offline, and a server under bench serve",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench suite``: "),
        epilog=__doc__.split("\n\n", 1)[1],
    )
    work = p.add_argument_group("workload")
    work.add_argument("--quick", action="store_true", help="small counts, to check that the suite runs")
    work.add_argument("--skip", type=_parts, default=set(), metavar="PART,...",
                      help=f"parts to skip, comma-separated: {','.join(PARTS)}")  # fmt: skip
    engine = p.add_argument_group("engine")
    engine.add_argument("--dtype", default=None, help="the engine's weights and KV cache (server and bench offline)")
    engine.add_argument("--quantization", default="none",
                        help="the engine's weights (default: none, the float path the suite's figures use)")  # fmt: skip
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for the JSON and logs")
    out.add_argument("--plots", type=Path, default=Path("docs/images"), help="folder for the sweep's plots")
    p.set_defaults(func=run)
    return p


def measure_start(cache: Path) -> dict:
    """Wall time of a fresh process that loads the default model (weights and
    tokenizer ready), imports included: once with an empty cache (the GGUF is
    converted), then twice from the cache."""
    shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, TRIOSERVE_CACHE=str(cache))
    code = "from trioserve.engine.loading.loader import load_model; load_model(None)"
    times = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    shutil.rmtree(cache, ignore_errors=True)
    return {"cold_s": times[0], "warm_s": min(times[1:])}


def bench(url: str, out: Path, *args: str) -> dict:
    cmd = [str(TRIOSERVE), "bench", "serve", "--base-url", url, "--result-json", str(out), "--no-progress", *args]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    skip = args.skip
    q = args.quick
    n32, n1, n_mem = (8, 2, 50) if q else (64, 8, 2000)
    out_len = 16 if q else 128
    summary: dict = {}
    dtype = ["--dtype", args.dtype] if args.dtype else []
    dtype += ["--quantization", args.quantization]

    if "start" not in skip:
        summary["start"] = measure_start(args.out / "start-cache")

    if "offline" not in skip:
        cmd = [str(TRIOSERVE), "bench", "offline", "--result-json", str(args.out / "offline.json"), *dtype]
        if q:
            cmd += ["--num-prompts", "8", "--output-len", "16", "--batch-size", "4", "--sequential-prompts", "1", "--prefill-batch", "8"]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
        summary["offline"] = json.loads((args.out / "offline.json").read_text())

    common = ["--dataset", "random", "--input-len", "128", "--ignore-eos"]
    prefix = ["--dataset", "prefix", "--prefix-len", "512", "--input-len", "32", "--output-len", "16",
              "--num-prompts", "32", "--max-concurrency", "32", "--ignore-eos", "--seed", "2"]  # fmt: skip
    # Every part draws its own prompts (its own seed), so none finds another's in the prefix cache.
    with serving_process(dtype, args.out / "server.log") as (url, proc):
        if "c32" not in skip:
            summary["c32"] = bench(url, args.out / "c32.json", *common, "--output-len", str(out_len), "--seed", "1",
                                   "--max-concurrency", "32", "--num-prompts", str(n32), "--num-warmups", "2")  # fmt: skip
        if "c1" not in skip:
            summary["c1"] = bench(url, args.out / "c1.json", *common, "--output-len", str(out_len), "--seed", "5",
                                  "--max-concurrency", "1", "--num-prompts", str(n1), "--num-warmups", "1")  # fmt: skip
        if "prefix" not in skip:
            summary["prefix_on"] = bench(url, args.out / "prefix_on.json", *prefix)
        if "memory" not in skip:
            samples = []
            small = ["--dataset", "random", "--input-len", "32", "--output-len", "8", "--max-concurrency", "32", "--ignore-eos"]
            warm = bench(url, args.out / "memory_warmup.json", *small, "--num-prompts", "100", "--seed", "9")
            samples.append(("after 100 warm-up requests", rss_bytes(proc.pid)))
            for part in range(4):
                bench(url, args.out / f"memory_{part}.json", *small, "--num-prompts", str(n_mem // 4), "--seed", str(10 + part))
                samples.append((f"after {100 + (part + 1) * (n_mem // 4)} requests", rss_bytes(proc.pid)))
            summary["memory"] = {"samples": samples, "warmup_completed": warm["completed"]}
    # Without the prefix cache: the sweep reuses its prompts at every
    # concurrency, and the burst must prefill for real to compare with the
    # one-batch prefill.
    with serving_process(["--no-prefix-caching", *dtype], args.out / "server_nocache.log") as (url, _):
        if "burst" not in skip:
            summary["burst32"] = bench(url, args.out / "burst32.json", *common, "--output-len", str(out_len), "--seed", "3",
                                       "--max-concurrency", "32", "--num-prompts", "32")  # fmt: skip
        if "sweep" not in skip:
            sweep = "1,8,16" if q else "1,8,16,32,64"
            summary["sweep"] = bench(url, args.out / "sweep.json", *common, "--output-len", "32", "--seed", "4",
                                     "--num-prompts", "16" if q else "64", "--sweep-concurrency", sweep,
                                     "--plot", str(args.plots))  # fmt: skip
        if "prefix" not in skip:
            summary["prefix_off"] = bench(url, args.out / "prefix_off.json", *prefix)
    for key in ("offline", "c32", "c1", "burst32", "sweep", "prefix_on", "prefix_off"):
        if key not in summary and (args.out / f"{key}.json").exists():
            summary[key] = json.loads((args.out / f"{key}.json").read_text())  # from an earlier run of that part
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    return 0


def print_summary(s: dict) -> None:
    if "start" in s:
        print(f"default model start: cold {s['start']['cold_s']:.1f} s, warm {s['start']['warm_s']:.1f} s")
    off = s.get("offline")
    if off:
        by = {r["name"]: r for r in off["results"]}
        static = next((r for n, r in by.items() if "static batch" in n), None)
        seq = by.get("transformers generate, sequential")
        print(f"matmul roofline {off['matmul_gflops']:.1f} GFLOP/s; batch decode step {off['decode_step_ms']:.1f} ms "
              f"= {off['decode_step_efficiency']:.0%} of roofline")  # fmt: skip
        if "c32" in s and static:
            print(f"c=32 HTTP output {s['c32']['output_throughput']:.1f} tok/s vs transformers static "
                  f"{static['output_tokens_per_s']:.1f} -> {s['c32']['output_throughput'] / static['output_tokens_per_s']:.2f}x")  # fmt: skip
        if "c1" in s and seq:
            print(f"c=1 TPOT p50 {s['c1']['median_tpot_ms']:.1f} ms vs transformers {seq['per_token_latency_ms']:.1f} ms/token "
                  f"-> {s['c1']['median_tpot_ms'] / seq['per_token_latency_ms']:.2f}")  # fmt: skip
        if "burst32" in s:
            print(f"32 at once: TTFT p99 {s['burst32']['p99_ttft_ms']:.0f} ms vs one-batch prefill "
                  f"{off['batch_prefill_seconds'] * 1000:.0f} ms -> {s['burst32']['p99_ttft_ms'] / (off['batch_prefill_seconds'] * 1000):.2f}x")  # fmt: skip
    if "prefix_on" in s and "prefix_off" in s:
        on, offc = s["prefix_on"]["mean_ttft_ms"], s["prefix_off"]["mean_ttft_ms"]
        print(f"prefix sharing: mean TTFT {on:.0f} ms cached vs {offc:.0f} ms uncached -> {offc / on:.2f}x")
    if "memory" in s:
        samples = s["memory"]["samples"]
        base = samples[0][1]
        for label, value in samples:
            print(f"RSS {label}: {value / 2**20:.0f} MiB ({(value - base) / base:+.1%})")
