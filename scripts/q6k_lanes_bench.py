"""Time per 1M weights of the Q6_K lanes kernel against the Q8_0 lanes one (avx512vnni or avx2int8).

    python scripts/q6k_lanes_bench.py [--isa avx512vnni|avx2int8] [--rows N ...] [--library PATH]
                                      [--calls N] [--passes N]

Two measurements, each printed as one JSON line with the load average:

* in cache: one matrix of ``--cache-shape`` (default [256, 4096], 1M
  weights: 0.84 MB as Q6_K lanes, 1.18 MB as Q8_0 lanes) called ``--calls``
  times at each of ``--rows`` (default 1, 4 and 8) on 1 thread; the minimum call, in microseconds a
  1M weights (on a shared machine the minimum of in-cache calls is still
  meaningful where means are not): the kernel's arithmetic, not its bytes.
* from memory: ``--copies`` matrices of ``--memory-shape`` (default 8 of
  [2048, 8192]) cycled, so each call reads its weights from memory, on
  ``--threads`` threads (default 2), at each of ``--rows`` (default 1 and
  4), best of ``--passes`` passes and their median, as microseconds a call
  and GB/s of weight bytes (of the best).

``--isa`` picks the variant both formats run on: avx512vnni (the default;
csrc/q6k_lanes_vnni.h against csrc/lanes_vnni.h, int8 activations both) or
avx2int8 (csrc/q6k_lanes_avx2.h, int8 activations, against the Q8_0 lanes
blocks of csrc/q8_lanes_avx2.h, int16 activations: what avx2int8 held a
Q6_K matrix as before).

Both formats hold the same random weights' sizes (random bytes, float16 d
small and positive; the Q8_0 table random int8 with random steps): only the
kernels' speed is compared. ``--library`` loads another build of the native
library (``torch.ops.load_library``) in place of this checkout's, to compare
builds in turn. Used for docs/benchmarks.md, "Q6_K lanes blocks on AVX-512 VNNI",
and docs/performance.md's "Q6_K lanes blocks".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from trioserve.engine.kernels import native
from trioserve.engine.kernels.q6k_lanes import BLOCK, SUPER, Q6KLanes
from trioserve.engine.kernels.q8_lanes import Q8Lanes
from trioserve.engine.kernels.rtn import Int8GroupWeight



def q6k_blocks(out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[out, k]`` random Q6_K rows (``[out, k / 256 * 210]`` uint8), d in [1e-3, 4e-3]."""
    data = rng.integers(0, 256, size=(out, k // SUPER, BLOCK), dtype=np.uint8)
    d = rng.uniform(1e-3, 4e-3, size=(out, k // SUPER)).astype(np.float16)
    data[..., 208:210] = d.view(np.uint8).reshape(out, k // SUPER, 2)
    return data.reshape(out, -1)


def matrices(out: int, k: int, ops: object, seed: int) -> tuple[Q6KLanes, Q8Lanes]:
    rng = np.random.default_rng(seed)
    q = torch.from_numpy(rng.integers(-127, 128, size=(out, k), dtype=np.int8))
    scale = torch.from_numpy(rng.uniform(1e-3, 4e-3, size=(out, k // 32)).astype(np.float32))
    return Q6KLanes.of(q6k_blocks(out, k, rng), ops), Q8Lanes.of(Int8GroupWeight(q, scale, 32), ops)


def q8_call(ops: object, table: Q8Lanes, isa: int):
    empty = torch.empty(0)
    return lambda x: ops.q8g_linear(x, table.blocks, empty, isa)  # type: ignore[attr-defined]


def q6_call(ops: object, lanes: Q6KLanes, isa: int):
    return lambda x: ops.q6k_linear(x, lanes.lanes, lanes.d, isa)  # type: ignore[attr-defined]


def best_call(call, x: torch.Tensor, calls: int) -> float:
    """The shortest of ``calls`` calls, in seconds."""
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        call(x)
        best = min(best, time.perf_counter() - start)
    return best


def in_cache(ops: object, isa: int, shape: tuple[int, int], calls: int, row_counts: list[int]) -> dict[str, object]:
    torch.set_num_threads(1)
    out, k = shape
    lanes, table = matrices(out, k, ops, 0)
    per_m = 1e6 / (out * k)  # a call's seconds to microseconds a 1M weights
    result: dict[str, object] = {"shape": [out, k], "threads": 1, "calls": calls}
    for rows in row_counts:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        q8, q6 = q8_call(ops, table, isa), q6_call(ops, lanes, isa)
        times = {"q8": float("inf"), "q6k": float("inf")}
        for _ in range(4):  # the two in turn, so a busy spell lands on both
            times["q8"] = min(times["q8"], best_call(q8, x, calls // 4))
            times["q6k"] = min(times["q6k"], best_call(q6, x, calls // 4))
        q8_us, q6_us = times["q8"] * 1e6 * per_m, times["q6k"] * 1e6 * per_m
        result[f"rows{rows}"] = {"q8_us_per_M": round(q8_us, 2), "q6k_us_per_M": round(q6_us, 2),
                                 "q6k_over_q8": round(q6_us / q8_us, 3)}  # fmt: skip
    return result


def from_memory(
    ops: object, isa: int, shape: tuple[int, int], copies: int, threads: int, passes: int, row_counts: list[int]
) -> dict[str, object]:
    torch.set_num_threads(threads)
    out, k = shape
    made = [matrices(out, k, ops, 10 + i) for i in range(copies)]
    result: dict[str, object] = {"shape": [out, k], "copies": copies, "threads": threads, "passes": passes}
    for rows in row_counts:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        q8 = [q8_call(ops, table, isa) for _, table in made]
        q6 = [q6_call(ops, lanes, isa) for lanes, _ in made]
        times: dict[str, list[float]] = {"q8": [], "q6k": []}
        for _ in range(passes):  # the two in turn, so a busy spell lands on both
            for name, calls in (("q8", q8), ("q6k", q6)):
                start = time.perf_counter()
                for call in calls:
                    call(x)
                times[name].append((time.perf_counter() - start) / copies)
        best = {name: min(t) for name, t in times.items()}
        median = {name: statistics.median(t) for name, t in times.items()}
        q8_bytes, q6_bytes = made[0][1].blocks.numel(), made[0][0].nbytes
        result[f"rows{rows}"] = {
            "q8_us": round(best["q8"] * 1e6, 1), "q8_median_us": round(median["q8"] * 1e6, 1),
            "q8_GBps": round(q8_bytes / best["q8"] / 1e9, 1),
            "q6k_us": round(best["q6k"] * 1e6, 1), "q6k_median_us": round(median["q6k"] * 1e6, 1),
            "q6k_GBps": round(q6_bytes / best["q6k"] / 1e9, 1),
            "q6k_over_q8": round(best["q6k"] / best["q8"], 3),
        }  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", choices=("avx512vnni", "avx2int8"), default="avx512vnni", help="the variant both run on")
    parser.add_argument("--rows", type=int, nargs="+", help="row counts (default: 1 4 8 in cache, 1 4 from memory)")
    parser.add_argument("--library", help="a native library's .so to load instead of this checkout's build")
    parser.add_argument("--cache-shape", type=int, nargs=2, default=(256, 4096), metavar=("OUT", "IN"))
    parser.add_argument("--calls", type=int, default=400, help="in-cache calls a row count and format")
    parser.add_argument("--memory-shape", type=int, nargs=2, default=(2048, 8192), metavar=("OUT", "IN"))
    parser.add_argument("--copies", type=int, default=8, help="matrices cycled from memory")
    parser.add_argument("--threads", type=int, default=2, help="threads from memory")
    parser.add_argument("--passes", type=int, default=10, help="passes over the copies from memory")
    parser.add_argument("--skip-memory", action="store_true", help="only the in-cache figures")
    args = parser.parse_args(argv)
    if args.library:
        torch.ops.load_library(args.library)
        ops = torch.ops.trioserve
    else:
        ops = native.ops()
    isa = native.ISAS[args.isa]
    cached = in_cache(ops, isa, tuple(args.cache_shape), args.calls, args.rows or [1, 4, 8])
    print(json.dumps({"isa": args.isa, "in_cache": cached, "load": os.getloadavg()}))
    if not args.skip_memory:
        got = from_memory(ops, isa, tuple(args.memory_shape), args.copies, args.threads, args.passes, args.rows or [1, 4])
        print(json.dumps({"isa": args.isa, "from_memory": got, "load": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
