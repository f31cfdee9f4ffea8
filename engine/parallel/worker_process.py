"""The model step in a worker process: its synchronous loop, and the frames it speaks.

With ``EngineConfig.worker_mode == "process"`` the executor actor
(``trioserve.actors.process_executor``) starts ``worker_main`` in a process
of its own (``torch.multiprocessing``, spawn). The worker builds its model
runner from a ``WorkerSpec`` (the engine config, the pool's size, and how to
get the model), so the weights and the KV tensors live only there, then
answers step plans until it is told to stop.

The protocol is the executor's own, serialised: each frame is an 8-byte
big-endian length and a pickle. In: ``StepPlan`` values (immutable, made to
travel), each plan that ``awaits_mask`` followed by its ``TokenMask`` (read
after the forward, which runs while the server fills it), and a final
``StopWorker`` (the poison pill, also taken in a mask's place). Out: one
``WorkerReady`` once the runner is built (or a ``WorkerStartFailed``), then
for each plan its ``RunnerOutput`` or a ``WorkerStepError``.

The worker dies with its parent: the end of its socket (the parent closed
it, or died) ends its loop, and on Linux ``PR_SET_PDEATHSIG`` kills it if
the parent is killed while a step computes. A dead worker is the parent's
business: its requests recompute on the restarted one.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable
from typing import Any

import attrs

from trioserve.engine.config import EngineConfig
from trioserve.engine.loading.loader import LoadedModel, load_model_for
from trioserve.engine.runtime.build import build_runner
from trioserve.engine.models.projections import ProjectionChoice
from trioserve.engine.runtime.step_plan import StepPlan
from trioserve.engine.sampling.rows import TokenMask

log = logging.getLogger(__name__)

HEADER = struct.Struct(">Q")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@attrs.frozen
class WorkerSpec:
    """What a worker process needs to build its runner, all picklable.

    ``num_blocks``: the KV pool's size, as the server's allocator has it.
    ``model``: a picklable callable returning the ``LoadedModel`` to run
    (a module-level function, or a ``functools.partial`` of one); None
    loads ``config.model`` with its dtype and device. ``parent_pid``: the
    process that must be alive for the worker to run. ``cpus``: the CPUs
    the worker is pinned to (a data-parallel replica's share), None: not
    pinned.
    """

    config: EngineConfig
    num_blocks: int
    parent_pid: int
    model: Callable[[], LoadedModel] | None = None
    cpus: frozenset[int] | None = None


@attrs.frozen
class StopWorker:
    """The poison pill: finish, close, exit 0."""


@attrs.frozen
class WorkerReady:
    """The runner is built; the worker takes plans. ``projection_choice``:
    how the model the worker loaded runs its projections (the kernels
    whose trials passed there, which the server, holding no weights,
    cannot know)."""

    pid: int
    projection_choice: ProjectionChoice | None = None


@attrs.frozen
class WorkerStartFailed:
    """Building the runner raised; the worker exits. ``error`` is the
    exception when it pickles, else a ``RuntimeError`` with its text."""

    error: BaseException


@attrs.frozen
class WorkerStepError:
    """A step raised (the worker goes on). ``error`` as in ``WorkerStartFailed``."""

    error: BaseException
    traceback: str


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a ``RuntimeError`` naming it."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def encode(message: Any) -> bytes:
    """One frame: the length, then the pickle."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


def send_frame(sock: socket.socket, message: Any) -> None:
    sock.sendall(encode(message))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    parts, remaining = [], size
    while remaining:
        part = sock.recv(min(remaining, 1 << 20))
        if not part:
            raise EOFError("the other end closed the worker's socket")
        parts.append(part)
        remaining -= len(part)
    return b"".join(parts)


def recv_frame(sock: socket.socket) -> Any:
    """The next message; ``EOFError`` at the end of the stream."""
    (size,) = HEADER.unpack(_recv_exactly(sock, HEADER.size))
    return pickle.loads(_recv_exactly(sock, size))


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux), and
    exit now if the parent is gone already (it may have died before the
    request was made)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    if os.getppid() != parent_pid:
        os._exit(1)


def _build(spec: WorkerSpec) -> tuple[Any, ProjectionChoice]:
    """The model runner, and how its model runs its projections."""
    config = spec.config
    if spec.cpus is not None:
        os.sched_setaffinity(0, spec.cpus)
    if config.num_threads is not None:
        import torch

        torch.set_num_threads(config.num_threads)
    if spec.model is None:
        loaded = load_model_for(config)
    else:
        loaded = spec.model()
    return build_runner(loaded, config, spec.num_blocks), loaded.projection_choice


def _masked_step(runner: Any, plan: StepPlan, sock: socket.socket) -> Any:
    """Run ``plan``'s forward, then read its mask (the next frame: the
    server filled it meanwhile) and sample; None if ``StopWorker`` came
    instead. The mask is read even when the forward raised, so the next
    frame is a plan again."""
    try:
        step = runner.forward_step(plan)
        error = None
    except Exception as exc:
        step, error = None, exc
    mask = recv_frame(sock)
    if isinstance(mask, StopWorker):
        return None
    assert isinstance(mask, TokenMask), f"unexpected message {type(mask).__name__}"
    if error is not None:
        raise error
    return runner.sample_step(step, mask)


def worker_main(spec: WorkerSpec, sock: socket.socket) -> None:
    """The worker process: build the runner, then run each plan received on
    ``sock`` until ``StopWorker`` or the end of the stream."""
    die_with_parent(spec.parent_pid)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s worker %(process)d %(name)s: %(message)s")
    # SIGINT goes to the whole foreground group: the server decides when its
    # worker stops (the stop message), so a Ctrl-C must not kill a step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with sock:
        try:
            runner, projection_choice = _build(spec)
        except Exception as exc:
            log.error("cannot build the model runner: %s", exc)
            send_frame(sock, WorkerStartFailed(portable(exc)))
            return
        send_frame(sock, WorkerReady(os.getpid(), projection_choice))
        while True:
            try:
                message = recv_frame(sock)
            except (EOFError, ConnectionError):
                return  # the server closed its end or died: nothing to answer
            if isinstance(message, StopWorker):
                return
            assert isinstance(message, StepPlan), f"unexpected message {type(message).__name__}"
            try:
                if message.awaits_mask:
                    reply: Any = _masked_step(runner, message, sock)
                    if reply is None:
                        return  # told to stop instead of sent the mask
                else:
                    reply = runner.execute(message)
            except (EOFError, ConnectionError):
                return  # the server closed its end (or died) before the mask
            except Exception as exc:
                reply = WorkerStepError(portable(exc), traceback.format_exc())
            try:
                send_frame(sock, reply)
            except (BrokenPipeError, ConnectionError):
                return
