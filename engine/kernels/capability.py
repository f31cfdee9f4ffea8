"""What this CPU and torch build can run, found by trying rather than assumed.

Some CPU paths depend on the machine, not only on the dtype: oneDNN's packed
bfloat16 weights need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, which an AMD
Zen 3 (AVX2 only) lacks, and an older torch build may have no float16 matmul
on CPU. ``CpuPaths.detect`` runs one tiny trial per path (``PROBES``; a few
milliseconds in all) and checks its result against float32; the model then
picks the path that works (``model.choose_projections``) and says why, and a
dtype whose matmul fails gets one ``CpuCapabilityError`` naming what the
machine supports. The trials are correctness checks, never timings, so
``from_environment`` keeps their results per machine and build in the
model cache (``trial_cache``) and a later start runs none.

``TRIOSERVE_CPU_ASSUME=avx2`` (or ``default``) turns off every path that
needs more than that level, as if the CPU lacked it, so a machine with
AVX-512 can prove the fallbacks. For the libraries to lack the feature too,
cap them as well before torch loads: ``ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``; the trials then
fail for real (``.ci/run`` does both). The switch only removes paths; it cannot add one the CPU lacks.

A kernel added later adds its ``Probe`` to ``PROBES``: a trial that runs it
on tiny inputs and returns its results with float32 references, and the
lowest level (``ISA_LEVELS``) it needs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F

from trioserve.engine.kernels import kv_dtype

from trioserve.engine.kernels import native_attention

from trioserve.engine.kernels import onednn
from trioserve.engine.errors import CpuCapabilityError
from trioserve.engine.kernels import int4_native as quant_int4_native
from trioserve.engine.kernels import native
from trioserve.engine.kernels import trial_cache
from trioserve.engine.kernels import int4_pack as quant_int4_pack
from trioserve.engine.kernels import int8_native as quant_int8_native
from trioserve.engine.kernels import int8_pack as quant_int8_pack

ASSUME_ENV = "TRIOSERVE_CPU_ASSUME"
# Lowest first; the names are ATEN_CPU_CAPABILITY's, avx512bf16 is AVX-512
# with AVX512_BF16 (the native linears' bfloat16 panels), avx512vnni that
# with AVX512_VNNI (the native linears' int8 activations for weights in
# groups of 32 in decode steps), and amx that with AMX-BF16 tiles (a prompt's
# 4-bit linears on torch's bfloat16 GEMM: engine/kernels/int4_native.py).
ISA_LEVELS = ("default", "avx2", "avx512", "avx512bf16", "avx512vnni", "amx")
# Variables that cap what torch's libraries use when set before torch loads:
# shown with the paths, since they change what the trials find.
LIBRARY_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
# What each LIBRARY_CAPS variable is set to, per level, to hold torch's
# libraries to it (oneDNN's, ATen's and MKL's own names for the level).
LIBRARY_CAP_VALUES = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
# The dtypes a CPU model may have: each runs where its matmul does.
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A result may differ from float32 by this fraction of the reference's
# largest magnitude (bfloat16 keeps 8 bits of mantissa).
TRIAL_TOLERANCE = 0.03

Checks = Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def packed_path(dtype: torch.dtype) -> str | None:
    """The name of the oneDNN packed-weights path for ``dtype``; None where the model never packs."""
    return f"onednn_packed_{dtype_name(dtype)}" if dtype in onednn.PACKED_DTYPES else None


def matmul_path(dtype: torch.dtype) -> str:
    """The name of the plain (``F.linear``) matmul path for ``dtype``."""
    return f"matmul_{dtype_name(dtype)}"


def parse_assume(value: str | None) -> str | None:
    """A ``TRIOSERVE_CPU_ASSUME`` value as a level of ``ISA_LEVELS`` (None or empty: unset)."""
    if not value:
        return None
    level = value.strip().lower()
    if level not in ISA_LEVELS:
        raise CpuCapabilityError(f"{ASSUME_ENV}={value!r} is not a CPU level; use one of {', '.join(ISA_LEVELS)}")
    return level


def held_environment(level: str) -> dict[str, str]:
    """The variables that hold a trioserve process started with them to
    ``level`` (a key of ``LIBRARY_CAP_VALUES``): ``TRIOSERVE_CPU_ASSUME``
    and the library caps, which must be set before torch loads, so they
    are for a child process's environment, not this one's."""
    if level not in LIBRARY_CAP_VALUES:
        raise ValueError(f"no library caps for level {level!r}; known: {', '.join(LIBRARY_CAP_VALUES)}")
    return {ASSUME_ENV: level, **LIBRARY_CAP_VALUES[level]}


@attrs.frozen
class Probe:
    """A capability-dependent CPU path and the trial that shows it works here.

    ``trial`` runs the path on tiny inputs and returns each result with its
    float32 reference; it raises where the path cannot run. ``needs`` is the
    lowest of ``ISA_LEVELS`` the path may need (``requirement`` says what,
    in words): ``TRIOSERVE_CPU_ASSUME`` below it turns the path off.
    """

    name: str
    what: str
    trial: Callable[[], Checks]
    needs: str = attrs.field(default="default", validator=attrs.validators.in_(ISA_LEVELS))
    requirement: str | None = None


@attrs.frozen
class PathStatus:
    """What the trial of one path found, and whether the switch turned it off."""

    name: str
    what: str
    trial_error: str | None  # None: the trial passed
    forced_by: str | None = None  # e.g. "TRIOSERVE_CPU_ASSUME=avx2"
    requirement: str | None = None

    @property
    def available(self) -> bool:
        return self.trial_error is None and self.forced_by is None

    @property
    def reason(self) -> str:
        """Why the path is or is not available, in one sentence."""
        if self.trial_error is not None:
            also = f"; also off by {self.forced_by}" if self.forced_by else ""
            return f"{self.what}: trial failed: {self.trial_error}{also}"
        if self.forced_by is not None:
            needs = f" (needs {self.requirement})" if self.requirement else ""
            return f"{self.what}: off by {self.forced_by}{needs}, though its trial passed"
        return f"{self.what}: trial passed"

    def as_json(self) -> dict[str, object]:
        return {"available": self.available, "forced": self.forced_by is not None, "reason": self.reason}


def _matmul_trial(dtype: torch.dtype) -> Checks:
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(4, 64, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    x, w, bias = x.to(dtype), w.to(dtype), bias.to(dtype)
    return {"F.linear": (F.linear(x, w, bias), F.linear(x.float(), w.float(), bias.float()))}


def _native_probes(
    name: str, what: str, trial: Callable[[str], Checks], order: Sequence[str] = native.ISA_ORDER
) -> tuple[Probe, ...]:
    """One probe per ISA variant of a native kernel; ``name`` and ``what`` take the ISA."""
    return tuple(
        Probe(
            name.format(isa),
            what.format(isa),
            functools.partial(trial, isa),
            needs=native.ISA_LEVEL.get(isa, isa),
            requirement=native.ISA_REQUIREMENTS[isa],
        )
        for isa in order
    )


PROBES: tuple[Probe, ...] = (
    Probe(
        packed_path(torch.float32),
        "oneDNN packed float32 weights",
        functools.partial(onednn.trial, torch.float32),
    ),
    Probe(
        packed_path(torch.bfloat16),
        "oneDNN packed bfloat16 weights",
        functools.partial(onednn.trial, torch.bfloat16),
        needs="avx512",
        requirement="AVX-512 BW/VL/DQ or AVX-NE-CONVERT",
    ),
    # Compressed-weight kernels (engine/kernels/choose.py picks the first in a fixed order whose trial passes).
    Probe("quant_int4_pack_bfloat16", "ATen 4-bit packed linear in bfloat16", functools.partial(quant_int4_pack.trial, torch.bfloat16)),
    Probe("quant_int8_pack_bfloat16", "ATen int8 packed linear in bfloat16", functools.partial(quant_int8_pack.trial, torch.bfloat16)),
    # Our native kernels (engine/kernels/native.py), one variant per ISA; their
    # trials also fail where scripts/setup.sh could not build them.
    *_native_probes("quant_int4_native_{}", "native 4-bit linear ({})", quant_int4_native.trial, native.LINEAR_ISA_ORDER),
    *_native_probes("quant_int8_native_{}", "native int8 linear ({})", quant_int8_native.trial, native.LINEAR_ISA_ORDER),
    Probe(
        quant_int4_native.BF16_GEMM_PATH,
        "a prompt's native 4-bit linears as torch's bfloat16 GEMM over the matrix dequantized per call",
        quant_int4_native.trial_bf16_gemm,
        needs="amx",
        requirement="AMX-BF16 tiles (with AVX512_BF16), which oneDNN's bfloat16 GEMM runs on",
    ),
    *_native_probes("native_attention_{}", "native decode attention ({})", native_attention.trial),
    # A KV cache narrower than the model (engine/kernels/kv_dtype_choice.py chooses among
    # them by a fixed rule and their correctness trials); each needs the level that
    # converts it in hardware.
    Probe(
        kv_dtype.kv_path(torch.bfloat16),
        "bfloat16 KV cache under a float32 model",
        functools.partial(kv_dtype.trial, torch.bfloat16),
        needs="avx512",
        requirement="AVX-512 BF16 or AVX-NE-CONVERT to convert bfloat16 in hardware",
    ),
    Probe(
        kv_dtype.kv_path(torch.float16),
        "float16 KV cache under a float32 model",
        functools.partial(kv_dtype.trial, torch.float16),
        needs="avx2",
        requirement="F16C, which comes with AVX2, to convert float16 in hardware",
    ),
    Probe(matmul_path(torch.float32), "float32 matmul", functools.partial(_matmul_trial, torch.float32)),
    Probe(matmul_path(torch.bfloat16), "bfloat16 matmul", functools.partial(_matmul_trial, torch.bfloat16)),
    Probe(matmul_path(torch.float16), "float16 matmul", functools.partial(_matmul_trial, torch.float16)),
)


def run_trial(probe: Probe) -> str | None:
    """Run ``probe``'s trial; return None if it passed, else what went wrong."""
    try:
        with torch.inference_mode():
            checks = probe.trial()
            for what, (got, want) in checks.items():
                if got.shape != want.shape:
                    return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
                err = (got.float() - want).abs().max().item()
                tolerance = TRIAL_TOLERANCE * want.abs().max().item()
                if not err <= tolerance:  # NaN fails too
                    return f"{what}: off by {err:.3g} from float32 (tolerance {tolerance:.3g})"
    except Exception as exc:  # any failure means the path does not work here
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
    return None


