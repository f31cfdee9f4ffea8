"""Awaiting work on an engine's ``StepThread`` from trio."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from trioserve.engine.runtime.step_thread import StepThread

T = TypeVar("T")


async def run_in_step_thread(
    step_thread: StepThread, fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False
) -> T:
    """Run ``fn(*args)`` on ``step_thread`` and return its result.

    Like ``trio.to_thread.run_sync``: by default, once queued, the call is
    not cancellable, because a step writes the KV cache and its effects must
    be known before anyone goes on. With ``abandon_on_cancel`` a cancel
    returns at once and leaves the job to finish unobserved: only for a
    caller that has made sure nothing depends on it (the executor's watchdog
    does, for a hung step). The event loop keeps running while it waits.
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    abandoned = False

    def wake(result: outcome.Outcome[T]) -> None:
        if not abandoned:
            trio.lowlevel.reschedule(task, result)

    def deliver(future: concurrent.futures.Future[T]) -> None:
        # Runs on the step thread (or here, if the future is already done);
        # run_sync_soon hands the result to the event loop either way.
        try:
            token.run_sync_soon(wake, outcome.capture(future.result))
        except trio.RunFinishedError:
            pass  # an abandoned job that outlived the event loop

    def abort(_: Any) -> trio.lowlevel.Abort:
        nonlocal abandoned
        if not abandon_on_cancel:
            return trio.lowlevel.Abort.FAILED
        abandoned = True
        return trio.lowlevel.Abort.SUCCEEDED

    step_thread.submit(fn, *args).add_done_callback(deliver)
    # Returns the outcome's value, or raises its exception.
    return await trio.lowlevel.wait_task_rescheduled(abort)
