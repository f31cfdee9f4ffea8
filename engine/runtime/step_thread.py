"""One long-lived OS thread for an engine's torch work.

torch's CPU kernels run on an OpenMP pool, and each OS thread that runs a
parallel kernel gets a pool of its own. On a machine with few cores, a second
pool makes the first one slower: its threads stop spin-waiting between
kernels once other threads hold the cores, and every matmul then pays for
waking them. Running the load and every step on the same thread keeps one
pool, warm, whatever other threads the caller has (an event loop, a thread
cache that hands out a different thread each call). Measured here: about a
quarter faster per step than the same step on a fresh thread in a process
whose main thread has run torch kernels.

``StepThread`` runs submitted callables one at a time on one thread and
hands back ``concurrent.futures.Future`` values. It is its own small loop
rather than a ``ThreadPoolExecutor`` for the sake of faults (see
docs/reliability.md):

- the thread is a daemon: a step that never returns must not keep the
  process from exiting (``concurrent.futures`` joins its workers at exit);
- a thread that dies (a ``BaseException`` escaping a job, such as
  ``SystemExit`` or an exception raised into the thread from outside) fails
  its job and every queued one with ``StepThreadDied`` instead of leaving
  their futures pending forever;
- ``abandon()`` lets a hung job's thread go without waiting for it: it takes
  no more work and ends by itself if the job ever returns.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_STOP = object()  # the queue's end marker


class StepThreadClosed(RuntimeError):
    """The step thread was closed or abandoned and takes no more work."""


class StepThreadDied(RuntimeError):
    """The step thread ended while running (or before running) a job."""


def _init_worker(num_threads: int | None) -> None:
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    # Fixes this thread's OpenMP team size now, before any other thread
    # changes torch's process-wide default.
    torch.get_num_threads()


class StepThread:
    """Runs submitted callables one at a time, in order, on a single thread.

    ``num_threads``: torch intra-op threads for that thread (None: torch's
    default). Use as a context manager, or call ``close()``: it waits for
    the job in flight (unless the thread was abandoned).
    """

    def __init__(self, num_threads: int | None = None, *, name: str = "trioserve-step") -> None:
        self.num_threads = num_threads
        self.name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Guards _closed and _dead against submit(): a job is queued only
        # while the thread will still take it.
        self._lock = threading.Lock()
        self._closed = False
        self._abandoned = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    # -- the thread ---------------------------------------------------------

    def _main(self) -> None:
        try:
            _init_worker(self.num_threads)
            while (job := self._jobs.get()) is not _STOP:
                future, fn, args = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args)
                except Exception as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                del job, future, fn, args  # drop references between jobs
        except BaseException as exc:
            # SystemExit, KeyboardInterrupt or an asynchronous exception: this
            # thread ends here. The job it ran, and every queued one, fails.
            with self._lock:
                self._dead = exc
            died = StepThreadDied(f"the step thread {self.name!r} died: {type(exc).__name__}")
            died.__cause__ = exc
            if "future" in locals() and not future.done():
                future.set_exception(died)
            self._fail_queued(died)

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP and job[0].set_running_or_notify_cancel():
                job[0].set_exception(error)

    # -- the caller's side --------------------------------------------------

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)``; its future completes on the step thread.

        Raises ``StepThreadClosed`` after ``close()`` or ``abandon()`` and
        ``StepThreadDied`` once the thread has died: the job never ran.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise StepThreadClosed(f"the step thread {self.name!r} is closed")
            if self._dead is not None:
                raise StepThreadDied(f"the step thread {self.name!r} died: {type(self._dead).__name__}")
            self._jobs.put((future, fn, args))
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the step thread and wait for it here;
        exceptions propagate."""
        return self.submit(fn, *args).result()

    @property
    def alive(self) -> bool:
        """The thread is running (it may be closed to new work)."""
        return self._thread.is_alive()

    @property
    def usable(self) -> bool:
        """``submit`` would take a job: neither closed nor dead."""
        return not self._closed and self._dead is None and self._thread.is_alive()

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def close(self) -> None:
        """Take no more jobs, finish the queued ones, and wait for the
        thread to end (not if it was abandoned). Safe to call again."""
        self._stop()
        if not self._abandoned and self._thread is not threading.current_thread():
            self._thread.join()

    def abandon(self) -> None:
        """Take no more jobs and stop waiting for this thread: the job in
        flight (a hung step) keeps its thread until it returns, after which
        the thread ends on its own. ``close()`` then returns at once."""
        self._abandoned = True
        self._stop()

    def _stop(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(_STOP)

    def fresh(self) -> StepThread:
        """A new step thread with the same settings (to replace this one)."""
        return StepThread(self.num_threads, name=self.name)

    def __enter__(self) -> StepThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
