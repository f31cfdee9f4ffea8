"""The capability trials' results kept per machine and build, so a start
after the first runs none (``capability.CpuPaths.from_environment``).

A trial (``capability.PROBES``) is a correctness check on seeded inputs,
never a timing: given the same CPU, the same libraries and the same code,
it finds the same thing every time. Its result is kept beside the native
builds, in ``<native cache>/cpu-paths/<key>.json`` (``native.cache_root``:
``$TRIOSERVE_NATIVE_CACHE``, else ``~/.cache/trioserve/native``; not the
model cache, whose folders are a model's entries each), the key hashing all
that decides it: the CPU's model and feature flags, torch's version and
dispatch level, the native library (its build tag, and whether and when it
was built), the environment that turns paths or library features off, the
probes' names and the Python of engine/kernels (where the trials and the
kernels they call live). Anything else, or a folder that cannot be
written, runs the trials as before. The 25 trials took 0.5-0.8 CPU seconds
of a start (a 1B model's on a shared Zen 4).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from trioserve.engine.kernels import native

logger = logging.getLogger(__name__)

FOLDER = "cpu-paths"
# "0" or "off": the trials run at every start, their results neither kept nor read.
OFF_ENV = "TRIOSERVE_CPU_TRIALS_CACHE"

Results = dict[str, str | None]  # probe name -> its trial's error, None where it passed


def cache_root(environ: Mapping[str, str]) -> Path:
    """Where the results are kept: the native builds' root (``native.cache_root``)."""
    return native.cache_root(environ)


def _cpu() -> str:
    """The CPU's model name and feature flags (Linux's /proc/cpuinfo, first
    processor), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info.read().split("\n\n", 1)[0].splitlines()]
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "vendor_id", "cpu family", "model\t")
    return "\n".join(line for line in lines if line.startswith(wanted))


def _library() -> str:
    """The native library's build tag, and its file's size and mtime (absent: not built yet)."""
    try:
        tag = native.build_tag()
        stat = native.library_path().stat()
    except OSError:
        return "absent"
    return f"{tag} {stat.st_size} {stat.st_mtime_ns}"


def _kernels_source() -> str:
    """A hash of engine/kernels/*.py: the trials, and the Python of what they try."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def key(probes: Sequence[str], environ: Mapping[str, str], switches: Sequence[str]) -> str:
    """The hash naming the results of ``probes`` under ``environ`` (the
    variables ``switches`` name, which change what the trials find)."""
    parts = {
        "cpu": _cpu(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "library": _library(),
        "environment": {name: environ.get(name) for name in sorted(switches)},
        "probes": list(probes),
        "kernels": _kernels_source(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def results(
    probes: Sequence[str], run: Callable[[], Results], environ: Mapping[str, str], switches: Sequence[str]
) -> Results:
    """The trials' results for ``probes``: those kept under this machine's
    and build's key, else ``run()``'s, kept for the next start."""
    if environ.get(OFF_ENV, "").strip() in ("0", "off"):
        return run()
    try:
        path = cache_root(environ) / FOLDER / f"{key(probes, environ, switches)}.json"
    except OSError as exc:  # a source file unreadable: no key, no cache
        logger.debug("capability trials not cached: %s", exc)
        return run()
    try:
        kept = json.loads(path.read_text())
        if isinstance(kept, dict) and sorted(kept) == sorted(probes):
            return {name: (None if kept[name] is None else str(kept[name])) for name in probes}
    except (OSError, ValueError):
        pass
    found = run()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tmp-", suffix=".json", delete=False) as out:
            json.dump(found, out, indent=1, sort_keys=True)
        os.replace(out.name, path)  # whole or not at all, also when two starts race
    except OSError as exc:
        logger.debug("capability trials not cached in %s: %s", path.parent, exc)
    return found
