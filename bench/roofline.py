"""The roofline of ``trioserve bench real-size``: what this machine can do
at best (memory read bandwidth, GEMM peaks), what that makes the fastest
possible serving of a model, and how close each engine came.

One stream reads every weight once a token, so its floor is bytes over
bandwidth: each tensor counted at the width it is stored in the GGUF file,
only the routed experts' share of a mixture, the embedding table whole only
where it is also the LM head (tied), and the KV cache of the mean context.
A decode step of N streams reads the weights once and does N tokens'
arithmetic: it takes at least the longer of the bytes over bandwidth and the
FLOPs over the GEMM peak at that many rows. A mixture's step reads each
expert that any of its N tokens routes to, once (``experts_read``): at 32
streams of 8 experts in 64 nearly all of them, so its floor there is set by
total parameters, not active ones. The highest throughput of N streams adds
the prompts' prefill at the peak of 512 rows.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
import torch

from .real_size import Shape

PEAK_ROWS = (32, 512)
GEMM_K, GEMM_N = 2048, 8192  # one MLP projection of the 1B shape
GEMM_DTYPES = ("bf16", "int8", "int8-trioserve")


@attrs.frozen
class TensorBytes:
    """One tensor of a GGUF file: llama.cpp's name, elements, stored bytes."""

    name: str
    elements: int
    nbytes: int


def read_gguf_tensors(path: str | Path) -> list[TensorBytes]:
    """Every tensor of a GGUF file, at its stored width."""
    from gguf import GGUFReader

    return [TensorBytes(t.name, int(t.n_elements), int(t.n_bytes)) for t in GGUFReader(str(path)).tensors]


def weight_bytes_per_token(tensors: Iterable[TensorBytes], shape: Shape) -> float:
    """Weight bytes one stream reads per token: every tensor at its stored
    width, a mixture's expert tensors (``*_exps``) for the routed experts
    only, and the embedding table whole only when it is the LM head too (no
    ``output.weight``), else one row."""
    tensors = list(tensors)
    tied = not any(t.name == "output.weight" for t in tensors)
    total = 0.0
    for t in tensors:
        if t.name == "token_embd.weight":
            total += t.nbytes if tied else t.nbytes / shape.vocab
        elif "_exps." in t.name:
            total += t.nbytes * shape.experts_per_token / shape.experts
        else:
            total += t.nbytes
    return total


def expert_bytes(tensors: Iterable[TensorBytes]) -> float:
    """Bytes of a mixture's expert tensors (``*_exps``), every expert of every layer."""
    return float(sum(t.nbytes for t in tensors if "_exps." in t.name))


def experts_read(shape: Shape, tokens: int) -> float:
    """The expected share of a layer's experts that a step of ``tokens``
    tokens reads, each expert once for all the tokens routed to it: a token
    takes ``experts_per_token`` distinct experts of ``experts``, so it misses
    a given one with probability ``1 - k / E``; routings taken as independent
    and uniform (random weights' routers are). 1 for a dense shape."""
    if not shape.is_moe:
        return 1.0
    return 1.0 - (1.0 - shape.experts_per_token / shape.experts) ** tokens


def kv_bytes_per_token(shape: Shape, context: float, kv_bytes: float = 2.0) -> float:
    """KV cache bytes one stream reads per token at ``context`` tokens (f16: 2 bytes an element)."""
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * kv_bytes * context


def flops_per_token(shape: Shape, context: float) -> float:
    """Multiply-adds times two of one token: the projections it goes through
    (routed experts only, the router and the LM head included) and attention
    over ``context`` tokens (scores and values)."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = h * q + 2 * h * kv + q * h
    if shape.is_moe:
        mlp = h * shape.experts + shape.experts_per_token * 3 * h * shape.expert_intermediate
    else:
        mlp = 3 * h * shape.intermediate
    weights = shape.layers * (attention + mlp) + shape.vocab * h
    return 2.0 * weights + 4.0 * shape.layers * q * context


@attrs.frozen
class Machine:
    """Measured peaks: read bandwidth in bytes/s, and GEMM FLOP/s per dtype
    (``bf16``, ``int8``) and rows (32, 512)."""

    bandwidth: float
    peaks: Mapping[str, Mapping[int, float]]

    def peak(self, rows: int) -> float:
        """The best FLOP/s of any dtype at the measured row count nearest above ``rows``."""
        at = next((r for r in PEAK_ROWS if rows <= r), PEAK_ROWS[-1])
        return max(by_rows[at] for by_rows in self.peaks.values())

    def best(self, other: Machine) -> Machine:
        """Each figure's higher value of two measurements: a peak is what the
        machine can do, and a busier moment only hides it."""
        peaks = {d: {r: max(v, other.peaks.get(d, {}).get(r, 0.0)) for r, v in p.items()} for d, p in self.peaks.items()}
        extra = {d: dict(p) for d, p in other.peaks.items() if d not in peaks}
        return Machine(max(self.bandwidth, other.bandwidth), {**peaks, **extra})

    def to_json(self) -> dict:
        return {"bandwidth": self.bandwidth, "peaks": {d: {str(r): v for r, v in p.items()} for d, p in self.peaks.items()}}

    @classmethod
    def from_json(cls, data: Mapping) -> Machine:
        return cls(data["bandwidth"], {d: {int(r): v for r, v in p.items()} for d, p in data["peaks"].items()})


@attrs.frozen
class Floors:
    """The best a server could do on this machine: one stream's time per
    output token, and ``streams`` streams' output throughput."""

    weight_bytes: float
    tpot_s: float
    streams: int
    throughput: float
    bound: str  # what limits the decode step of ``streams``: "bandwidth" or "compute"
    expert_bytes: float = 0.0  # a mixture's experts, all of them (``expert_bytes``)
    step_weight_bytes: float | None = None  # weight bytes a step of ``streams`` reads


