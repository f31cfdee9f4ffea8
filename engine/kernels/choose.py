"""Which compressed-weight kernel a model runs: a rule, not a measurement.

Each kernel (``KERNELS``) is a capability path with a trial
(``capability.PROBES``), so ``TRIOSERVE_CPU_ASSUME`` and the library caps
turn it off like any other path. A trial is a correctness check (the
kernel on seeded inputs, compared with float32 within a tolerance), never
a timing: a busy machine passes the same trials as an idle one. ``choose_kernel`` takes the first that
works here and stores the scheme asked for (``RULE``): the choice is a pure
function of the CPU's features, the shapes and the flags, so two starts of
a server on one machine compute the same bits (issue 39; the load-time
timing it replaced could pick differently from one start to the next;
trioserve bench kernels compares the kernels' speed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from trioserve.engine.kernels.capability import CpuPaths
from trioserve.engine.errors import CpuCapabilityError
from trioserve.engine.kernels import int4_native
from trioserve.engine.kernels import int4_pack
from trioserve.engine.kernels import int8_native
from trioserve.engine.kernels import int8_pack
from trioserve.engine.kernels import native
from trioserve.engine.kernels.rtn import Int4Weight, Int8Weight, quantize_int4, quantize_int8

Linear = Callable[[torch.Tensor], torch.Tensor]
# The schemes a user asks for: "int8" and "int4" quantize float checkpoints;
# "auto" keeps a GGUF's own bits (4-bit tensors stay 4-bit where a 4-bit
# kernel is the fastest here, else become int8 per channel).
SCHEMES = ("int8", "int4", "auto")
# How ``choose_kernel`` picks, in words (the load log and /version show it):
# KERNELS' order, the first that works here and stores the scheme's bits.
RULE = (
    "the first that works here of: native 4-bit, native int8, ATen 4-bit, ATen int8; "
    "in batch-invariant mode only native variants whose rows get the same bits at every row count"
)
# The native variants whose kernels give a row the same bits whatever rows
# share the call (csrc/kernels.h's header: int8 activations for weights in
# groups of 32 at every row count, the row kernels with the panels' bits);
# the others switch to panels of another arithmetic from 10 rows. In
# batch-invariant mode the 4-bit family takes only these (an AVX-512 CPU
# without VNNI and BF16 runs avx2int8).
ROW_INVARIANT_ISAS = frozenset({"avx512vnni", "avx2int8", "scalar"})
# On AMX, outside batch-invariant mode: a prompt's 4-bit calls from this
# many rows run the bfloat16 GEMM (measured faster from 16 rows on an AMX
# Xeon: docs/benchmarks.md).
BF16_GEMM_FROM_ROWS = 16


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
# trioserve bench kernels, not chosen.
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
        activations = "int8 activations; bfloat16 products in prompts from 10 rows with --no-batch-invariant"
    elif bits == 4 and isa == "avx2int8":
        activations = "int8 activations; int16 in prompts from 10 rows with --no-batch-invariant"
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
    """The kernel a model runs (every row count on the one kernel) and, on
    AMX machines outside batch-invariant mode, from how many rows a
    prompt's 4-bit calls run torch's bfloat16 GEMM instead (``gemm_from_rows``)."""

    kernel: Kernel
    scheme: str
    group_size: int
    gemm_from_rows: int | None = None

    @property
    def label(self) -> str:
        """The format the weights are held in, e.g. ``int8`` or ``int4``."""
        return f"int{self.kernel.bits}"

    def make(self, weight: torch.Tensor | Int8Weight | Int4Weight, bias: torch.Tensor | None) -> Linear:
        """The linear for ``weight`` on this choice's kernel."""
        linear = self.kernel.make(weight, bias, self.group_size)
        if self.gemm_from_rows is not None and isinstance(linear, int4_native.Int4NativeLinear):
            linear = attrs.evolve(linear, gemm_from_rows=self.gemm_from_rows)
        return linear

    @property
    def reason(self) -> str:
        gemm = (
            f"; torch's bfloat16 GEMM from {self.gemm_from_rows} rows in prompts (AMX)"
            if self.gemm_from_rows is not None
            else ""
        )
        return f"{self.kernel.what}{gemm} (chosen by rule: {RULE})"


def candidates(cpu_paths: CpuPaths, scheme: str, *, batch_invariant: bool = False) -> list[Kernel]:
    """The kernels that work here and fit ``scheme``, in ``RULE``'s order
    (with ``batch_invariant``, the native 4-bit variants of
    ``ROW_INVARIANT_ISAS`` only); ``CpuCapabilityError`` listing what the
    machine runs when there are none."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization {scheme!r} is not one of {', '.join(SCHEMES)}")
    known = {p.name for p in cpu_paths.paths}
    usable = [
        k
        for k in KERNELS
        if cpu_paths.works(k.name) and not (batch_invariant and k.family == "native4" and k.isa not in ROW_INVARIANT_ISAS)
    ]
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


# The native 4-bit variants whose prompts run bfloat16 panels, which the
# bfloat16 GEMM may replace (outside batch-invariant mode).
_BF16_PANEL_ISAS = ("avx512bf16", "avx512vnni")


def choose_kernel(
    cpu_paths: CpuPaths,
    scheme: str,
    shapes: Sequence[tuple[int, int]],
    group_size: int = 32,
    *,
    batch_invariant: bool = True,
) -> KernelChoice:
    """The kernel for ``scheme`` over one layer's ``shapes`` (``[(out, in),
    ...]``): a pure function of what this CPU runs (``cpu_paths``), the
    shapes and the flags, never of a timing, so two starts on one machine
    compute the same bits (``RULE``)."""
    fits = candidates(cpu_paths, scheme, batch_invariant=batch_invariant)
    if scheme == "auto" and any(k % group_size for _, k in shapes):
        # Groups that do not tile the inputs: only the per-channel kernels fit.
        fits = [k for k in fits if k.bits == 8] or fits
    kernel = fits[0]
    gemm_from_rows = None
    if (
        not batch_invariant
        and kernel.family == "native4"
        and kernel.isa in _BF16_PANEL_ISAS
        and group_size % int4_native.GROUP == 0
        and cpu_paths.works(int4_native.BF16_GEMM_PATH)
    ):
        gemm_from_rows = BF16_GEMM_FROM_ROWS
    return KernelChoice(kernel, scheme, group_size, gemm_from_rows)
