"""Rendezvous of a tensor-parallel group on ``torch.distributed``.

Every rank calls ``init_group(Rendezvous, rank)``: a TCP rendezvous at
``master_addr:master_port`` (the first rank hosts the store there), gloo on
CPU and NCCL on CUDA. Nothing here is home-made: the store, the process
group and the collectives are torch's. What this module adds is the
failure behaviour a server needs at start:

- a rank that is not the first checks first that the master's port answers,
  retrying until ``timeout``, so an unreachable address is a
  ``DistributedError`` naming it, not a hang;
- ``init_process_group`` gets the same ``timeout``, so a rank that never
  joins ends the wait with an error naming the address and the world size.

The command line takes torchrun's ``MASTER_ADDR`` and ``MASTER_PORT`` as
the defaults of ``--master-addr`` and ``--master-port``.
"""

from __future__ import annotations

import datetime
import socket
import time

import attrs
import torch
import torch.distributed as dist

from trioserve.engine.errors import TrioserveError
from trioserve.engine.validators import integer_at_least, positive

DEFAULT_TIMEOUT = 120.0
LOCALHOST = "127.0.0.1"


class DistributedError(TrioserveError):
    """The tensor-parallel group could not be formed (or lost a rank)."""


def _port(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
        raise ValueError(f"{attribute.name} must be a TCP port in [1, 65535], got {value!r}")


@attrs.frozen(kw_only=True)
class Rendezvous:
    """Where and how the ranks of one group meet.

    ``world_size`` ranks in all, ``nnodes`` machines with
    ``world_size // nnodes`` ranks each; node ``n`` holds ranks
    ``n * ranks_per_node`` on. ``timeout``: seconds to wait for the master's
    port and for every rank to join (and for any collective later).
    """

    world_size: int = attrs.field(validator=integer_at_least(1))
    master_addr: str = LOCALHOST
    master_port: int = attrs.field(validator=_port)
    nnodes: int = attrs.field(default=1, validator=integer_at_least(1))
    backend: str = attrs.field(default="gloo", validator=attrs.validators.in_(("gloo", "nccl")))
    timeout: float = attrs.field(default=DEFAULT_TIMEOUT, validator=positive)

    def __attrs_post_init__(self) -> None:
        if self.world_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size ({self.world_size}) must be a multiple of nnodes ({self.nnodes}): "
                f"every machine runs the same number of ranks"
            )

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node_rank: int) -> range:
        """The global ranks machine ``node_rank`` runs."""
        if not 0 <= node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {node_rank!r}")
        return range(node_rank * self.ranks_per_node, (node_rank + 1) * self.ranks_per_node)

    @property
    def address(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port free on ``host`` now, for a rendezvous on one machine."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_reachable(host: str, port: int, timeout: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; retry until
    ``timeout`` seconds, then raise ``DistributedError`` naming it."""
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DistributedError(
                f"the tensor-parallel master {host}:{port} did not answer within {timeout:g} s "
                f"({last.strerror if last is not None and last.strerror else last}); check --master-addr/--master-port "
                f"and that node 0 is running"
            )
        try:
            with socket.create_connection((host, port), timeout=min(left, 2.0)):
                return
        except OSError as exc:
            last = exc
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def init_group(rendezvous: Rendezvous, rank: int) -> None:
    """Join the default process group as ``rank``. Raises
    ``DistributedError`` naming the address when the master cannot be
    reached or the ranks do not all join within ``rendezvous.timeout``."""
    if not 0 <= rank < rendezvous.world_size:
        raise ValueError(f"rank must be in [0, {rendezvous.world_size}), got {rank!r}")
    host, port = rendezvous.master_addr, rendezvous.master_port
    start = time.monotonic()
    if rank != 0:
        wait_reachable(host, port, rendezvous.timeout)
    left = max(1.0, rendezvous.timeout - (time.monotonic() - start))
    try:
        dist.init_process_group(
            backend=rendezvous.backend,
            init_method=f"tcp://{host}:{port}",
            world_size=rendezvous.world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=left),
        )
    except (RuntimeError, ValueError, OSError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
        if not dist.is_initialized():
            # A failed rendezvous has used up a group name: torch numbers the
            # default group by a count it resets only when a default group is
            # destroyed, so this process's next attempt would name its group
            # unlike the other ranks' and wait for them forever.
            dist.distributed_c10d._world.group_count = 0
        raise DistributedError(
            f"rank {rank} of {rendezvous.world_size}: the rendezvous at {host}:{port} failed within "
            f"{rendezvous.timeout:g} s ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None


def close_group() -> None:
    """Leave the default process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def backend_for(device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"
