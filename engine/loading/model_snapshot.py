"""A GGUF model as built for this machine, kept for the next start and mapped.

Building a compressed GGUF model lays its weights out for the native
kernels (4-bit lanes, Q6_K and Q8_0 lanes blocks): seconds of work for a
multi-GB file, most of it the first write of memory the process has not
touched. A later start with the same file, code, kernel and CPU would build
the same bytes again. So the first start keeps what it built: ``take``
pickles the model's objects on the loading thread (milliseconds: the
tensors are referred to, not copied), and ``SnapshotWriter`` writes that
and the tensors' bytes to ``<name>.snapshot`` on a thread of its own while
the server starts serving (the process waits for it at exit). A later
start reads it (``read``): the file is mapped copy-on-write, each tensor a
view of its pages (the page cache's, shared with any other process that
maps it, as llama.cpp maps a GGUF), and nothing is laid out again.

The file is ``MAGIC``, the length of a JSON header, the header (the key,
each tensor storage's offset and length, the pickle's), then the pickle
and the storages, each at a page boundary. ``snapshot_key`` names what the
bytes depend on; a file under another key, or one that does not read back
whole, is not used (and is replaced after the next build). The unpickler
takes classes from the project's, torch's, numpy's and a few standard
modules only, and no module as a value: a guard against a stray file, not
a sandbox (torch's modules are large). The cache is trusted as the native
builds beside it are, which run as they are found.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import mmap
import os
import pickle
import struct
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from trioserve.engine.kernels import native
from trioserve.engine.loading.gguf_cache import pid_alive

logger = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"TRIOSERVE-SNAPSHOT\n"
SUFFIX = ".snapshot"
OFF_ENV = "TRIOSERVE_MODEL_SNAPSHOT"  # "0" or "off": build every start, keep nothing
_PAGE = 4096
_INLINE_BYTES = 4096  # numpy arrays smaller than this stay in the pickle
_ENGINE = Path(__file__).resolve().parent.parent  # trioserve/engine
# The packages an unpickled class may come from: the project's, torch's,
# numpy's and the few standard modules their pickles name.
_ALLOWED = frozenset(
    {"trioserve", "torch", "numpy", "attr", "collections", "copyreg", "functools", "_codecs", "threading", "_thread"}
)


class SnapshotError(Exception):
    """A snapshot that cannot be used (damaged, another key, a class not allowed)."""


def enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether snapshots are kept and read (``$TRIOSERVE_MODEL_SNAPSHOT`` not ``0``/``off``)."""
    value = (os.environ if environ is None else environ).get(OFF_ENV, "").strip().lower()
    return value not in ("0", "off", "false", "no")


