"""Giving the C heap's freed memory back to the system.

glibc's malloc keeps what the process frees: the pages of a freed block
stay resident until the top of the heap is free too, and each thread's
arena keeps its own. Loading a model (tensors decoded and dropped one at a
time) and serving requests (activations, logits, Python objects) leave
tens to a hundred MiB of such pages behind; ``malloc_trim(0)`` returns the
free pages of every arena (docs/benchmarks.md, "Resident memory").

The engine trims once it is ready and whenever it goes idle after finishing
requests (``EngineCore.release_memory``), never during a step. Elsewhere
than glibc (musl, macOS) there is nothing to call and trimming does nothing.
"""

from __future__ import annotations

import ctypes


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
