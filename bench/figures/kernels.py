"""``trioserve bench kernels``: every linear kernel the engine could run for
SmolLM2-135M's matmuls, timed side by side.

One "forward" is all the projections of the 30 layers plus the LM head at M
rows (M=1 is a one-stream decode step, 32 or 64 a batched one): float32
(``F.linear``, oneDNN packed), torch's int8 and int4 packed kernels, and the
native kernels where scripts/setup.sh built them, each ISA variant this CPU
runs. They run in a worker thread with ``--threads`` torch threads, as the
engine's step thread runs them. Prints a Markdown table of the best of
``--repeat`` forwards, in ms.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.nn.functional as F

from trioserve.engine.kernels import int4_native, int4_pack, int8_dynamic, int8_native, int8_pack, native, onednn, rtn

from ..arguments import int_list, positive_int


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "kernels",
        help="every linear kernel the engine could run, on SmolLM2-135M's matmuls",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench kernels``: "),
    )
    work = p.add_argument_group("workload")
    work.add_argument("--rows", type=int_list, default=[1, 32, 64], help="rows M of a forward, comma-separated (default: 1,32,64)")
    work.add_argument("--repeat", type=positive_int, default=5, help="forwards timed, the best kept (default: 5)")
    work.add_argument("--slow-limit", type=float, default=1.0,
                      help="skip a kernel's larger M once a forward takes this many s (default: 1)")  # fmt: skip
    work.add_argument("--threads", type=positive_int, default=2, help="torch threads (default: 2)")
    p.set_defaults(func=run)
    return p


# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads and 3 KV heads of 64.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LM_HEAD = (49152, 576)
LAYERS = 30


def kernels(weights: list[torch.Tensor]) -> dict[str, list]:
    """Each kernel's name -> one callable per weight, ``f(x) -> y``."""
    out: dict[str, list] = {"float32 F.linear": [lambda x, w=w: F.linear(x, w) for w in weights]}
    if torch.backends.mkldnn.is_available():
        packed = [onednn.pack(w) for w in weights]
        out["oneDNN packed float32 (today)"] = [lambda x, p=p: onednn.linear(x, p, None, "none") for p in packed]
    for engine in ("fbgemm", "onednn", "x86"):
        if engine not in torch.backends.quantized.supported_engines:
            continue
        torch.backends.quantized.engine = engine
        try:
            layers = [int8_dynamic.Int8DynamicLinear.from_rtn(rtn.quantize_int8(w)) for w in weights]
            layers[0](torch.zeros(1, weights[0].shape[1]))
        except RuntimeError as exc:
            print(f"{engine} linear_dynamic: {exc}")
            continue
        out[f"{engine} quantized.linear_dynamic int8/channel"] = layers
    torch.backends.quantized.engine = "fbgemm" if "fbgemm" in torch.backends.quantized.supported_engines else "x86"
    for act in (torch.bfloat16, torch.float32):
        tag = "bfloat16" if act == torch.bfloat16 else "float32"
        out[f"_weight_int8pack_mm int8/channel, {tag} activations"] = [
            int8_pack.Int8PackLinear.from_rtn(rtn.quantize_int8(w), act_dtype=act) for w in weights
        ]
        out[f"_weight_int4pack_mm_for_cpu group 32, {tag} activations"] = [
            int4_pack.Int4PackLinear.from_rtn(rtn.quantize_int4(w, 32), act_dtype=act) for w in weights
        ]
    try:
        isas = native.cpu_isas()
    except native.NativeUnavailable as exc:
        print(f"native kernels: {exc}")
        isas = ()
    for isa in reversed(isas):  # best first
        # avx512vnni rounds a 4-bit call's activations to int8 inside (csrc/kernels.h).
        acts = "int8" if isa == "avx512vnni" else "float32"
        out[f"native 4-bit group 32, {acts} activations ({isa})"] = [
            int4_native.Int4NativeLinear.from_rtn(rtn.quantize_int4(w, 32), None, isa) for w in weights
        ]
        out[f"native int8/channel, float32 activations ({isa})"] = [
            int8_native.Int8NativeLinear.from_rtn(rtn.quantize_int8(w), None, isa) for w in weights
        ]
    return out


def measure(args: argparse.Namespace, result: dict[str, dict[int, float]]) -> None:
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen) * 0.05 for s in LAYER_SHAPES + [LM_HEAD]]
    with torch.inference_mode():
        for name, fns in kernels(weights).items():
            result[name] = {}
            for rows in args.rows:
                xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
                calls = [(f, xs[w.shape[1]]) for f, w in zip(fns, weights)]

                def once() -> float:
                    t = time.perf_counter()
                    for _ in range(LAYERS):
                        for f, x in calls[:-1]:
                            f(x)
                    calls[-1][0](calls[-1][1])
                    return time.perf_counter() - t

                first = once()  # kernel creation, caches
                best = min([first] + [once() for _ in range(args.repeat if first < 1 else 1)])
                result[name][rows] = best * 1e3
                if best > args.slow_limit:
                    break


def run(args: argparse.Namespace) -> int:
    result: dict[str, dict[int, float]] = {}
    thread = threading.Thread(target=measure, args=(args, result))
    thread.start()
    thread.join()
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    print("| kernel | " + " | ".join(f"M={r}" for r in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name, by_rows in result.items():
        cells = [f"{by_rows[r]:,.1f} ms" if r in by_rows else "" for r in args.rows]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0