def engine_source_hash() -> str:
    """A hash of every module of ``trioserve.engine``: what builds a model
    and what its objects are (the pickle names their classes and fields)."""
    digest = hashlib.sha256()
    for path in sorted(_ENGINE.rglob("*.py")):
        digest.update(str(path.relative_to(_ENGINE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def snapshot_key(source: Path, parts: dict[str, str]) -> str:
    """The key of a build of ``source``: the file's identity (resolved path,
    size, mtime, inode), ``parts`` (the kernel choice, the CPU's paths, the
    native library's build), the engine's code, torch's and Python's version."""
    resolved = source.resolve()
    st = resolved.stat()
    described = {
        "format": FORMAT,
        "file": [str(resolved), st.st_size, st.st_mtime_ns, st.st_ino],
        "engine": engine_source_hash(),
        "torch": torch.__version__,
        "python": sys.version,
        **parts,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def path_for(folder: Path, key: str) -> Path:
    """Where the snapshot under ``key`` lives in ``folder`` (the GGUF's cache entry)."""
    return folder / "built" / f"{key}{SUFFIX}"


def _ops_namespace(name: str) -> object:
    """``torch.ops.<name>``; the project's own loaded first (``native.ops``)."""
    return native.ops() if name == "trioserve" else getattr(torch.ops, name)


def _op(namespace: object, name: str) -> object:
    """An op of ``namespace`` (``torch.ops.<ns>.<name>``), nothing else."""
    op = getattr(namespace, name)
    if not isinstance(op, torch._ops.OpOverloadPacket):
        raise SnapshotError(f"{name!r} is not an op")
    return op


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.numpy()


class _Pickler(pickle.Pickler):
    """Refers to each tensor storage by its index in ``storages`` (dedup by
    storage, so a tied table is kept once) and to torch's op namespaces and
    ops by name; a lock is kept as a new lock; a large numpy array as a
    tensor over its bytes."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: list[torch.UntypedStorage] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype, numel = obj._untyped_storage, obj.dtype, obj._size()
        elif isinstance(obj, torch.UntypedStorage):
            storage, dtype, numel = obj, torch.uint8, obj.nbytes()
        else:
            return None
        if storage.device.type != "cpu":
            raise SnapshotError(f"a tensor on {storage.device}: only CPU models are kept")
        index = self._index.get(storage._cdata)
        if index is None:
            index = self._index[storage._cdata] = len(self.storages)
            self.storages.append(storage)
        return ("storage", index, str(dtype).removeprefix("torch."), numel, isinstance(obj, torch.UntypedStorage))

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch._ops._OpNamespace:
            return _ops_namespace, (obj.name,)
        if kind is torch._ops.OpOverloadPacket:
            namespace, name = obj._qualified_op_name.split("::")
            return _op, (_ops_namespace(namespace), name)
        if kind is _LOCK:
            return threading.Lock, ()
        if kind is _RLOCK:
            return threading.RLock, ()
        if kind is np.ndarray and obj.nbytes >= _INLINE_BYTES and not obj.dtype.hasobject:
            held = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
            return _array, (_tensor_over(held),)
        return NotImplemented


_LOCK = type(threading.Lock())
_RLOCK = type(threading.RLock())


def _tensor_over(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array``'s bytes, read-only or not (the pickler only reads it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, storage: Callable[[tuple[Any, ...]], Any]) -> None:
        super().__init__(file)
        self._storage = storage

    def persistent_load(self, pid: Any) -> Any:
        return self._storage(pid)

    def find_class(self, module: str, name: str) -> Any:
        allowed = module.split(".")[0] in _ALLOWED or (
            module == "builtins" and name in ("set", "frozenset", "slice", "complex", "range")
        )
        found = super().find_class(module, name) if allowed else None
        if found is None or isinstance(found, types.ModuleType):
            raise SnapshotError(f"the snapshot names {module}.{name}, which is not allowed")
        return found


@attrs.frozen
class Snapshot:
    """A built model's objects pickled (``pickled``) over the storages they hold (``storages``)."""

    key: str
    pickled: bytes
    storages: tuple[torch.UntypedStorage, ...]

    @property
    def nbytes(self) -> int:
        return len(self.pickled) + sum(s.nbytes() for s in self.storages)

    def write(self, path: Path) -> None:
        """The file, whole or not at all (a temporary renamed into place);
        any other snapshot in its folder is removed (one build kept per file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        offsets, at = [], _align(len(self.pickled))
        for storage in self.storages:
            offsets.append([at, storage.nbytes()])
            at = _align(at + storage.nbytes())
        header = json.dumps({"key": self.key, "pickle": len(self.pickled), "storages": offsets}).encode()
        start = _align(len(MAGIC) + 8 + len(header))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as out:
                out.write(MAGIC + struct.pack("<Q", len(header)) + header)
                out.seek(start)
                out.write(self.pickled)
                for (offset, nbytes), storage in zip(offsets, self.storages):
                    if nbytes:
                        out.seek(start + offset)
                        out.write(memoryview(_bytes_of(storage).numpy()))
                out.truncate(start + at)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        for other in path.parent.glob(f"*{SUFFIX}"):
            if other != path:
                other.unlink(missing_ok=True)
        for stale in path.parent.glob(f".*{SUFFIX}.*.tmp"):
            pid = stale.name.split(".")[-3]
            if pid.isdigit() and not pid_alive(int(pid)):
                stale.unlink(missing_ok=True)


def _align(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def take(model: object, key: str) -> Snapshot:
    """``model`` pickled now, on this thread (before anything else changes
    its objects), its storages referred to: what ``SnapshotWriter`` writes."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    try:
        pickler.dump(model)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
        raise SnapshotError(f"the model cannot be kept: {exc}") from None
    return Snapshot(key, buffer.getvalue(), tuple(pickler.storages))


def read(path: Path, key: str) -> Any:
    """The model kept at ``path`` under ``key``, its tensors over the mapped
    file's pages. Raises ``SnapshotError`` where it cannot be used and
    ``FileNotFoundError`` where there is none."""
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError as exc:  # an empty file
            raise SnapshotError(f"cannot map it: {exc}") from None
    # Read ahead whatever of it the page cache lacks (after a reboot, say),
    # so the first step does not wait on the disk page by page. Populating
    # the mapping instead would copy every page: it is private and writable.
    mapped.madvise(mmap.MADV_WILLNEED)
    try:
        if mapped[: len(MAGIC)] != MAGIC:
            raise SnapshotError("not a snapshot")
        (length,) = struct.unpack_from("<Q", mapped, len(MAGIC))
        header = json.loads(mapped[len(MAGIC) + 8 : len(MAGIC) + 8 + length])
        if header.get("key") != key:
            raise SnapshotError("another build's snapshot")
        start = _align(len(MAGIC) + 8 + length)
        spans = [(start + offset, nbytes) for offset, nbytes in header["storages"]]
        if any(offset + nbytes > len(mapped) for offset, nbytes in spans):
            raise SnapshotError("the file is shorter than its header says")
        pickled = mapped[start : start + header["pickle"]]
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise SnapshotError(f"damaged header: {exc}") from None

    def storage(pid: tuple[Any, ...]) -> Any:
        _, index, dtype_name, _numel, untyped = pid
        offset, nbytes = spans[index]
        if nbytes:
            whole = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset)
        else:
            whole = torch.empty(0, dtype=torch.uint8)
        untyped_storage = whole.untyped_storage()
        if untyped:
            return untyped_storage
        dtype = getattr(torch, dtype_name)
        return torch.storage.TypedStorage(wrap_storage=untyped_storage, dtype=dtype, _internal=True)

    try:
        return _Unpickler(io.BytesIO(pickled), storage).load()
    except SnapshotError:
        raise
    except Exception as exc:  # a pickle of classes that have changed, or damaged bytes
        raise SnapshotError(f"cannot rebuild the model: {type(exc).__name__}: {exc}") from None


class SnapshotWriter:
    """Writes a ``Snapshot`` on a thread of its own, which the interpreter
    waits for at exit (a server stopped right after it started still keeps
    its build; a process killed first leaves a temporary file, removed by
    the next write). ``wait`` blocks until it is written or has failed;
    ``statistics()`` says which."""

    def __init__(self, snapshot: Snapshot, path: Path) -> None:
        self.path = path
        self.nbytes = snapshot.nbytes
        self._done = threading.Event()
        self._error: str | None = None
        self._seconds: float | None = None
        self._thread = threading.Thread(target=self._run, args=(snapshot,), name="model-snapshot", daemon=False)
        self._thread.start()

    def _run(self, snapshot: Snapshot) -> None:
        started = time.perf_counter()
        try:
            snapshot.write(self.path)
            self._seconds = time.perf_counter() - started
            logger.info(
                "kept the built model for the next start: %s (%.0f MB in %.1f s)",
                self.path, self.nbytes / 1e6, self._seconds,
            )
        except OSError as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            logger.warning("could not keep the built model in %s: %s", self.path, self._error)
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the write has ended (written or failed) within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def statistics(self) -> dict[str, object]:
        """``done``, ``path``, ``nbytes``, ``seconds`` (once written) and ``error`` (once failed)."""
        return {
            "done": self._done.is_set(),
            "path": str(self.path),
            "nbytes": self.nbytes,
            "seconds": self._seconds,
            "error": self._error,
        }


def load_or_build(
    folder: Path, key: str | None, build: Callable[[], Any], name: str
) -> tuple[Any, SnapshotWriter | None]:
    """The model kept under ``key`` in ``folder`` if there is one that reads
    back, else ``build()``'s, whose snapshot is then written in the
    background. ``key`` None: build, keep nothing."""
    if key is None:
        return build(), None
    path = path_for(folder, key)
    started = time.perf_counter()
    try:
        model = read(path, key)
    except FileNotFoundError:
        pass
    except (SnapshotError, OSError) as exc:
        logger.warning("%s: not using the kept build %s (%s); building again", name, path, exc)
    else:
        seconds = time.perf_counter() - started
        logger.info("%s: mapped the build kept from an earlier start (%s, %.2f s)", name, path, seconds)
        return model, None
    model = build()
    try:
        snapshot = take(model, key)
    except SnapshotError as exc:
        logger.warning("%s: %s", name, exc)
        return model, None
    return model, SnapshotWriter(snapshot, path)


__all__ = [
    "Snapshot",
    "SnapshotError",
    "SnapshotWriter",
    "enabled",
    "load_or_build",
    "path_for",
    "read",
    "snapshot_key",
    "take",
]
