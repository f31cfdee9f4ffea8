"""A trioserve server in a process of its own, as the benchmark and soak
scripts run it: a free loopback port, the server started and stopped
(``serving_process``), and the process's resident memory and open file
descriptors read from /proc (Linux)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

# Seconds a server may take to answer /health: a cold start converts the GGUF.
READY_TIMEOUT = 300.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid``, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    """How many file descriptors process ``pid`` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def serving_process(flags: Sequence[str], log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``trioserve serve`` (beside this interpreter) with ``flags`` on a free
    loopback port, its output in ``log``: yields its URL and process once
    ``/health`` answers 200, and stops it with SIGTERM (SIGKILL after a
    minute) when the block ends, on an error too."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "trioserve"), "serve", "--port", str(port)]
    with open(log, "w") as log_file:
        proc = subprocess.Popen([*command, "--shutdown-timeout", "5", *flags], stdout=log_file, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + READY_TIMEOUT
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not become ready in {READY_TIMEOUT:g} s; see {log}")
                time.sleep(0.5)  # a script polling a child process, not a test
            yield url, proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