def step_weight_bytes(shape: Shape, weight_bytes: float, all_expert_bytes: float, tokens: int) -> float:
    """Weight bytes a decode step of ``tokens`` reads: one token's
    ``weight_bytes`` (``weight_bytes_per_token``) with its routed share of
    ``all_expert_bytes`` replaced by the share the step's tokens route to
    (``experts_read``)."""
    one = experts_read(shape, 1)
    return weight_bytes + all_expert_bytes * (experts_read(shape, tokens) - one) if shape.is_moe else weight_bytes


def floors(machine: Machine, shape: Shape, weight_bytes: float, *, input_len: int, output_len: int,
           streams: int, all_expert_bytes: float = 0.0) -> Floors:  # fmt: skip
    """The floors of serving ``shape`` (``weight_bytes`` a token, from
    ``weight_bytes_per_token``; a mixture's experts ``all_expert_bytes`` in
    all, from ``expert_bytes``) with prompts of ``input_len`` and
    ``output_len`` tokens out, at one stream and at ``streams``."""
    context = input_len + output_len / 2  # the mean over the decode steps

    def step(n: int) -> tuple[float, str]:
        weights = step_weight_bytes(shape, weight_bytes, all_expert_bytes, n)
        reading = (weights + n * kv_bytes_per_token(shape, context)) / machine.bandwidth
        computing = n * flops_per_token(shape, context) / machine.peak(n)
        return max(reading, computing), "bandwidth" if reading >= computing else "compute"

    one, _ = step(1)
    many, bound = step(streams)
    prefill = streams * input_len * flops_per_token(shape, input_len / 2) / machine.peak(streams * input_len)
    throughput = streams * output_len / (prefill + output_len * many)
    step_bytes = step_weight_bytes(shape, weight_bytes, all_expert_bytes, streams)
    return Floors(weight_bytes, one, streams, throughput, bound, all_expert_bytes, step_bytes)


def _best_seconds(work, repeats: int) -> float:
    work()  # warm: pages touched, kernels chosen
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(threads: int, *, nbytes: int = 2**30, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of ``repeats`` sums of a float32
    buffer of ``nbytes`` (far past the caches) on ``threads`` threads."""
    torch.set_num_threads(threads)
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    return buffer.numel() * 4 / _best_seconds(lambda: buffer.sum(), repeats)


def measure_gemm(dtype: str, rows: int, threads: int, *, repeats: int = 5, isa: str | None = None) -> float:
    """FLOP/s of one [rows, 2048] x [2048, 8192] product on ``threads``
    threads: torch's bfloat16 linear (``bf16``), torch's int8 matmul
    (``torch._int_mm``, int32 sums: ``int8``), or trioserve's native int8
    kernel (``int8-trioserve``: per-channel int8 weights, float32
    activations quantized inside, as the engine runs it) on variant ``isa``,
    by default this CPU's best (``NativeUnavailable`` where the kernels are
    not built)."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    if dtype == "int8-trioserve":
        from trioserve.engine.kernels import int8_native, native, rtn

        isa = native.cpu_isas()[-1] if isa is None else isa
        w = torch.randn(GEMM_N, GEMM_K, generator=generator) * 0.05
        linear = int8_native.Int8NativeLinear.from_rtn(rtn.quantize_int8(w), None, isa)
        x = torch.randn(rows, GEMM_K, generator=generator)
        with torch.inference_mode():
            seconds = _best_seconds(lambda: linear(x), repeats)
    elif dtype == "bf16":
        a = torch.randn(rows, GEMM_K, generator=generator).to(torch.bfloat16)
        w = torch.randn(GEMM_N, GEMM_K, generator=generator).to(torch.bfloat16)
        seconds = _best_seconds(lambda: torch.nn.functional.linear(a, w), repeats)
    elif dtype == "int8":
        a = torch.randint(-127, 128, (rows, GEMM_K), generator=generator, dtype=torch.int8)
        b = torch.randint(-127, 128, (GEMM_K, GEMM_N), generator=generator, dtype=torch.int8)
        seconds = _best_seconds(lambda: torch._int_mm(a, b), repeats)
    else:
        raise ValueError(f"dtype must be bf16, int8 or int8-trioserve, got {dtype!r}")
    return 2.0 * rows * GEMM_K * GEMM_N / seconds


def measure_machine(threads: int) -> Machine:
    """This machine's bandwidth and GEMM peaks on ``threads`` threads (a few
    seconds); trioserve's native int8 kernel only where it is built."""
    from trioserve.engine.kernels.native import NativeUnavailable

    peaks = {}
    for dtype in GEMM_DTYPES:
        try:
            peaks[dtype] = {rows: measure_gemm(dtype, rows, threads) for rows in PEAK_ROWS}
        except NativeUnavailable as exc:
            print(f"roofline: no {dtype} peak: {exc}", file=sys.stderr)
    return Machine(measure_bandwidth(threads), peaks)
