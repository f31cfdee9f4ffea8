"""Resident memory of the engine core alone under a soak-like load.

    .venv/bin/python scripts/rss_engine.py [--minutes 5] [--no-warm-up] [--plain]

Runs ``EngineCore`` on the default model in this process (no server, no
actors) with 6 requests in flight at all times, drawn as the soak draws
them: prompts of 3 to 150 words, ``n`` of 1 to 3, 4 to 64 tokens, greedy or
sampled. Every 30 s it prints the requests started so far and the process's
resident memory. A fixed seed makes two runs send the same requests, so two
versions of the engine (or ``--no-warm-up`` against the default, or
``--plain`` projections against packed ones) can be compared side by side.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from trioserve.bench.datasets import random_words
from trioserve.bench.memory import rss_bytes
from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.sampling.sampling_params import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-warm-up", action="store_true", help="EngineConfig(warm_up=False)")
    parser.add_argument("--plain", action="store_true", help="F.linear projections instead of oneDNN's packed ones")
    args = parser.parse_args()

    def rss() -> int:
        return rss_bytes(os.getpid()) >> 20

    start = time.monotonic()
    core = EngineCore.from_config(EngineConfig(num_threads=1, warm_up=not args.no_warm_up))
    if args.plain:
        core.loaded.model.pack_weights = False
        core.loaded.model._made = None  # made again, unpacked, at the next forward
    kv = core.kv_cache
    print(f"ready in {time.monotonic() - start:.1f} s: RSS {rss()} MiB (KV pool {kv.nbytes >> 20} MiB mapped, "
          f"{(kv.resident_bytes() or 0) >> 20} MiB resident)", flush=True)  # fmt: skip
    rng = random.Random(args.seed)
    started = 0
    start = time.monotonic()
    next_report = start + 30
    while time.monotonic() - start < args.minutes * 60:
        while core.num_requests < 6:
            params = SamplingParams(
                n=rng.randint(1, 3),
                max_tokens=rng.randint(4, 64),
                temperature=rng.choice([0.0, 0.8]),
                ignore_eos=True,
            )
            core.add_request(f"r{started}", random_words(rng, rng.randint(3, 150)), params)
            started += 1
        core.step()
        if time.monotonic() >= next_report:
            next_report += 30
            kv = (core.kv_cache.resident_bytes() or 0) >> 20
            print(f"{time.monotonic() - start:5.0f} s  {started:5d} requests  RSS {rss()} MiB (KV pool {kv} MiB)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
