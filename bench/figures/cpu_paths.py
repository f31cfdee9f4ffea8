"""``trioserve bench cpu-paths``: one decoder layer's projections on each
CPU path this machine runs.

For SmolLM2-135M's shapes (q/k/v, o, gate/up, down) and a batch of decode
rows, every path ``CpuPaths.from_environment()`` finds available: packed
(oneDNN) and plain (``F.linear``) in float32 and bfloat16. The best of many
repetitions is reported, so other load on the machine inflates it least.
Run it with the AVX2 caps (docs/architecture.md, "CPU paths") to see what
an AVX2-only CPU gets:

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        trioserve bench cpu-paths --rows 64
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from trioserve.engine.kernels import onednn
from trioserve.engine.kernels.capability import CpuPaths, packed_path

from ..arguments import positive_float, positive_int

# SmolLM2-135M: hidden 576, 9 heads and 3 KV heads of 64, intermediate 1536.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "cpu-paths",
        help="one layer's projections on each float CPU path: packed or plain, float32 or bfloat16",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench cpu-paths``: "),
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    work = p.add_argument_group("workload")
    work.add_argument("--rows", type=positive_int, default=64, help="decode rows in the batch (default: 64)")
    work.add_argument("--seconds", type=positive_float, default=5.0, help="time per path (default: 5)")
    work.add_argument("--threads", type=positive_int, default=2, help="torch threads (default: 2)")
    p.set_defaults(func=run)
    return p


def layer_call(dtype: torch.dtype, packed: bool, rows: int):
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]
    inputs = [torch.randn(rows, shape[1], generator=gen).to(dtype) for shape in SHAPES]
    if packed:
        weights = [onednn.pack(w) for w in weights]
        return lambda: [onednn.linear(x, w, None, "none") for x, w in zip(inputs, weights)]
    return lambda: [F.linear(x, w) for x, w in zip(inputs, weights)]


def best_time(call, seconds: float) -> float:
    best = float("inf")
    end = time.perf_counter() + seconds
    with torch.inference_mode():
        call()  # warm up: oneDNN builds its primitives on first use
        while time.perf_counter() < end:
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
    return best


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    paths = CpuPaths.from_environment()
    print(paths.describe()[0])
    flops = 2 * args.rows * sum(out * inp for out, inp in SHAPES)
    for dtype in (torch.float32, torch.bfloat16):
        for packed in (True, False):
            label = f"{str(dtype).removeprefix('torch.')} {'packed' if packed else 'plain'}"
            if packed and not paths.available(packed_path(dtype)):
                print(f"{label:16s} unavailable: {paths.status(packed_path(dtype)).reason}")
                continue
            seconds = best_time(layer_call(dtype, packed, args.rows), args.seconds)
            print(f"{label:16s} {seconds * 1e3:8.2f} ms per layer  {flops / seconds / 1e9:7.1f} GFLOP/s")
    return 0
