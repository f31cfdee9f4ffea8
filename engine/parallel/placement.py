"""Where each data-parallel replica runs: its device, and on CPU its cores.

``plan_replicas(config)`` turns ``data_parallel_size`` into one
``ReplicaPlacement`` per replica, and refuses, before anything is loaded, a
layout the machine cannot give:

- on CUDA replica ``i`` runs on ``cuda:(k + i)``, where ``k`` is the
  configured device's index (0 for ``"cuda"``); more replicas than devices
  from ``k`` on is a ``ParallelConfigError``;
- on CPU the cores this process may use (``os.sched_getaffinity``, never an
  assumed count) are split into contiguous, near-equal shares, one per
  replica. A replica's step thread is pinned to its share (``pin_thread``;
  the OpenMP threads it starts inherit the mask), and its torch thread count
  is ``num_threads`` when given (per replica), else the size of its share.
  With fewer cores than replicas, replicas share cores round-robin (slow,
  and logged).

One replica keeps today's behaviour: no pinning, the configured device and
thread count as they are.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection

import attrs
import torch

from trioserve.engine.config import EngineConfig
from trioserve.engine.errors import TrioserveError
from trioserve.engine.runtime.step_thread import StepThread

log = logging.getLogger(__name__)


class ParallelConfigError(TrioserveError, ValueError):
    """A parallel layout this machine cannot run (it names the field)."""


@attrs.frozen
class ReplicaPlacement:
    """One replica's device and, on CPU, its cores and torch threads."""

    index: int
    device: str | None  # as EngineConfig.device: None is the default device
    cpus: frozenset[int] | None  # the step thread's CPU affinity; None: not pinned
    num_threads: int | None  # torch threads of its step; None: torch's default

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        """``config`` as this replica runs it: its device and thread count."""
        return attrs.evolve(config, device=self.device, num_threads=self.num_threads)


def _device_type(device: str | None) -> tuple[str, int | None]:
    if device is None:
        return ("cuda", None) if torch.cuda.is_available() else ("cpu", None)
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ParallelConfigError(f"device {device!r} is not a torch device (try 'cpu', 'cuda' or 'cuda:1')") from None
    return resolved.type, resolved.index


def cpu_shares(cpus: Collection[int], count: int) -> list[frozenset[int]]:
    """``cpus`` split into ``count`` contiguous shares of near-equal size
    (the first ones one larger); with fewer cpus than shares, one cpu each,
    round-robin."""
    if count < 1:
        raise ValueError("count must be >= 1")
    ordered = sorted(cpus)
    if not ordered:
        raise ValueError("cpus must not be empty")
    if len(ordered) < count:
        return [frozenset({ordered[i % len(ordered)]}) for i in range(count)]
    base, extra = divmod(len(ordered), count)
    shares, start = [], 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        shares.append(frozenset(ordered[start : start + size]))
        start += size
    return shares


def available_cpus() -> frozenset[int]:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def plan_replicas(
    config: EngineConfig, *, cuda_device_count: int | None = None, cpus: Collection[int] | None = None
) -> tuple[ReplicaPlacement, ...]:
    """One placement per replica of ``config`` (see the module docstring).
    ``cuda_device_count`` and ``cpus`` default to this machine's."""
    size = config.data_parallel_size
    kind, index = _device_type(config.device)
    if kind == "cuda":
        count = torch.cuda.device_count() if cuda_device_count is None else cuda_device_count
        first = index or 0
        if first + size > count:
            wanted = f"cuda:{first}" if size == 1 else f"cuda:{first}..cuda:{first + size - 1}"
            raise ParallelConfigError(
                f"data_parallel_size={size} needs {size} CUDA device(s) ({wanted}), "
                f"but this machine has {count}; lower --data-parallel-size"
            )
        if size == 1:
            return (ReplicaPlacement(0, config.device, None, config.num_threads),)
        return tuple(ReplicaPlacement(i, f"cuda:{first + i}", None, config.num_threads) for i in range(size))
    if kind != "cpu":
        raise ParallelConfigError(f"device {config.device!r}: only 'cpu' and 'cuda' devices are supported")
    if size == 1:
        return (ReplicaPlacement(0, config.device, None, config.num_threads),)
    mine = available_cpus() if cpus is None else frozenset(cpus)
    shares = cpu_shares(mine, size)
    if len(mine) < size:
        log.warning(
            "data_parallel_size=%d on %d CPU core(s): replicas share cores and will be slower than fewer replicas",
            size,
            len(mine),
        )
    return tuple(
        ReplicaPlacement(i, config.device, share, config.num_threads or len(share)) for i, share in enumerate(shares)
    )


def pin_thread(cpus: Collection[int] | None) -> None:
    """Pin the calling thread to ``cpus`` (Linux: affinity is per thread, and
    threads it starts later inherit it); nothing where the OS cannot."""
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


class PinnedStepThread(StepThread):
    """A ``StepThread`` that pins itself to ``cpus`` before its first job, so
    the OpenMP team it starts runs on those cores only; the thread that
    replaces it (``fresh``, after a hung step) is pinned the same way."""

    def __init__(self, num_threads: int | None, cpus: frozenset[int] | None, *, name: str = "trioserve-step") -> None:
        self.cpus = cpus  # before the thread starts: _main reads it
        super().__init__(num_threads, name=name)

    def _main(self) -> None:
        try:
            pin_thread(self.cpus)
        except OSError as exc:  # a core taken away since the plan: run unpinned rather than not at all
            log.warning("%s: cannot pin to CPUs %s (%s); running unpinned", self.name, sorted(self.cpus or ()), exc)
        super()._main()

    def fresh(self) -> PinnedStepThread:
        return PinnedStepThread(self.num_threads, self.cpus, name=self.name)
