"""Resident memory, read from /proc (Linux): the one place the benchmarks,
the soak and the tests read it.

``rss_bytes`` is one process's ``VmRSS``; ``tree_memory`` sums ``VmRSS``,
``VmHWM``, ``RssAnon`` and ``RssFile`` over a process and every process
below it (a server's worker processes, llama-server's children).
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs


def parse_proc_status(text: str) -> dict[str, int]:
    """The ``kB`` fields of a /proc/PID/status text, in bytes."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            values[key] = int(parts[0]) * 1024
    return values


def rss_bytes(pid: int | None = None) -> int:
    """The resident memory (``VmRSS``) of process ``pid``, this one by
    default, in bytes."""
    status = parse_proc_status(Path(f"/proc/{os.getpid() if pid is None else pid}/status").read_text())
    if "VmRSS" not in status:
        raise ProcessLookupError(f"no VmRSS for process {pid}")  # a zombie has none
    return status["VmRSS"]


@attrs.frozen
class Memory:
    """Resident memory of a process and its descendants, in bytes, summed
    over the processes (``hwm``: the sum of each one's peak)."""

    rss: int
    hwm: int
    rss_anon: int
    rss_file: int
    processes: int

    def to_json(self) -> dict:
        return {**attrs.asdict(self), "rss_mib": self.rss / 2**20, "hwm_mib": self.hwm / 2**20}


def parent_pid(stat_text: str) -> int:
    """The parent's pid from a /proc/PID/stat text (the name may hold
    spaces and parentheses, so fields are counted from the last ``)``)."""
    return int(stat_text.rpartition(")")[2].split()[1])


def process_tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """``pid`` and every process below it, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                ppid = parent_pid((entry / "stat").read_text())
            except (OSError, IndexError, ValueError):
                continue  # exited while we looked
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, ()))
    return tree


def tree_memory(pid: int, proc: Path = Path("/proc")) -> Memory:
    """VmRSS, VmHWM, RssAnon and RssFile of ``pid``'s process tree."""
    totals = {"VmRSS": 0, "VmHWM": 0, "RssAnon": 0, "RssFile": 0}
    count = 0
    for member in process_tree(pid, proc):
        try:
            status = parse_proc_status((proc / str(member) / "status").read_text())
        except OSError:
            continue
        count += 1
        for key in totals:
            totals[key] += status.get(key, 0)
    if count == 0:
        raise ProcessLookupError(f"no process {pid}")
    return Memory(totals["VmRSS"], totals["VmHWM"], totals["RssAnon"], totals["RssFile"], count)
