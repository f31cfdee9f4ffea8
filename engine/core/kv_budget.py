"""How many blocks the KV pool gets, and why.

``EngineConfig.kv_cache_memory`` set: that many bytes (an ``int``) or that
fraction of the device's free memory (a ``float``). Unset on CPU: what is
asked, ``max_num_seqs`` contexts of ``max_model_len`` tokens at the cache
dtype's bytes per token, capped at ``CPU_MEMORY_FRACTION`` of the host's
available memory (the host is shared with everything else, so the pool
takes a part of what is left, not all of it) and at ``CPU_DEFAULT_CEILING``
(vLLM's CPU default budget too: a server started without flags should not
take gigabytes for contexts nobody sends; the ceiling gives way to one
full context), and never less than one full context: a pool that cannot hold one refuses requests the model
accepts, so that is an error naming what to lower. Unset on CUDA:
``CUDA_MEMORY_FRACTION`` of free memory, as vLLM does. The pool never needs
more than ``max_num_seqs`` full contexts, so every budget is capped there.

A model whose sliding-window layers keep a pool of their own
(engine/core/block_manager.py) is planned as if they did not, then
``split_for_window`` gives the bytes its small window pool leaves over to
more blocks of the other layers, up to the ``max_num_seqs`` full contexts:
the budget is the same, the contexts it holds are more.

``plan_pool`` is the arithmetic, a pure function; ``available_memory``
reads what the host has left (psutil when installed, else
``/proc/meminfo``'s ``MemAvailable``, within a cgroup v2 memory limit).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import attrs

CPU_MEMORY_FRACTION = 0.25
CPU_DEFAULT_CEILING = 4 << 30
CUDA_MEMORY_FRACTION = 0.8
_GIB = 1 << 30


def _size(nbytes: float) -> str:
    """``nbytes`` for a log line: in MiB below a GiB, else in GiB."""
    if nbytes < _GIB:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / _GIB:.2f} GiB"


@attrs.frozen
class KVPoolPlan:
    """The KV pool's size and the reason for it (logged at startup, shown in
    ``/version``). ``window_blocks``: the sliding-window layers' own pool
    (its null block included; 0 when they have none), of
    ``window_bytes_per_block`` each; ``bytes_per_block`` is then the other
    layers' bytes only."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    dtype: str
    reason: str
    window_blocks: int = 0
    window_bytes_per_block: int = 0

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.window_blocks * self.window_bytes_per_block

    def as_json(self) -> dict[str, object]:
        found: dict[str, object] = {
            "dtype": self.dtype,
            "tokens": self.tokens,
            "blocks": self.num_blocks,
            "block_size": self.block_size,
            "bytes": self.nbytes,
            "reason": self.reason,
        }
        if self.window_blocks:
            found["window_blocks"] = self.window_blocks
        return found

    def __str__(self) -> str:
        window = f" and {self.window_blocks} blocks of the sliding-window layers" if self.window_blocks else ""
        return (
            f"{self.tokens} tokens ({self.num_blocks} blocks{window}), {_size(self.nbytes)} in {self.dtype}: "
            f"{self.reason}"
        )


