"""The Batch API's files and batches, kept in a folder (``--batch-dir``).

Layout under the root::

    files/ID.data     a file's bytes (an upload, or a batch's output or errors)
    files/ID.json     its metadata, OpenAI's file object
    batches/ID.json   a batch's metadata, OpenAI's batch object

Metadata is written whole to a temporary file and moved over the old one
(``os.replace``), so a crash leaves either the old or the new version, never
half of one. A batch's output and error lines are appended to their files
as each line finishes (``LineLog``), and read back on a restart to tell
which lines are done (web/batch_service.py).

Ids carry their creation time in nanoseconds first, so sorting ids sorts by
age; they are checked against ``ID_PATTERN`` before any path is made of one,
so no id reaches outside the folder. One process owns a folder: the store
keeps each batch's metadata in memory once read, and the HTTP handlers and
the batch's runner change that one dict.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from trioserve.engine.loading.gguf_cache import cache_root

# What an id may be: the prefix, then letters, digits, "_" and "-".
ID_PATTERN = re.compile(r"(file|batch)[-_][A-Za-z0-9_-]{1,96}")
# A batch's output and error files take the batch's id with these after it.
OUTPUT_SUFFIX = "-output"
ERRORS_SUFFIX = "-errors"


BATCH_DIR_ENV = "TRIOSERVE_BATCH_DIR"


def default_batch_dir() -> Path:
    """Where batches live without ``--batch-dir``: ``$TRIOSERVE_BATCH_DIR``,
    else ``batches`` in trioserve's cache (``$TRIOSERVE_CACHE``, else
    ``~/.cache/trioserve``)."""
    folder = os.environ.get(BATCH_DIR_ENV)
    return Path(folder) if folder else cache_root() / "batches"


def new_id(prefix: str) -> str:
    """``prefix`` + creation time (hex nanoseconds) + 6 random bytes."""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(6)}"


def write_json_atomic(path: Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` through a temporary file and
    ``os.replace``: readers see the old or the new file, whole."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w", encoding="utf-8") as out:
        json.dump(value, out, ensure_ascii=False, separators=(",", ":"))
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def valid_id(text: str) -> bool:
    return ID_PATTERN.fullmatch(text) is not None


@attrs.define(eq=False)
class LineLog:
    """A JSONL file that lines are appended to, each flushed as written,
    so a line handed to ``append`` survives the process."""

    path: Path
    _out: Any = attrs.field(default=None, init=False)

    def append(self, value: Any) -> None:
        if self._out is None:
            self._out = open(self.path, "a", encoding="utf-8")
        self._out.write(json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._out.flush()

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


def read_complete_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a ``LineLog`` file; a last line cut short by a
    crash (no newline, or not JSON) is cut off the file, so appending
    goes on from a whole line."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "r+b") as out:
            out.truncate(end)
    lines = []
    for raw in data[:end].splitlines():
        if raw.strip():
            lines.append(json.loads(raw))
    return lines


@attrs.define(eq=False)
class BatchStore:
    """Files and batches under ``root`` (made if missing)."""

    root: Path = attrs.field(converter=lambda p: Path(p).expanduser())
    _batches: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        (self.root / "batches").mkdir(parents=True, exist_ok=True)

    # -- files -----------------------------------------------------------------

    def data_path(self, file_id: str) -> Path:
        if not valid_id(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / "files" / f"{file_id}.data"

    def _meta_path(self, file_id: str) -> Path:
        return self.root / "files" / f"{file_id}.json"

    def add_file(self, data: bytes, *, filename: str, purpose: str) -> dict[str, Any]:
        """Keep ``data`` as a new file; its file object."""
        file_id = new_id("file-")
        path = self.data_path(file_id)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)
        return self.register_file(file_id, filename=filename, purpose=purpose)

    def register_file(self, file_id: str, *, filename: str, purpose: str) -> dict[str, Any]:
        """Give the bytes at ``data_path(file_id)`` (made if missing) their
        file object, which makes them visible to the files API."""
        path = self.data_path(file_id)
        path.touch()
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": path.stat().st_size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
        }
        write_json_atomic(self._meta_path(file_id), meta)
        return meta

    def file(self, file_id: str) -> dict[str, Any] | None:
        """The file object of ``file_id``, or None."""
        if not valid_id(file_id):
            return None
        try:
            return json.loads(self._meta_path(file_id).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None

    def files(self) -> list[dict[str, Any]]:
        """Every file object, newest first."""
        found = [meta for path in (self.root / "files").glob("file-*.json") if (meta := self.file(path.stem))]
        return sorted(found, key=lambda meta: (meta["created_at"], meta["id"]), reverse=True)

    def delete_file(self, file_id: str) -> bool:
        """Delete a file; False if there was none."""
        if self.file(file_id) is None:
            return False
        self._meta_path(file_id).unlink()  # first: no object without its bytes
        self.data_path(file_id).unlink(missing_ok=True)
        return True

    # -- batches ---------------------------------------------------------------

    def _batch_path(self, batch_id: str) -> Path:
        return self.root / "batches" / f"{batch_id}.json"

    def add_batch(self, batch: dict[str, Any]) -> None:
        self._batches[batch["id"]] = batch
        self.save_batch(batch)

    def save_batch(self, batch: dict[str, Any]) -> None:
        write_json_atomic(self._batch_path(batch["id"]), batch)

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        """The batch object of ``batch_id`` (the one dict every user of this
        store shares), or None."""
        if batch_id in self._batches:
            return self._batches[batch_id]
        if not valid_id(batch_id):
            return None
        try:
            batch = json.loads(self._batch_path(batch_id).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        self._batches[batch_id] = batch
        return batch

    def batches(self) -> Iterator[dict[str, Any]]:
        """Every batch object, newest first."""
        for path in sorted((self.root / "batches").glob("batch_*.json"), reverse=True):
            batch = self.batch(path.stem)
            if batch is not None:
                yield batch

    def line_log(self, file_id: str) -> LineLog:
        """The log of lines appended to ``file_id``'s bytes (a batch's
        output or errors, made a file by ``register_file`` when it ends)."""
        return LineLog(self.data_path(file_id))


def output_file_id(batch_id: str) -> str:
    """The id of a batch's output file."""
    return f"file-{batch_id}{OUTPUT_SUFFIX}"


def error_file_id(batch_id: str) -> str:
    """The id of a batch's error file."""
    return f"file-{batch_id}{ERRORS_SUFFIX}"
