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

``StepThread`` is a ``concurrent.futures`` executor with one worker that
sets torch's thread count once, at its start.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


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
    the job in flight.
    """

    def __init__(self, num_threads: int | None = None, *, name: str = "trioserve-step") -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=_init_worker, initargs=(num_threads,)
        )

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)``; its future completes on the step thread."""
        return self._pool.submit(fn, *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the step thread and wait for it here;
        exceptions propagate."""
        return self.submit(fn, *args).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> StepThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
