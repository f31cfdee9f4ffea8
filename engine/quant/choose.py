"""Which compressed-weight kernel a model runs, by capability and a measurement.

Each kernel (``KERNELS``) is a capability path with a trial
(``capability.PROBES``), so ``TRIOSERVE_CPU_ASSUME`` and the library caps
turn it off like any other path. Among those that work here and store the
scheme asked for (4 or 8 bits), ``choose_kernel`` times one decoder layer's
projections at 1 row (a one-stream decode step) and at 32 rows (a batched
one) on random weights, a few milliseconds in all, and keeps the fastest
sum. Which one wins depends on the CPU (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import torch

from ..capability import CpuPaths
from ..errors import CpuCapabilityError
from . import int4_native, int4_pack, int8_native, int8_pack, native
from .row_split import RowSplitLinear
from .rtn import Int4Weight, Int8Weight, quantize_int4, quantize_int8

Linear = Callable[[torch.Tensor], torch.Tensor]
# The schemes a user asks for: "int8" and "int4" quantize float checkpoints;
# "auto" keeps a GGUF's own bits (4-bit tensors stay 4-bit where a 4-bit
# kernel is the fastest here, else become int8 per channel).
SCHEMES = ("int8", "int4", "auto")
# Rows a kernel is timed at: a one-stream decode step, small and larger batches.
MEASURE_ROWS = (1, 4, 16, 32)
# A 4-bit kernel within this factor of the fastest is taken instead: it keeps
# a 4-bit file's own values (int8 would round them once more) in 0.625 of
# int8's bytes (20 bytes a group of 32 against 32), and the factor is that
# ratio: streaming every layer's weights, a step's time follows the bytes.
# Measured (docs/benchmarks.md, "Native kernels"): the native
# int8 kernel timed 8-12% faster than the 4-bit one on one layer at one row,
# so "auto" held int8 for few rows and 4-bit for many, both copies, and the
# server ran one stream at 15.6 ms a token in 966 MiB against 13.5 ms in 845
# MiB on the 4-bit kernel alone: the layer's timing, its weights warm in the
# cache, does not see what streaming all of them costs. With float16 block
# scales the one-layer timing put 4-bit at 1.29x int8 at one row, past the
# former 1.25, and the server again held both copies: 15.9 ms a token in 896
# MiB.
FOUR_BIT_TIE = 1.6
# For the most rows timed, a native kernel within this factor of a faster
# ATen one is taken instead: the one-layer timing calls a linear alone,
# while a native kernel also lets the fused decode step (native_decode) run
# every layer of a batch in one call, which it does only where every
# projection runs natively. On an AMX Xeon the two measured within 2% of
# each other at 32 rows, either way round from one start to the next (2
# starts of 6 took ATen's above 4 rows), and that split ran the default
# model's 32-row decode step in 84-86 ms against 33 (docs/benchmarks.md,
# "K-quant files").
NATIVE_TIE = 1.5


@attrs.frozen
class Kernel:
    """A linear kernel over one compressed format; ``build(weight, bias)``
    makes a callable linear from an ``Int8Weight`` or ``Int4Weight``."""

    name: str
    bits: int
    what: str
    build: Callable[[Int8Weight | Int4Weight, torch.Tensor | None], Linear]
    # Kernels of one family are one kernel compiled for several ISAs, best
    # first: only the best that works here is a candidate.
    family: str = ""
    isa: str = ""  # a native kernel's variant (native.ISAS)

    def make(self, weight: torch.Tensor | Int8Weight | Int4Weight, bias: torch.Tensor | None, group_size: int) -> Linear:
        """The linear for ``weight``: taken as it is when in this kernel's
        format, else requantized into it (one more rounding)."""
        want = Int4Weight if self.bits == 4 else Int8Weight
        if not isinstance(weight, want):
            dense = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
            weight = quantize_int4(dense, group_size) if self.bits == 4 else quantize_int8(dense)
        return self.build(weight, bias)


# fbgemm's int8 dynamic linear (int8_dynamic.py) is the fastest from a few
# rows up, but it rounds each call's activations to 7 bits with one scale
# for the whole call, and the default model's perplexity went from 23.2 to
# 38.6 with it (docs/benchmarks.md): it is measured by
# scripts/bench_qlinear.py, not chosen.
def _native(bits: int, isa: str, what: str) -> Kernel:
    linear = int4_native.Int4NativeLinear if bits == 4 else int8_native.Int8NativeLinear
    # avx512vnni rounds a 4-bit call's activations to int8 below 10 rows and
    # in decode steps at any batch size (csrc/panel_vnni.h's panels at every
    # row count; int4_native.call_isa); its kernels of int8 per
    # channel run as avx512bf16's. avx2int8 does the same on AVX2
    # (csrc/lanes_avx2.h, csrc/panel_avx2.h, csrc/rows_avx2.h), its other
    # kernels running as avx2's.
    # Called from the model's layers (a prompt), the VNNI variant's run
    # bfloat16 panels from 10 rows, avx2int8's avx2's: 4-bit panels on
    # activations rounded to int16 in groups of 32 (csrc/panel_avx2_int16.h).
    if bits == 4 and isa == "avx512vnni":
        activations = "int8 activations in decode steps, bfloat16 products in prompts from 10 rows"
    elif bits == 4 and isa == "avx2int8":
        activations = "int8 activations in decode steps, int16 in prompts from 10 rows"
    elif bits == 4 and isa == "avx2":
        activations = "float32 activations, int16 from 10 rows"
    elif isa in ("avx512bf16", "avx512vnni"):
        activations = "float32 activations, bfloat16 products from 10 rows"
    else:
        activations = "float32 activations"
    return Kernel(
        f"quant_int{bits}_native_{isa}",
        bits,
        f"{what}, native kernel ({isa}, {activations})",
        lambda w, b: linear.from_rtn(w, b, isa),  # type: ignore[arg-type]
        family=f"native{bits}",
        isa=isa,
    )


KERNELS: tuple[Kernel, ...] = (
    # Ours (csrc/), where scripts/setup.sh built them; the capability probes
    # fail with the reason where not, and the chooser takes ATen's.
    *(_native(4, isa, "4-bit groups") for isa in native.LINEAR_ISA_ORDER),
    *(_native(8, isa, "int8 per channel") for isa in native.LINEAR_ISA_ORDER),
    Kernel(
        "quant_int4_pack_bfloat16",
        4,
        "4-bit groups, _weight_int4pack_mm in bfloat16",
        lambda w, b: int4_pack.Int4PackLinear.from_rtn(w, b, torch.bfloat16),
    ),
    Kernel(
        "quant_int8_pack_bfloat16",
        8,
        "int8 per channel, _weight_int8pack_mm in bfloat16",
        lambda w, b: int8_pack.Int8PackLinear.from_rtn(w, b, torch.bfloat16),
    ),
)


@attrs.frozen
class KernelChoice:
    """The kernel a model runs and why: ``timings`` holds each candidate's
    milliseconds at ``MEASURE_ROWS``. With ``small``, calls of at most
    ``max_small_rows`` rows run on that kernel instead (``row_split``)."""

    kernel: Kernel
    scheme: str
    group_size: int
    timings: tuple[tuple[str, tuple[float, ...]], ...]
    small: Kernel | None = None
    max_small_rows: int = 0
    # Whether the native 4-bit kernel runs a prompt's rows on torch's
    # bfloat16 GEMM (AMX machines; measure_bf16_gemm), and why.
    bf16_gemm: int4_native.Bf16GemmChoice | None = None

    @property
    def label(self) -> str:
        """The formats the weights are held in, e.g. ``int8`` or ``int4+int8``."""
        if self.small is None:
            return f"int{self.kernel.bits}"
        return f"int{self.small.bits}+int{self.kernel.bits}"

    def make(self, weight: torch.Tensor | Int8Weight | Int4Weight, bias: torch.Tensor | None) -> Linear:
        """The linear for ``weight`` on this choice's kernel(s)."""
        large = self.kernel.make(weight, bias, self.group_size)
        if self.small is None:
            return large
        return RowSplitLinear(self.small.make(weight, bias, self.group_size), large, self.max_small_rows)

    @property
    def reason(self) -> str:
        shown = "; ".join(
            f"{name} {' / '.join(f'{ms:.2f}' for ms in times)} ms" for name, times in self.timings
        )
        rows = "/".join(str(r) for r in MEASURE_ROWS)
        what = self.kernel.what
        if self.small is not None:
            what = f"{self.small.what} up to {self.max_small_rows} rows, {what} above"
        gemm = f"; {self.bf16_gemm.reason}" if self.bf16_gemm is not None else ""
        return f"{what} (one layer at {rows} rows: {shown}){gemm}"


