"""The server's batches: each runs as a task of the app's serving nursery.

A batch goes ``validating`` (its lines read; those that cannot run go to
its error file), ``in_progress`` (its lines run, web/batch_runner.py; each
output or error line appended and flushed as it finishes, the counts saved
with it), ``finalizing`` (its output and error files made visible) and
``completed``. ``cancel`` makes it ``cancelling``: the lines in the engine
are aborted (their requests' cancel scope), the finished ones kept, and it
ends ``cancelled`` with the files of what finished.

When the server drains, the running batches stop where they are, their
in-flight lines unrecorded. At startup every batch found ``validating``,
``in_progress``, ``cancelling`` or ``finalizing`` resumes: its input is read
again and a line whose ``custom_id`` has a response in the output or error
file already is not run again, so a restart loses no finished line and runs
none twice. (Lines that could not run are written once, while validating;
a batch cut off then is validated afresh.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import attrs
import trio
from quart import current_app
from quart_trio import QuartTrio

from .batch_lines import BATCH_ENDPOINTS, LineError, RequestLine, read_lines
from .batch_runner import LineRunner, ServerStopping
from .batch_store import BatchStore, error_file_id, new_id, output_file_id, read_complete_lines
from .errors import ApiError, ServiceUnavailable
from .host import ModelHost

log = logging.getLogger(__name__)

# The key of the service in ``app.extensions``.
EXTENSION = "trioserve.batches"
# Seconds a batch has to finish (OpenAI's only completion window). Kept in
# ``expires_at``; an expired batch is not stopped.
COMPLETION_WINDOW = 24 * 3600
UNFINISHED = ("validating", "in_progress", "cancelling", "finalizing")


def served_endpoints(app: QuartTrio) -> frozenset[str]:
    """The batch endpoints ``app`` serves (``/v1/embeddings`` only where it is a route)."""
    posts = {rule.rule for rule in app.url_map.iter_rules() if "POST" in (rule.methods or ())}
    return frozenset(endpoint for endpoint in BATCH_ENDPOINTS if endpoint in posts)


@attrs.define(eq=False)
class BatchService:
    """The batches of ``app``, kept in ``store``, run by ``runner``."""

    app: QuartTrio
    host: ModelHost
    store: BatchStore
    runner: LineRunner
    _nursery: trio.Nursery | None = attrs.field(default=None, init=False)
    _running: dict[str, trio.CancelScope] = attrs.field(factory=dict, init=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)

    @classmethod
    def for_app(cls, app: QuartTrio, host: ModelHost, store: BatchStore) -> BatchService:
        config = host.config
        runner = LineRunner(
            app,
            priority=config.engine.degradation.low_priority,
            max_in_flight=config.batch_max_in_flight,
            api_key=config.api_key,
        )
        return cls(app, host, store, runner)

    # -- requests --------------------------------------------------------------

    def create(self, input_file_id: str, endpoint: str, metadata: dict[str, str] | None) -> dict[str, Any]:
        """A new batch of ``input_file_id``'s lines on ``endpoint``, started now."""
        self.host.raise_unless_ready()
        if self._nursery is None:
            raise ServiceUnavailable("the server is not running batches now", code="batches_unavailable")
        now = int(time.time())
        batch = {
            "id": new_id("batch_"),
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + COMPLETION_WINDOW,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        self.store.add_batch(batch)
        self._nursery.start_soon(self._process, batch["id"])
        self._notify()
        return batch

    def cancel(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Cancel ``batch``: its in-flight lines are aborted, its finished ones kept."""
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        if batch["status"] not in ("validating", "in_progress"):
            raise ApiError(
                409,
                f"batch {batch['id']} is {batch['status']} and cannot be cancelled",
                type="invalid_request_error",
                param="batch_id",
                code="batch_not_cancellable",
            )
        batch["status"] = "cancelling"
        batch["cancelling_at"] = int(time.time())
        self.store.save_batch(batch)
        scope = self._running.get(batch["id"])
        if scope is not None:
            scope.cancel()
        # Else its task has not begun (it sees "cancelling"), or the server
        # is draining (the next start ends it).
        self._notify()
        return batch

    def in_use(self, file_id: str) -> bool:
        """Whether an unfinished batch reads ``file_id``."""
        return any(b["input_file_id"] == file_id and b["status"] in UNFINISHED for b in self.store.batches())

    async def wait_for(self, batch_id: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Wait until ``done(batch)`` holds for the batch ``batch_id``; the batch."""
        while True:
            batch = self.store.batch(batch_id)
            if batch is None:
                raise KeyError(batch_id)
            if done(batch):
                return batch
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- running ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run batches from when the engines serve until the server drains;
        the unfinished batches found in the store resume first."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            try:
                await self.host.wait_ready()
            except ApiError:  # the engines failed or stopped first
                return
            self._nursery = nursery
            for batch in list(self.store.batches()):
                if batch["status"] in UNFINISHED:
                    log.info("resuming batch %s (%s)", batch["id"], batch["status"])
                    nursery.start_soon(self._process, batch["id"])
            await self.host.wait_draining()
            # In-flight lines are aborted unrecorded: a restart runs them.
            self._nursery = None
            nursery.cancel_scope.cancel()

    async def _process(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        assert batch is not None
        try:
            if batch["status"] in ("validating", "in_progress"):
                await self._run(batch)
            if batch["status"] != "failed":
                self._finish(batch)
        except* ServerStopping as group:  # from one of the runner's workers
            log.info("batch %s stops until the server starts again: %s", batch_id, group.exceptions[0])
        self._notify()

    async def _run(self, batch: dict[str, Any]) -> None:
        batch_id = batch["id"]
        outputs = self.store.line_log(output_file_id(batch_id))
        errors = self.store.line_log(error_file_id(batch_id))
        validating = batch["status"] == "validating"  # read now: cancel() may change it while the file is read
        if self.store.file(batch["input_file_id"]) is None:
            self._fail(batch, "file_not_found", f"the input file {batch['input_file_id']} no longer exists", "input_file_id")
            return
        data = await trio.to_thread.run_sync(self.store.data_path(batch["input_file_id"]).read_bytes)
        endpoints = {batch["endpoint"]} & served_endpoints(self.app)
        lines = list(read_lines(data, endpoints))
        counts = batch["request_counts"]
        if validating:
            outputs.path.unlink(missing_ok=True)  # a validation cut off before: start again
            errors.path.unlink(missing_ok=True)
            refused = [line for line in lines if isinstance(line, LineError)]
            for line in refused:
                errors.append(line.output_line())
            counts.update(total=len(lines), completed=0, failed=len(refused))
            done: set[str] = set()
            if batch["status"] == "validating":
                batch["status"] = "in_progress"
                batch["in_progress_at"] = int(time.time())
        else:
            written = read_complete_lines(outputs.path)
            failed = read_complete_lines(errors.path)
            done = {line["custom_id"] for line in written + failed if line.get("response") is not None}
            counts.update(total=len(lines), completed=len(written), failed=len(failed))
        self.store.save_batch(batch)
        self._notify()

        def record(line: RequestLine, output: dict[str, Any]) -> None:
            ok = 200 <= output["response"]["status_code"] < 300
            (outputs if ok else errors).append(output)
            counts["completed" if ok else "failed"] += 1
            self.store.save_batch(batch)
            self._notify()

        todo = (line for line in lines if isinstance(line, RequestLine) and line.custom_id not in done)
        try:
            with trio.CancelScope() as scope:
                self._running[batch_id] = scope
                if batch["status"] == "in_progress":  # not cancelled meanwhile
                    await self.runner.run(todo, record)
        finally:
            del self._running[batch_id]
            outputs.close()
            errors.close()

    def _finish(self, batch: dict[str, Any]) -> None:
        """Make the batch's output and error files visible and end it."""
        final = "cancelled" if batch["status"] == "cancelling" else "completed"
        now = int(time.time())
        batch["status"] = "finalizing"
        batch["finalizing_at"] = now
        self.store.save_batch(batch)
        for file_id, field in ((output_file_id(batch["id"]), "output_file_id"), (error_file_id(batch["id"]), "error_file_id")):
            path = self.store.data_path(file_id)
            if path.exists() and path.stat().st_size > 0:
                self.store.register_file(file_id, filename=f"{file_id}.jsonl", purpose="batch_output")
                batch[field] = file_id
        batch["status"] = final
        batch["cancelled_at" if final == "cancelled" else "completed_at"] = int(time.time())
        self.store.save_batch(batch)

    def _fail(self, batch: dict[str, Any], code: str, message: str, param: str) -> None:
        batch["status"] = "failed"
        batch["failed_at"] = int(time.time())
        batch["errors"] = {"object": "list", "data": [{"code": code, "message": message, "param": param, "line": None}]}
        self.store.save_batch(batch)


def current_batches() -> BatchService:
    """The batch service of the app handling the current request."""
    return current_app.extensions[EXTENSION]
