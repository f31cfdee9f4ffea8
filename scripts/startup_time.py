"""Seconds from a server's start to its /health answering 200, on loopback.

    python scripts/startup_time.py [--runs N] [--fresh-cache] -- COMMAND ... {port}

runs COMMAND (``{port}`` replaced by a free port) ``--runs`` times (with
``--fresh-cache``, each with ``TRIOSERVE_CACHE`` an empty temporary
folder, removed after: every run a first start), polls
``http://127.0.0.1:PORT/health`` every 20 ms until it answers 200, then
stops the server (SIGTERM, SIGKILL after 10 s) and prints one JSON line a
run: the seconds to ready, and the server's peak RSS and CPU seconds
(``wait4``'s, its own and its waited children's). The load average is
printed with each run: on a shared machine it says how far to trust them.
Used for docs/benchmarks.md, "Start-up" (llama-server against trioserve serve);
where a start's time goes, and how it was measured: docs/performance.md,
"Start-up: where the time goes". A first start also runs the capability
trials, whose results are then kept beside the native builds
(engine/kernels/trial_cache.py): ``--fresh-cache`` turns that keeping off
(``TRIOSERVE_CPU_TRIALS_CACHE=0``), so it measures both.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(command: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, object]:
    port = free_port()
    argv = [part.replace("{port}", str(port)) for part in command]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    process = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env
    )
    ready, usage = None, None

    def reaped() -> bool:
        nonlocal usage
        pid, _, got = os.wait4(process.pid, os.WNOHANG)
        if pid:
            usage = got
        return bool(pid)

    try:
        while time.perf_counter() - start < timeout and not reaped():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                    if answer.status == 200:
                        ready = time.perf_counter() - start
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.02)
    finally:
        if usage is None:
            os.killpg(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not reaped():
                time.sleep(0.05)
            if usage is None:
                os.killpg(process.pid, signal.SIGKILL)
                usage = os.wait4(process.pid, 0)[2]
    return {
        "command": " ".join(argv), "ready_s": None if ready is None else round(ready, 2), "load_average_1m": load,
        "peak_rss_mib": round(usage.ru_maxrss / 1024), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--fresh-cache", action="store_true",
                        help="each run with an empty TRIOSERVE_CACHE and the capability trials run")  # fmt: skip
    parser.add_argument("command", nargs="+")
    args = parser.parse_args()
    for _ in range(args.runs):
        if not args.fresh_cache:
            print(json.dumps(one_run(args.command, args.timeout)), flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix="startup-cache-") as cache:
            fresh = {**os.environ, "TRIOSERVE_CACHE": cache, "TRIOSERVE_CPU_TRIALS_CACHE": "0"}
            result = one_run(args.command, args.timeout, fresh)
        print(json.dumps({**result, "fresh_cache": True}), flush=True)


if __name__ == "__main__":
    main()