def candidates(cpu_paths: CpuPaths, scheme: str) -> list[Kernel]:
    """The kernels that work here and fit ``scheme``; ``CpuCapabilityError``
    listing what the machine runs when there are none."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization {scheme!r} is not one of {', '.join(SCHEMES)}")
    known = {p.name for p in cpu_paths.paths}
    usable = [k for k in KERNELS if cpu_paths.works(k.name)]
    best_of_family: dict[str, Kernel] = {}
    for k in usable:
        best_of_family.setdefault(k.family or k.name, k)
    usable = [k for k in usable if best_of_family[k.family or k.name] is k]
    fits = [k for k in usable if scheme == "auto" or k.bits == int(scheme.removeprefix("int"))]
    if not fits:
        runs = sorted({f"int{k.bits}" for k in usable})
        why = "; ".join(cpu_paths.status(k.name).reason for k in KERNELS if k.name in known)
        raise CpuCapabilityError(
            f"quantization {scheme} cannot run on this CPU ({why}); this machine runs "
            f"{', '.join(runs + ['none']) if runs else 'only none'}"
        )
    return fits


def measure(
    kernels: Sequence[Kernel],
    shapes: Sequence[tuple[int, int]],
    group_size: int,
    repeat: int = 5,
    rows_measured: Sequence[int] = MEASURE_ROWS,
) -> dict[str, tuple[float, ...]]:
    """Best-of-``repeat`` milliseconds of each kernel over ``shapes`` at each
    of ``rows_measured``. The kernels take turns within each round, so a
    burst of load from other processes hits them alike."""
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(out, k, generator=gen) * 0.05, k) for out, k in shapes]
    built = {kernel.name: [(kernel.make(w, None, group_size), k) for w, k in weights] for kernel in kernels}
    best: dict[str, list[float]] = {name: [] for name in built}
    with torch.inference_mode():
        for rows in rows_measured:
            xs = {k: torch.randn(rows, k, generator=gen) for _, k in weights}
            times = {name: float("inf") for name in built}
            for _ in range(repeat + 1):  # the first round builds caches
                for name, linears in built.items():
                    start = time.perf_counter()
                    for f, k in linears:
                        f(xs[k])
                    times[name] = min(times[name], time.perf_counter() - start)
            for name, t in times.items():
                best[name].append(t * 1e3)
    return {name: tuple(t) for name, t in best.items()}


# The native 4-bit variants whose prompts run bfloat16 panels, which the
# bfloat16 GEMM may replace.
_BF16_PANEL_ISAS = ("avx512bf16", "avx512vnni")


def _with_bf16_gemm(
    fits: list[Kernel], cpu_paths: CpuPaths, shapes: Sequence[tuple[int, int]], group_size: int
) -> tuple[list[Kernel], int4_native.Bf16GemmChoice | None]:
    """``fits`` with its native 4-bit kernel running a prompt's rows on the
    bfloat16 GEMM, where that path works here (AMX) and measures faster than
    the panels; with the measurement, when one was made. Before the
    kernels are timed against each other, so that choice sees it."""
    if group_size % int4_native.GROUP or not cpu_paths.works(int4_native.BF16_GEMM_PATH):
        return fits, None
    for i, kernel in enumerate(fits):
        if kernel.family == "native4" and kernel.isa in _BF16_PANEL_ISAS:
            measured = measure_bf16_gemm(kernel, shapes, group_size)
            if measured.from_rows is None:
                return fits, measured
            return [*fits[:i], _gemm_from(kernel, measured.from_rows), *fits[i + 1 :]], measured
    return fits, None


def _gemm_from(kernel: Kernel, rows: int) -> Kernel:
    """``kernel`` (native 4-bit) running calls of ``rows`` rows or more on the bfloat16 GEMM."""
    return attrs.evolve(
        kernel,
        what=f"{kernel.what}; torch's bfloat16 GEMM from {rows} rows in prompts",
        build=lambda w, b: attrs.evolve(kernel.build(w, b), gemm_from_rows=rows),
    )


def measure_bf16_gemm(
    kernel: Kernel, shapes: Sequence[tuple[int, int]], group_size: int
) -> int4_native.Bf16GemmChoice:
    """Time the native 4-bit ``kernel`` over one layer's ``shapes`` on its
    panels and on the bfloat16 GEMM at ``int4_native.BF16_GEMM_TRIAL_ROWS``
    (``measure``, best of 3); the GEMM runs from the rows
    ``int4_native.gemm_from_rows`` finds."""
    gemm = attrs.evolve(_gemm_from(kernel, 1), name=f"{kernel.name} on the bfloat16 GEMM")
    rows = int4_native.BF16_GEMM_TRIAL_ROWS
    timings = measure([kernel, gemm], shapes, group_size, repeat=3, rows_measured=rows)
    panels_ms, gemm_ms = timings[kernel.name], timings[gemm.name]
    return int4_native.Bf16GemmChoice(int4_native.gemm_from_rows(panels_ms, gemm_ms), panels_ms, gemm_ms)


def _fastest(kernels: Sequence[Kernel], cost: Callable[[Kernel], float]) -> Kernel:
    """The cheapest of ``kernels``, or a 4-bit one within ``FOUR_BIT_TIE`` of it."""
    best = min(kernels, key=cost)
    four_bit = [k for k in kernels if k.bits == 4]
    if four_bit and cost(min(four_bit, key=cost)) <= FOUR_BIT_TIE * cost(best):
        return min(four_bit, key=cost)
    return best


def _native_within_tie(fits: Sequence[Kernel], picked: Kernel, cost: Callable[[Kernel], float]) -> Kernel:
    """``picked``, or the fastest native kernel of ``fits`` by ``cost`` where
    ``picked`` is not native and that one costs at most NATIVE_TIE times it."""
    natives = [k for k in fits if k.family]
    if not natives or picked.family:
        return picked
    native = _fastest(natives, cost)
    return native if cost(native) <= NATIVE_TIE * cost(picked) else picked


def choose_kernel(
    cpu_paths: CpuPaths, scheme: str, shapes: Sequence[tuple[int, int]], group_size: int = 32
) -> KernelChoice:
    """The fastest kernel here for ``scheme`` over one layer's ``shapes``
    (``[(out, in), ...]``); a lone candidate is taken without timing."""
    fits = candidates(cpu_paths, scheme)
    if scheme == "auto" and any(k % group_size for _, k in shapes):
        # Groups that do not tile the inputs: only the per-channel kernels fit.
        fits = [k for k in fits if k.bits == 8] or fits
    fits, bf16_gemm = _with_bf16_gemm(fits, cpu_paths, shapes, group_size)
    timings = measure(fits, shapes, group_size) if len(fits) > 1 else {}
    best = _fastest(fits, lambda k: sum(timings.get(k.name, ())))
    choice = KernelChoice(best, scheme, group_size, tuple(timings.items()), bf16_gemm=bf16_gemm)
    if not timings:
        return choice
    if scheme != "auto":
        # One kernel for every row (int8 or int4 asked for): a native one
        # within NATIVE_TIE of a faster ATen one over the rows timed, for the
        # fused decode step it alone runs (below). On an AMX Xeon ATen's
        # 4-bit kernel summed 2.92 ms against the native one's 2.93, and
        # SmolLM2 from float safetensors quantized to int4 then decoded one
        # stream at 14.2-14.6 ms a step, against 6.2-7.1 on the native one.
        return attrs.evolve(choice, kernel=_native_within_tie(fits, best, lambda k: sum(timings[k.name])))
    # "auto" may hold the weights twice: the fastest kernel at one row for
    # the rows where it wins, the fastest at the most rows above that.
    by_rows = {rows: _fastest(fits, lambda k: timings[k.name][i]) for i, rows in enumerate(MEASURE_ROWS)}
    small, large = by_rows[MEASURE_ROWS[0]], by_rows[MEASURE_ROWS[-1]]
    large = _native_within_tie(fits, large, lambda k: timings[k.name][-1])
    # A native kernel runs every row: the fused decode step (native_decode)
    # takes a batch only where all its projections run natively, and at one
    # row that step saves more than the one-layer matmul differences timed
    # here (the server's one stream: 15.9 ms a token with ATen's 4-bit kernel
    # up to 4 rows and a second copy for the native one, 12.9 ms on the
    # native one alone; docs/benchmarks.md).
    if small is large or large.family:
        return attrs.evolve(choice, kernel=large)
    wins = [r for i, r in enumerate(MEASURE_ROWS) if timings[small.name][i] < timings[large.name][i]]
    if not wins:  # the 4-bit pick at one row (a tie) is nowhere faster: one copy
        return attrs.evolve(choice, kernel=large)
    return attrs.evolve(choice, kernel=large, small=small, max_small_rows=max(wins))