def plan_pool(
    budget: int | float | None,
    *,
    device_type: str,
    free_memory: int,
    bytes_per_block: int,
    block_size: int,
    blocks_per_sequence: int,
    max_num_seqs: int,
    dtype: str,
) -> KVPoolPlan:
    """The pool for ``kv_cache_memory=budget`` (see the module's docstring);
    ``free_memory`` is the device's free bytes (CUDA) or the host's
    available bytes (CPU). Raises ``ValueError`` for a budget smaller than
    one block, or a default CPU pool that cannot hold one full context."""
    assert bytes_per_block > 0 and block_size > 0 and blocks_per_sequence > 0 and max_num_seqs > 0
    wanted = max_num_seqs * blocks_per_sequence
    asked = f"{max_num_seqs} sequences x {blocks_per_sequence * block_size} tokens"

    def plan(num_blocks: int, reason: str) -> KVPoolPlan:
        return KVPoolPlan(num_blocks, block_size, bytes_per_block, dtype, reason)

    if budget is None and device_type == "cpu":
        cap = int(free_memory * CPU_MEMORY_FRACTION) // bytes_per_block
        of = f"{CPU_MEMORY_FRACTION:.0%} of the {_size(free_memory)} available"
        ceiling = max(CPU_DEFAULT_CEILING // bytes_per_block, blocks_per_sequence)
        if ceiling < cap:
            cap, of = ceiling, f"the {_size(CPU_DEFAULT_CEILING)} default ceiling"
        if cap < blocks_per_sequence:
            raise ValueError(
                f"the default KV pool, {of} ({_size(cap * bytes_per_block)}), cannot hold one max_model_len context "
                f"({blocks_per_sequence * block_size} tokens, {_size(blocks_per_sequence * bytes_per_block)} in {dtype}); "
                "lower max_model_len, or set kv_cache_memory"
            )
        if wanted <= cap:
            return plan(wanted, f"as asked, {asked} (within {of})")
        return plan(cap, f"{asked} asked, capped at {of}")
    if budget is None:
        budget = CUDA_MEMORY_FRACTION
    if isinstance(budget, float):
        nbytes = int(free_memory * budget)
        given = f"kv_cache_memory {budget:g} of the {_size(free_memory)} free"
    else:
        nbytes = budget
        given = f"kv_cache_memory {_size(budget)}"
    blocks = nbytes // bytes_per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory ({budget!r}) is smaller than one KV block ({bytes_per_block} bytes)")
    if blocks >= wanted:
        return plan(wanted, f"{asked}, as asked (within {given})")
    return plan(blocks, given)


def split_for_window(
    plan: KVPoolPlan,
    *,
    full_bytes_per_block: int,
    window_blocks: Callable[[int], int],
    wanted: int,
) -> KVPoolPlan:
    """``plan`` (every layer in each block) with the sliding-window layers
    in a pool of their own: ``window_blocks(n)`` blocks beside ``n`` of the
    other layers, whose blocks take ``full_bytes_per_block`` (0 when every
    layer slides). ``n`` grows into the bytes the window pool leaves of the
    plan's, up to ``wanted``; it never shrinks (the window pool then takes
    at most the plan's sliding bytes, plus its null block)."""
    window_bytes = plan.bytes_per_block - full_bytes_per_block
    assert window_bytes > 0 and wanted > 0
    budget = plan.nbytes
    num_blocks = plan.num_blocks
    if plan.num_blocks < wanted:
        # window_blocks grows with n: priced at ``wanted``, the answer fits.
        left = budget - window_blocks(wanted) * window_bytes
        if full_bytes_per_block == 0:
            grown = wanted if left >= 0 else num_blocks
        else:
            grown = min(wanted, max(0, left) // full_bytes_per_block)
        num_blocks = max(num_blocks, grown)
    reason = plan.reason
    if num_blocks > plan.num_blocks:
        reason += f"; {num_blocks - plan.num_blocks} blocks more, from the bytes the sliding-window layers' pool leaves"
    return attrs.evolve(
        plan,
        num_blocks=num_blocks,
        bytes_per_block=full_bytes_per_block,
        reason=reason,
        window_blocks=window_blocks(num_blocks),
        window_bytes_per_block=window_bytes,
    )


def available_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes the host can still give this process without swapping: psutil's
    ``available`` when installed, else ``MemAvailable`` from ``/proc/meminfo``
    (else free pages), and no more than a cgroup v2 limit leaves."""
    try:
        import psutil  # optional: the same figure, on more systems

        available = int(psutil.virtual_memory().available)
    except ImportError:
        available = _meminfo_available(proc / "meminfo")
    headroom = _cgroup_headroom(cgroup / _own_cgroup(proc / "self" / "cgroup"))
    return available if headroom is None else min(available, headroom)


def _meminfo_available(meminfo: Path) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _own_cgroup(table: Path) -> str:
    """This process's cgroup v2 path, relative (``0::/a/b`` -> ``a/b``; "" when unknown)."""
    try:
        for line in table.read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].strip().lstrip("/")
    except OSError:
        pass
    return ""


def _cgroup_headroom(cgroup: Path) -> int | None:
    """What a cgroup v2 memory limit leaves (None: no limit, or no cgroup v2)."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((cgroup / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None
