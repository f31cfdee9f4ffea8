"""Which dtype the KV cache stores: the one asked for, or one this machine runs well.

A 16-bit cache holds twice the tokens of a float32 one in the same bytes.
Keys and values are still computed in the model's dtype; ``write_kv``
rounds them into the cache's and attention widens what it reads back
(engine/layers/kv_cache.py), so the cache's dtype changes what is stored, not how
anything is computed.

``kv_cache_dtype="auto"`` (``choose_kv_dtype``):

- a model in a 16-bit dtype keeps it (nothing to convert), and so does any
  model on CUDA;
- a float32 model on CPU takes the first of ``CPU_PREFERENCE`` (float16,
  then bfloat16) whose
  capability path (``kv_cache_<dtype>`` in ``capability.PROBES``: a write
  into a paged pool, a gather and an attention over it, checked against
  float32, on seeded inputs: a correctness check, never a timing) works
  here; else float32. The paths name the instructions that
  make the conversions cheap (F16C comes with AVX2, bfloat16's conversion
  instructions with AVX-512 BF16 or AVX-NE-CONVERT), so
  ``TRIOSERVE_CPU_ASSUME`` turns them off like any other path. The choice
  is a rule, not a timing: a read timed at load once put two engines on one
  model on different caches, and a near tie in the greedy tokens went apart
  (issue 39); trioserve bench kv-dtype compares their speed.

An explicit dtype is taken where its path works (on CPU, the trial must
pass; the switch does not refuse it), else ``CpuCapabilityError`` names the
field and what this machine runs. ``fp8`` (e4m3, saturating at 448) is for
CUDA only.
"""

from __future__ import annotations

import attrs
import torch

from trioserve.engine.config import KV_CACHE_DTYPES, ModelConfig
from trioserve.engine.errors import CpuCapabilityError
from trioserve.engine.kernels.capability import CpuPaths
from trioserve.engine.kernels.kv_dtype import DTYPES, FP8, kv_dtype_name, kv_path
from trioserve.engine.layers.kv_cache import storage_dtype

# What "auto" tries for a float32 model on CPU, best first. float16 keeps
# three more bits of mantissa than bfloat16: on the default model its cache
# gave float32's greedy tokens exactly over the reference prompts, where
# bfloat16's drifted on one of four (docs/benchmarks.md, "KV cache dtype");
# it saturates at 65504 (kv_cache.to_cache), far above any key or value
# these models compute. bfloat16, with float32's range, is the next choice.
CPU_PREFERENCE = (torch.float16, torch.bfloat16)


@attrs.frozen
class KVDtypeChoice:
    """The dtype the KV cache stores and why (logged, and in ``/version``)."""

    dtype: torch.dtype
    asked: str
    reason: str

    @property
    def name(self) -> str:
        return kv_dtype_name(self.dtype)

    @property
    def bytes_per_element(self) -> int:
        return torch.empty((), dtype=storage_dtype(self.dtype)).element_size()

    def as_json(self) -> dict[str, object]:
        return {"dtype": self.name, "asked": self.asked, "reason": self.reason}

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def _runs_here(cpu_paths: CpuPaths, model_dtype: torch.dtype) -> list[str]:
    """The cache dtypes whose path works here (the model's own always does)."""
    known = {p.name for p in cpu_paths.paths}
    runs = {kv_dtype_name(model_dtype), "float32"}
    runs |= {kv_dtype_name(d) for d in CPU_PREFERENCE if kv_path(d) in known and cpu_paths.status(kv_path(d)).trial_error is None}
    return [name for name in DTYPES if name in runs]


def choose_kv_dtype(
    asked: str,
    *,
    model_dtype: torch.dtype,
    device: torch.device | str,
    cpu_paths: CpuPaths | None,
    config: ModelConfig,
) -> KVDtypeChoice:
    """The cache dtype for ``kv_cache_dtype=asked`` under a model in
    ``model_dtype`` on ``device`` (see the module's docstring); on CPU,
    ``cpu_paths`` is what this machine runs. A pure function of these (no
    timing), so two starts on one machine store the same bits. Raises ``CpuCapabilityError`` naming
    ``kv_cache_dtype`` for a dtype this machine cannot hold the cache in."""
    if asked not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {asked!r}")
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    if on_cpu and cpu_paths is None:
        raise ValueError("a CPU model's KV cache dtype is chosen from cpu_paths")
    if asked != "auto":
        return _explicit(asked, model_dtype, device, cpu_paths)
    if not on_cpu:
        return KVDtypeChoice(model_dtype, asked, f"the model's dtype on {device.type}")
    if model_dtype != torch.float32:
        return KVDtypeChoice(model_dtype, asked, "the model's dtype (16 bits already)")
    assert cpu_paths is not None
    known = {p.name for p in cpu_paths.paths}
    usable = [d for d in CPU_PREFERENCE if cpu_paths.works(kv_path(d))]
    off = "; ".join(cpu_paths.status(kv_path(d)).reason for d in CPU_PREFERENCE if d not in usable and kv_path(d) in known)
    if not usable:
        return KVDtypeChoice(torch.float32, asked, f"no 16-bit cache runs well here ({off or 'no path for one'})")
    dtype = usable[0]
    return KVDtypeChoice(dtype, asked, f"half the bytes of float32; {cpu_paths.status(kv_path(dtype)).reason}")


def refuse_before_load(asked: str, device: torch.device) -> None:
    """Refuse ``kv_cache_dtype="fp8"`` off CUDA before any weight loads
    (``CpuCapabilityError`` listing what this CPU's cache runs)."""
    if asked == "fp8" and device.type != "cuda":
        cpu_paths = CpuPaths.from_environment() if device.type == "cpu" else None
        _explicit(asked, torch.float32, device, cpu_paths)


def _explicit(asked: str, model_dtype: torch.dtype, device: torch.device, cpu_paths: CpuPaths | None) -> KVDtypeChoice:
    dtype = DTYPES[asked]
    if device.type != "cpu":
        if dtype == FP8 and device.type != "cuda":
            raise CpuCapabilityError(f"kv_cache_dtype fp8 runs on CUDA only, not on {device}")
        return KVDtypeChoice(dtype, asked, "asked for")
    assert cpu_paths is not None
    runs = ", ".join(_runs_here(cpu_paths, model_dtype))
    if dtype == FP8:
        raise CpuCapabilityError(f"kv_cache_dtype fp8 runs on CUDA only; on this CPU the KV cache runs {runs}")
    if dtype in (torch.float32, model_dtype):
        return KVDtypeChoice(dtype, asked, "asked for")
    status = cpu_paths.status(kv_path(dtype)) if kv_path(dtype) in {p.name for p in cpu_paths.paths} else None
    if status is None or status.trial_error is not None:
        why = status.reason if status is not None else "no trial for it"
        raise CpuCapabilityError(
            f"kv_cache_dtype {asked} cannot run on this CPU ({why}); the KV cache runs {runs} here"
        )
    if status.forced_by is not None:
        return KVDtypeChoice(dtype, asked, f"asked for, though {status.reason}")
    return KVDtypeChoice(dtype, asked, "asked for")
