"""A trioserve server in a process of its own, as the benchmarks, the soak
and the tests run it: a free loopback port, the server started and stopped
(``serving_process``; any server's command: ``running``), and its open
file descriptors read from /proc (Linux). Its resident memory is
``memory``'s, its ``/metrics`` ``scrape``'s."""

from __future__ import annotations

import contextlib
import os
import shlex
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
# The trioserve command of this interpreter's environment.
TRIOSERVE = Path(sys.executable).parent / "trioserve"


class ServerStartError(RuntimeError):
    """The server exited, or did not answer ``/health``, before it was ready."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_fds(pid: int) -> int:
    """How many file descriptors process ``pid`` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, *, name: str = "the server", see: str = "") -> None:
    """Return once ``url``/health answers 200; ``ServerStartError`` (naming
    ``name``, then ``see``) if ``proc`` exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerStartError(f"{name} exited with {proc.returncode}{see}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise ServerStartError(f"{name} did not become ready in {timeout:g} s{see}")
        time.sleep(0.5)  # a script polling a child process, not a test


@contextlib.contextmanager
def serving_process(flags: Sequence[str], log: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``trioserve serve`` (beside this interpreter) with ``flags`` on a free
    loopback port, its output in ``log`` (None: discarded): yields its URL
    and process once ``/health`` answers 200 (``ServerStartError`` if it
    exits or takes over ``READY_TIMEOUT`` first), and stops it with SIGTERM
    (SIGKILL after a minute) when the block ends, on an error too. The block
    may stop the process itself, to see its exit status."""
    port = free_port()
    command = [str(TRIOSERVE), "serve", "--port", str(port)]
    see = f"; see {log}" if log is not None else ""
    with open(log, "w") if log is not None else contextlib.nullcontext(subprocess.DEVNULL) as output:
        proc = subprocess.Popen([*command, "--shutdown-timeout", "5", *flags], stdout=output, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, url, READY_TIMEOUT, see=see)
            yield url, proc
        finally:
            proc.send_signal(signal.SIGTERM)  # nothing, if the block already stopped it
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def running(command: Sequence[str], url: str, log: Path, ready_timeout: float) -> Iterator[subprocess.Popen]:
    """Run any server's ``command`` (trioserve's, llama-server's) in a
    session of its own, its output in ``log``; yield it once ``url``/health
    answers 200 (``ServerStartError`` if it exits or takes over
    ``ready_timeout`` seconds first), and stop the whole session, what the
    server started included (SIGTERM, then SIGKILL after 30 s), when the
    block ends, on an error too."""
    with open(log, "w") as output:
        print("$", shlex.join(command), flush=True)
        proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(proc, url, ready_timeout, name=Path(command[0]).name, see=f"; see {log}")
            yield proc
        finally:
            _stop_session(proc)


def _stop_session(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # the server and anything it started
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # Children that outlived the leader are still in its process group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
