"""Decode speed and resident memory of the default model per ``--quantization``.

Each value runs in a fresh process, and the values take turns ``--rounds``
times, so that load from other work falls on all of them alike (on a shared
machine compare ratios within one run). Per process, through ``EngineCore``
on one thread with 2 torch threads:

- one stream: 128 prompt tokens, then ``--tokens`` greedy tokens; TPOT p50;
- ``--streams`` streams at once (distinct 128-token prompts, ``--tokens``
  each, all admitted together): the p50 step time once every stream
  decodes, and the output tokens per second that gives;
- resident memory after loading, and at the end.

``--threads 1`` where the machine is busy: a 2-thread OpenMP region waits
for a descheduled thread (several ms per matmul under load).

    .venv/bin/python scripts/quant_decode.py --rounds 2
    .venv/bin/python scripts/quant_decode.py --quantization none auto --streams 32 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _child(quantization: str, tokens: int, streams: int) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("TRIOSERVE_BENCH_THREADS", "2")))
    from trioserve.engine.config import EngineConfig
    from trioserve.engine.core.engine_core import EngineCore
    from trioserve.engine.loading.loader import load_model
    from trioserve.engine.sampling.sampling_params import SamplingParams

    q = quantization
    start = time.perf_counter()
    loaded = load_model(None, quantization=q)
    load_s = time.perf_counter() - start
    rss_loaded = _rss_mib()
    # A pool for every stream's whole context (128 + tokens, in 16-token blocks).
    blocks = streams * -(-(128 + tokens + 16) // 16)
    c = loaded.model_config
    per_block = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * c.head_dim * 4
    config = EngineConfig(max_model_len=512, kv_cache_memory=blocks * per_block, quantization=q, max_num_seqs=max(streams, 1))
    core = EngineCore(loaded, config)
    counter = [0]

    def run(n_streams: int, n_tokens: int) -> list[float]:
        """The step times once every stream decodes."""
        for _ in range(n_streams):
            counter[0] += 1
            # Distinct prompts: no prefix-cache hits between the streams.
            prompt = [1000 + (7 * counter[0] + j) % 20000 for j in range(128)]
            params = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
            core.add_request(f"r{counter[0]}", prompt, params)
        times = []
        while core.has_unfinished():
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
        # The last n_tokens - 2 steps decode every stream (the prompts go in
        # within the first steps, 16 to a step of 2,048 tokens).
        return times[-(n_tokens - 2) :]

    run(1, 8)  # warm
    one = run(1, tokens)
    result = {
        "quantization": quantization,
        "choice": loaded.projection_choice.summary,
        "load_s": load_s,
        "tpot1_ms": 1e3 * statistics.median(one),
        "rss_loaded_mib": rss_loaded,
    }
    if streams > 1:
        many = run(streams, tokens)
        step = statistics.median(many)
        result.update({"step_many_ms": 1e3 * step, "tok_s_many": streams / step})
    result["rss_end_mib"] = _rss_mib()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--quantization", nargs="+", default=["none", "auto", "int8", "int4"],
        help="values of --quantization to compare",
    )
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per stream")
    parser.add_argument("--streams", type=int, default=32, help="streams of the batched measurement (1: skip it)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        q, tokens, streams = args.child
        print(json.dumps(_child(q, int(tokens), int(streams))))
        return
    # The children read it (a loaded machine stalls 2-thread OpenMP regions: 1 avoids that).
    os.environ["TRIOSERVE_BENCH_THREADS"] = str(args.threads)
    results: dict[str, list[dict]] = {q: [] for q in args.quantization}
    for _ in range(args.rounds):
        for q in args.quantization:
            cmd = [sys.executable, __file__, "--child", q, str(args.tokens), str(args.streams)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{q} failed:\n{out.stderr[-3000:]}")
            results[q].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[q][-1]), file=sys.stderr)
    ref = results.get("none")
    head = "| --quantization | projections | TPOT 1 stream (per round) |"
    line = "|---|---|---|"
    if args.streams > 1:
        head += f" step at {args.streams} streams | tok/s at {args.streams} |"
        line += "---|---|"
    print(head + " RSS after load | RSS at end |")
    print(line + "---|---|")
    for q, runs in results.items():
        tpots = " / ".join(f"{r['tpot1_ms']:.1f}" for r in runs)
        if ref and q != "none":
            ratio = statistics.median(r["tpot1_ms"] / b["tpot1_ms"] for r, b in zip(runs, ref))
            tpots += f" ms ({ratio:.2f}x none)"
        else:
            tpots += " ms"
        row = f"| {q} | {runs[0]['choice']} | {tpots} |"
        if args.streams > 1:
            steps = " / ".join(f"{r['step_many_ms']:.0f}" for r in runs)
            if ref and q != "none":
                ratio = statistics.median(r["step_many_ms"] / b["step_many_ms"] for r, b in zip(runs, ref))
                steps += f" ms ({ratio:.2f}x none)"
            else:
                steps += " ms"
            row += f" {steps} | {statistics.median(r['tok_s_many'] for r in runs):.0f} |"
        rss0 = statistics.median(r["rss_loaded_mib"] for r in runs)
        rss1 = statistics.median(r["rss_end_mib"] for r in runs)
        print(row + f" {rss0:,.0f} MiB | {rss1:,.0f} MiB |")


if __name__ == "__main__":
    main()