@attrs.frozen
class CpuPaths:
    """Which capability-dependent CPU paths work on this machine, and why.

    Build it with ``detect`` (or ``from_environment``, which reads
    ``TRIOSERVE_CPU_ASSUME``) once per model load and pass it on. ``capability``
    is torch's own dispatch level (``torch.backends.cpu.get_cpu_capability()``:
    ``DEFAULT``, ``AVX2``, ``AVX512``, ...), ``assume`` the switch's level,
    ``library_caps`` the ``LIBRARY_CAPS`` variables set in the environment.
    """

    capability: str
    assume: str | None
    paths: tuple[PathStatus, ...]
    library_caps: tuple[tuple[str, str], ...] = ()

    @classmethod
    def detect(
        cls,
        *,
        assume: str | None = None,
        probes: Sequence[Probe] = PROBES,
        library_caps: Mapping[str, str] | None = None,
        trials: Mapping[str, str | None] | None = None,
    ) -> CpuPaths:
        """Run each probe's trial (or take its result from ``trials``, probe
        name to error or None, where it has one); with ``assume`` (a level
        of ``ISA_LEVELS``), turn off the paths that need more."""
        assume = parse_assume(assume)
        trials = trials or {}
        statuses = []
        for probe in probes:
            forced = None
            if assume is not None and ISA_LEVELS.index(assume) < ISA_LEVELS.index(probe.needs):
                forced = f"{ASSUME_ENV}={assume}"
            error = trials[probe.name] if probe.name in trials else run_trial(probe)
            statuses.append(PathStatus(probe.name, probe.what, error, forced, probe.requirement))
        return cls(
            capability=torch.backends.cpu.get_cpu_capability(),
            assume=assume,
            paths=tuple(statuses),
            library_caps=tuple(sorted((library_caps or {}).items())),
        )

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None, *, probes: Sequence[Probe] = PROBES
    ) -> CpuPaths:
        """``detect`` with ``TRIOSERVE_CPU_ASSUME`` from ``environ`` (default:
        the process's). With the default probes, their trials' results are
        kept per machine and build in the model cache (``trial_cache``): a
        later start runs none."""
        environ = os.environ if environ is None else environ
        caps = {name: environ[name] for name in LIBRARY_CAPS if name in environ}
        trials = None
        if probes is PROBES:
            names = [probe.name for probe in probes]
            switches = (*LIBRARY_CAPS, native.SWITCH_ENV)
            trials = trial_cache.results(names, lambda: {p.name: run_trial(p) for p in probes}, environ, switches)
        return cls.detect(assume=environ.get(ASSUME_ENV), probes=probes, library_caps=caps, trials=trials)

    def status(self, name: str) -> PathStatus:
        for path in self.paths:
            if path.name == name:
                return path
        raise KeyError(f"no CPU path {name!r}; known: {', '.join(p.name for p in self.paths)}")

    def available(self, name: str) -> bool:
        """Whether path ``name`` works here (its trial passed, and no switch turned it off)."""
        return self.status(name).available

    def works(self, name: str) -> bool:
        """``available``, and False for a path these paths do not hold (a
        set detected with fewer probes, as tests build)."""
        return any(path.name == name and path.available for path in self.paths)

    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes a CPU model can run in here: those whose matmul works."""
        return tuple(d for d in CPU_DTYPES if self.works(matmul_path(d)))

    def require_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``CpuCapabilityError`` naming ``dtype`` and what the machine
        runs, unless a CPU model can run in ``dtype`` here."""
        if dtype in self.dtypes():
            return
        name = matmul_path(dtype)
        why = self.status(name).reason if name in {p.name for p in self.paths} else "no trial for it"
        runs = ", ".join(dtype_name(d) for d in self.dtypes()) or "no dtype at all"
        raise CpuCapabilityError(
            f"dtype {dtype_name(dtype)} cannot run on this CPU ({why}); "
            f"this machine runs {runs} (torch CPU capability {self.capability})"
        )

    @property
    def forced(self) -> tuple[PathStatus, ...]:
        """The paths the switch turned off."""
        return tuple(p for p in self.paths if p.forced_by is not None)

    def as_json(self) -> dict[str, object]:
        """The paths as ``/version`` shows them."""
        return {
            "capability": self.capability,
            "assume": self.assume,
            "library_caps": dict(self.library_caps),
            "dtypes": [dtype_name(d) for d in self.dtypes()],
            "paths": {p.name: p.as_json() for p in self.paths},
        }

    def describe(self) -> list[str]:
        """One line for the machine, then one per path: for logs and the test header."""
        caps = ", ".join(f"{k}={v}" for k, v in self.library_caps)
        head = f"CPU paths: torch capability {self.capability}"
        head += f", {ASSUME_ENV}={self.assume}" if self.assume else ""
        head += f", library caps {caps}" if caps else ""
        return [head] + [f"  {p.name}: {'yes' if p.available else 'NO'} ({p.reason})" for p in self.paths]
