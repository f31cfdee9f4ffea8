"""One-stream decode time and resident memory of the default model per
``--quantization``, each in a fresh process, taking turns ``--rounds`` times
so that load from other work falls on all of them alike.

    .venv/bin/python scripts/quant_decode.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(2)
from trioserve.engine.config import EngineConfig
from trioserve.engine.engine_core import EngineCore
from trioserve.engine.loader import load_model
from trioserve.engine.sampling_params import SamplingParams
q = sys.argv[1]
loaded = load_model(None, quantization=q)
core = EngineCore(loaded, EngineConfig(max_model_len=512, kv_cache_memory=64 << 20, quantization=q))
prompt = list(range(1000, 1128))
def run(tokens):
    core.add_request(f"r{time.monotonic_ns()}", prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    times = []
    while core.has_unfinished():
        core.step()
        times.append(time.perf_counter())
    return times
run(8)  # warm
times = run(128)
gaps = sorted(b - a for a, b in zip(times, times[1:]))
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
print(json.dumps({"quantization": q, "choice": loaded.projection_choice.summary,
                  "tpot_p50_ms": 1e3 * gaps[len(gaps) // 2], "rss_mib": rss / 2**20}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quantization", nargs="+", default=["none", "auto", "int8", "int4"])
    args = parser.parse_args()
    results: dict[str, list[dict]] = {q: [] for q in args.quantization}
    for _ in range(args.rounds):
        for q in args.quantization:
            out = subprocess.run([sys.executable, "-c", CHILD, q], capture_output=True, text=True, check=True)
            results[q].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| --quantization | projections | TPOT p50 (per round) | RSS after 136 tokens |")
    print("|---|---|---|---|")
    for q, runs in results.items():
        tpots = " / ".join(f"{r['tpot_p50_ms']:.1f}" for r in runs)
        print(f"| {q} | {runs[0]['choice']} | {tpots} ms | {statistics.median(r['rss_mib'] for r in runs):,.0f} MiB |")


if __name__ == "__main__":
    main()
