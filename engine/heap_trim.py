"""Giving the C heap's freed memory back to the system.

glibc's malloc keeps what the process frees: the pages of a freed block
stay resident until the top of the heap is free too, and each thread's
arena keeps its own. Loading a model (tensors decoded and dropped one at a
time) and serving requests (activations, logits, Python objects) leave
tens to a hundred MiB of such pages behind; ``malloc_trim(0)`` returns the
free pages inside every arena (docs/benchmarks.md, "Memory at ready").

What it leaves is the free top of each thread's arena: glibc shrinks that
only when a free leaves it above the trim threshold, and that threshold
follows the largest block freed (up to 64 MiB). The engine core's
resident memory after the same 500 requests read 768 to 813 MiB from start
to start (the step thread's arena holding 25 MiB more or less of free
top), with the same bytes in use; the server's 795 to 841. ``fix_heap_thresholds`` pins the thresholds before a
model loads: a top above 4 MiB is cut back to 2 MiB when a block is freed,
and blocks up to 32 MiB come from the arenas (where the moving threshold
ends up anyway) rather than from fresh mappings faulted in on every call.

The engine trims once it is ready and whenever it goes idle after finishing
requests (``EngineCore.release_memory``), never during a step. Elsewhere
than glibc (musl, macOS) there is nothing to call and both do nothing.
"""

from __future__ import annotations

import ctypes

# mallopt's parameters (glibc's malloc.h) and the values pinned.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
TRIM_THRESHOLD = 4 << 20
TOP_PAD = 2 << 20
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


def trim_heap() -> bool:
    """Return the C heap's free pages to the system; False where the C
    library has no ``malloc_trim`` (not glibc)."""
    try:
        # The process's own symbols, where the C library's are: no search
        # for a library file (``ctypes.util.find_library`` runs ldconfig).
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


def fix_heap_thresholds() -> bool:
    """Pin glibc's trim and mmap thresholds (process-wide, as ``mallopt``
    does) so that no thread's arena keeps more than a few MiB of free top
    resident; False where the C library has no ``mallopt`` (not glibc).

    Measured on the default model (docs/benchmarks.md): the engine core
    after 500 requests 769-771 MiB over four starts, against 768-813
    without; the step times the same within the noise (32 streams
    33.1-34.6 against 33.1-34.1 ms a decode step, taking turns)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TOP_PAD, TOP_PAD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return all(mallopt(param, value) == 1 for param, value in settings)
