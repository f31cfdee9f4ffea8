"""The native kernels of ``csrc/``: built once, loaded where built.

``scripts/setup.sh`` builds them through ``torch.utils.cpp_extension``
(``python -m trioserve.engine.kernels.native``) into a per-user cache,
``~/.cache/trioserve/native/<build tag>/`` (``$TRIOSERVE_NATIVE_CACHE``
instead of ``~/.cache/trioserve/native``), the tag naming the source and the
torch version: never into the installed package or the checkout, which may be
read-only and are shared by users and by other builds. Nothing compiles at
serve time: ``ops`` loads a library built for exactly this source and torch,
and raises ``NativeUnavailable`` where there is none (no compiler, a failed
build, a source changed since). The capability probes of the native kernels
then fail with that reason, and the chooser takes ATen's kernels instead.

The library holds one variant of each kernel per ISA (``ISAS``), compiled by
function target, so one build runs on any x86-64 CPU; a variant the CPU
lacks is refused by the library itself.

The build needs a C++ compiler (``$CXX``, else ``c++``) and ninja, which
torch's extension builder drives: the ``ninja`` package of trioserve's
dependencies (its binary beside the interpreter, found even where the venv
is not on ``PATH``) or the system's. ``build`` says which is missing
(``BuildToolMissing``) before trying.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).parent / "csrc"
# Compiled; the headers they include count toward a build's identity too.
SOURCES = ("linear.cpp", "decode.cpp", "gguf_repack.cpp")
HEADERS = (
    "kernels.h", "isa.h", "vexp.h", "panel.h", "panel_vnni.h", "rows_vnni.h", "panel_avx2.h", "panel_avx2_int16.h",
    "rows_avx2.h", "lanes_avx2.h", "q8_lanes_avx2.h", "lanes_vnni.h", "q6k_lanes_vnni.h", "q6k_lanes_avx2.h",
    "attend.h", "attend64.h", "rows.h", "moe_router.h", "moe_step.h",
)
LIBRARY_NAME = "trioserve_native"
SWITCH_ENV = "TRIOSERVE_NATIVE_KERNELS"
# Not under $TRIOSERVE_CACHE (engine/loading/gguf_cache.py), whose default root it
# shares: tests and trioserve bench suite point that at an empty folder to
# convert a model afresh, and a process started so must still find the kernels.
CACHE_ENV = "TRIOSERVE_NATIVE_CACHE"
CFLAGS = ("-O3", "-fopenmp")
# The ``isa`` argument of the library's kernels, lowest first.
# ``avx2int8`` is AVX2 with int8 activations against 4-bit weights and int16
# ones against Q8_0 in decode steps, and 4-bit calls below 10 rows
# (csrc/lanes_avx2.h over 4-bit weights held as lanes blocks, and
# csrc/q8_lanes_avx2.h over a Q8_0 LM head held so at every call; else
# csrc/panel_avx2.h, csrc/panel_avx2_int16.h, and csrc/rows_avx2.h at few
# rows with the panels' bits),
# ``avx512bf16`` AVX-512 with the many-row panels in bfloat16 products
# (csrc/panel.h), and ``avx512vnni`` that with int8 activations against the
# weights stored in groups of 32, 4-bit and Q8_0 (held as lanes blocks
# where they have whole panels of 16 channels: csrc/lanes_vnni.h at every
# row count; else csrc/panel_vnni.h, and csrc/rows_vnni.h at few rows with
# the panels' bits; int4_native.call_isa and int8_native say which calls);
# only the linears have them.
ISAS = {"scalar": 0, "avx2": 1, "avx2int8": 2, "avx512": 3, "avx512bf16": 4, "avx512vnni": 5}
# The variants best first, the order in which a caller takes the first that works.
ISA_ORDER = ("avx512", "avx2", "scalar")
LINEAR_ISA_ORDER = ("avx512vnni", "avx512bf16", "avx512", "avx2int8", "avx2", "scalar")
# What each variant needs of the CPU, in words (``capability.Probe.requirement``).
ISA_REQUIREMENTS = {
    "avx512vnni": "AVX-512 F/BW/VL, AVX512_BF16 and AVX512_VNNI",
    "avx512bf16": "AVX-512 F/BW and AVX512_BF16",
    "avx512": "AVX-512 F/BW",
    "avx2int8": "AVX2, FMA and F16C",
    "avx2": "AVX2, FMA and F16C",
    "scalar": None,
}
# The CPU level (``capability.ISA_LEVELS``) each variant needs, where its name is not one.
ISA_LEVEL = {"scalar": "default", "avx2int8": "avx2"}


class NativeUnavailable(RuntimeError):
    """The native library is not built for this source and torch, or failed to load."""


class BuildToolMissing(RuntimeError):
    """A tool the build needs (a C++ compiler, ninja) is not on this machine."""


def build_tag() -> str:
    """What a build depends on: the sources' bytes, the flags and torch's version."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """Where builds go: ``$TRIOSERVE_NATIVE_CACHE``, else ``~/.cache/trioserve/native``."""
    environ = os.environ if environ is None else environ
    env = environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "trioserve" / "native"


def build_dir() -> Path:
    return cache_root() / build_tag()


def library_path() -> Path:
    return build_dir() / f"{LIBRARY_NAME}.so"


def ops(environ: Mapping[str, str] | None = None) -> object:
    """``torch.ops.trioserve`` with the native kernels loaded; ``NativeUnavailable``
    where not built, or turned off by ``TRIOSERVE_NATIVE_KERNELS=0`` in ``environ``
    (default: the process's), which runs ATen's kernels as if they were not."""
    environ = os.environ if environ is None else environ
    if environ.get(SWITCH_ENV, "1").strip() == "0":
        raise NativeUnavailable(f"native kernels turned off by {SWITCH_ENV}=0")
    namespace = torch.ops.trioserve
    if _loaded(namespace):
        return namespace
    path = library_path()
    if not path.is_file():
        missing = missing_tools(environ)
        lacking = f"; this machine lacks {' and '.join(missing)}" if missing else ""
        raise NativeUnavailable(
            f"native kernels not built for this source and torch {torch.__version__} "
            f"(no {path}): run scripts/setup.sh or python -m trioserve.engine.kernels.native{lacking}"
        )
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:
        raise NativeUnavailable(f"native kernels at {path} do not load: {exc}") from None
    return namespace


def _loaded(namespace: object) -> bool:
    try:
        getattr(namespace, "q4_linear")
    except (AttributeError, RuntimeError):
        return False
    return True


def cpu_isas() -> tuple[str, ...]:
    """The ISA variants of the library this CPU runs, lowest first."""
    bits = ops().isas()  # type: ignore[attr-defined]
    return tuple(name for name, index in ISAS.items() if bits & (1 << index))


def compiler(environ: Mapping[str, str] | None = None) -> str | None:
    """The C++ compiler torch's builder runs (``$CXX``, else ``c++``), as found on ``PATH``; None where absent."""
    environ = os.environ if environ is None else environ
    return shutil.which(environ.get("CXX") or "c++", path=environ.get("PATH"))


def ninja_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The folder of the ninja binary the build runs: on ``PATH``, else
    beside this interpreter (the ``ninja`` package in a venv not activated);
    None where neither has one."""
    environ = os.environ if environ is None else environ
    found = shutil.which("ninja", path=environ.get("PATH"))
    if found is not None:
        return Path(found).parent
    beside = Path(sys.executable).parent
    return beside if shutil.which("ninja", path=str(beside)) is not None else None


def missing_tools(environ: Mapping[str, str] | None = None) -> list[str]:
    """What the build needs and this machine lacks, each in words with how to get it."""
    environ = os.environ if environ is None else environ
    missing = []
    if compiler(environ) is None:
        name = environ.get("CXX") or "c++"
        missing.append(f"a C++ compiler ({name!r} is not on PATH: install g++ or clang++, or set CXX)")
    if ninja_dir(environ) is None:
        missing.append(
            "ninja (neither on PATH nor beside this Python: pip install ninja, one of trioserve's "
            "dependencies, or the system's ninja-build package)"
        )
    return missing


def build(verbose: bool = False) -> Path:
    """Compile the library for this source and torch (a minute or so) and
    return its path; ``BuildToolMissing`` where a tool it needs is absent."""
    missing = missing_tools()
    if missing:
        raise BuildToolMissing(f"the native kernels' build needs {' and '.join(missing)}")
    from torch.utils.cpp_extension import load

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    # torch's builder runs ``ninja`` from PATH: put the one found there.
    path = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(p for p in (str(ninja_dir()), path) if p)
    try:
        # -O3, no -march: each ISA variant carries its own target (see the
        # source). -fopenmp makes at::parallel_for split the work: torch's own
        # OpenMP runtime (libgomp.so.1, which torch loads first) then runs it, one
        # thread team with torch's, not a second one competing for the cores.
        load(
            name=LIBRARY_NAME,
            sources=[str(SOURCE_DIR / name) for name in SOURCES],
            build_directory=str(where),
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        if path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = path
    return library_path()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say whether the library is built and loads")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    try:
        path = library_path() if args.check else build(args.verbose)
        ops()
    except Exception as exc:  # a failed build leaves ATen's kernels in use: say so, do not crash setup
        print(f"native kernels unavailable: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"native kernels: {path} (this CPU runs {', '.join(cpu_isas())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
