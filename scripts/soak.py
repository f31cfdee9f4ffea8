"""Soak: serve the default model for a while under a mixed load and watch for leaks.

    .venv/bin/python scripts/soak.py --minutes 30 [--concurrency 6] [--json soak.json] [--log server.log]
                                     [-- <trioserve serve options>]

The soak starts ``trioserve serve`` on a free loopback port (a subprocess,
stopped at the end, on failure too) and drives it with ``--concurrency``
clients, each sending one request after another: streaming and not, chat
and plain completions, ``n`` of 1 to 3, prompts of 3 to 150 words, 4 to 64
tokens, some with a short deadline, some hung up on mid-stream. Every minute
it prints the server's resident memory, open file descriptors and trio task
count, and the minute's request latencies (p50, p99) and time to first
token (p99), percentiles as ``trioserve bench`` computes them
(``trioserve.bench.stats``).

It exits 1 if the server died, any request failed (a 5xx, an error event, a
broken connection; 429 counts as refused, not failed), or a leak check
fails:

- resident memory at the last minute more than max(64 MiB, 10 %) above
  its value at the middle of the run (minute ceil(N / 2); minute 1 for a
  2-minute run). The first half is the warm-up: the allocator's arenas
  grow to the load's working set (oneDNN's kernels for every batch size
  are built before the server is ready: ``EngineConfig.warm_up``); a leak
  keeps growing after that;
- once the load stops and the engine is idle: the task count not back to
  its value before the load, more open file descriptors than before the
  load (2 of slack), or KV-cache blocks still in use;
- the server not exiting with status 0 within a minute of SIGTERM.

Everything here talks only to 127.0.0.1. What a client that stops reading
costs the others is measured by ``trioserve bench slow-reader``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from trioserve.bench.datasets import random_words
from trioserve.bench.memory import rss_bytes
from trioserve.bench.process import ServerStartError, open_fds, serving_process
from trioserve.bench.scrape import KV_USAGE, wait_idle
from trioserve.bench.stats import percentile

MIB = 1 << 20


# -- the server ------------------------------------------------------------------


class SoakFailed(Exception):
    pass


def check_alive(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        raise SoakFailed(f"the server died with status {proc.returncode}")


async def server_tasks(url: str) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return (await http.get("/health")).json()["tasks"]


# -- the mixed load ---------------------------------------------------------------


@attrs.define
class Window:
    """What finished in one minute."""

    latencies: list[float] = attrs.field(factory=list)
    ttfts: list[float] = attrs.field(factory=list)
    ok: int = 0
    refused: int = 0
    disconnected: int = 0
    timed_out: int = 0
    failed: int = 0
    errors: list[str] = attrs.field(factory=list)


def percentile_or_nan(values: list[float], p: float) -> float:
    """``stats.percentile``; NaN for a minute in which nothing finished."""
    return percentile(values, p) if values else math.nan


def draw_request(rng: random.Random) -> tuple[str, dict[str, Any], int | None]:
    """A path, a body, and after how many events to hang up (None: never)."""
    stream = rng.random() < 0.7
    chat = rng.random() < 0.3
    prompt = random_words(rng, int(rng.choice([3, 10, 40, 150]) * rng.uniform(0.7, 1.0)))
    body: dict[str, Any] = {
        "max_tokens": rng.choice([4, 8, 16, 32, 64]),
        "n": rng.choice([1, 1, 1, 2, 3]),
        "temperature": rng.choice([0.0, 0.7]),
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.1:
        body["timeout"] = rng.uniform(0.3, 3.0)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    hang_up = rng.randint(1, 6) if stream and rng.random() < 0.1 else None
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, hang_up


async def one_request(http: httpx.AsyncClient, rng: random.Random, window_of) -> None:
    path, body, hang_up = draw_request(rng)
    start = trio.current_time()
    first: float | None = None
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code == 429:
                await response.aread()
                window_of().refused += 1
                await trio.sleep(min(2.0, float(response.headers.get("Retry-After", 1))))
                return
            if response.status_code == 504:  # a non-streaming request past its deadline
                await response.aread()
                window_of().timed_out += 1
                return
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                raise SoakFailed(f"{response.status_code} from {path}: {text}")
            if not body["stream"]:
                await response.aread()
                payload = response.json()
                reasons = {c["finish_reason"] for c in payload["choices"]}
            else:
                reasons, events = set(), 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise SoakFailed(f"error event from {path}: {event['error']}")
                    events += 1
                    if first is None and event.get("choices"):
                        first = trio.current_time() - start
                    reasons |= {c["finish_reason"] for c in event["choices"] if c.get("finish_reason")}
                    if hang_up is not None and events >= hang_up:
                        window_of().disconnected += 1
                        return
        window = window_of()
        if "timeout" in reasons:
            window.timed_out += 1
            return
        window.ok += 1
        window.latencies.append(trio.current_time() - start)
        if first is not None:
            window.ttfts.append(first)
    except (SoakFailed, httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        window = window_of()
        window.failed += 1
        window.errors.append(f"{type(exc).__name__}: {exc}"[:300])


async def soak(url: str, proc: subprocess.Popen[bytes], args: argparse.Namespace) -> int:
    """Run the load against the server at ``url`` (process ``proc``), check
    for leaks, stop the server; the script's exit status."""
    rng = random.Random(args.seed)
    pid = proc.pid
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:  # warm up
        await http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 4})
    idle_tasks = await server_tasks(url)
    idle_fds = open_fds(pid)
    print(f"server pid {pid} at {url}; idle before the load: {idle_tasks} tasks, {idle_fds} fds", flush=True)
    header = "| minute | requests ok | refused | hung up | timed out | failed | p50 s | p99 s | TTFT p99 s | RSS MiB | fds | tasks |"
    print(header + "\n|" + "---|" * (header.count("|") - 1), flush=True)
    windows = [Window()]
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    end = trio.current_time() + args.minutes * 60

    async def client(seed: int) -> None:
        client_rng = random.Random(seed)
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
            while trio.current_time() < end:
                await one_request(http, client_rng, lambda: windows[-1])

    async def sample(minute: int) -> None:
        window = windows[-1]
        windows.append(Window())
        check_alive(proc)
        row = {
            "minute": minute,
            "ok": window.ok,
            "refused": window.refused,
            "hung_up": window.disconnected,
            "timed_out": window.timed_out,
            "failed": window.failed,
            "p50_s": percentile_or_nan(window.latencies, 50),
            "p99_s": percentile_or_nan(window.latencies, 99),
            "ttft_p99_s": percentile_or_nan(window.ttfts, 99),
            "rss_mib": rss_bytes(pid) / MIB,
            "fds": open_fds(pid),
            "tasks": await server_tasks(url),
        }
        rows.append(row)
        failures.extend(window.errors)
        print(
            f"| {minute} | {row['ok']} | {row['refused']} | {row['hung_up']} | {row['timed_out']} | {row['failed']} "
            f"| {row['p50_s']:.2f} | {row['p99_s']:.2f} | {row['ttft_p99_s']:.2f} | {row['rss_mib']:.0f} "
            f"| {row['fds']} | {row['tasks']} |",
            flush=True,
        )
        for error in window.errors[:5]:
            print(f"  failed: {error}", flush=True)

    async with trio.open_nursery() as nursery:
        for i in range(args.concurrency):
            nursery.start_soon(client, rng.randrange(1 << 30))
        for minute in range(1, args.minutes + 1):
            await trio.sleep_until(end - (args.minutes - minute) * 60)
            await sample(minute)

    failures.extend(windows[-1].errors)  # requests that ended after the last sample
    # The load has stopped: every connection is closed. Idle figures.
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        idle = await wait_idle(http)
    with trio.move_on_after(30):  # closing connections takes the server a moment to see
        while (tasks_after := await server_tasks(url)) != idle_tasks or open_fds(pid) > idle_fds + 2:
            await trio.sleep(0.2)
    fds_after = open_fds(pid)
    print(
        f"idle after the load: {tasks_after} tasks, {fds_after} fds, KV usage {idle[KV_USAGE]:.3f}, "
        f"RSS {rss_bytes(pid) / MIB:.0f} MiB",
        flush=True,
    )

    checks = []
    middle = rows[math.ceil(len(rows) / 2) - 1]
    warm, last = middle["rss_mib"], rows[-1]["rss_mib"]
    allowed = max(64.0, 0.10 * warm)
    checks.append(
        (
            last - warm <= allowed,
            f"RSS grew {last - warm:+.0f} MiB from minute {middle['minute']} to {rows[-1]['minute']} (allowed {allowed:.0f}); "
            f"{last - rows[0]['rss_mib']:+.0f} MiB since minute 1",
        )
    )
    checks.append((tasks_after == idle_tasks, f"tasks when idle: {idle_tasks} before, {tasks_after} after"))
    checks.append((fds_after <= idle_fds + 2, f"open fds when idle: {idle_fds} before, {fds_after} after"))
    checks.append((idle[KV_USAGE] == 0, f"KV usage when idle: {idle[KV_USAGE]}"))
    checks.append((not failures, f"{len(failures)} failed requests"))
    check_alive(proc)
    proc.send_signal(signal.SIGTERM)
    try:
        status = await trio.to_thread.run_sync(lambda: proc.wait(timeout=60))
    except subprocess.TimeoutExpired:
        status = None
    checks.append((status == 0, f"exit status after SIGTERM: {status}"))
    for passed, what in checks:
        print(f"{'ok  ' if passed else 'FAIL'} {what}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "checks": [[p, w] for p, w in checks]}, indent=2))
    return 0 if all(passed for passed, _ in checks) else 1


# -- the command line -------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=30, help="how long the soak runs (default: 30)")
    parser.add_argument("--concurrency", type=int, default=6, help="clients sending at once (default: 6)")
    parser.add_argument("--seed", type=int, default=1, help="seeds the load's choices (default: 1)")
    parser.add_argument("--json", default=None, help="also write the rows and checks to this file")
    parser.add_argument("--log", default=None, help="write the server's log to this file")
    parser.add_argument(
        "server_args", nargs="*", help="options for trioserve serve, after --, e.g. -- --max-num-seqs 32"
    )
    args = parser.parse_args(argv)
    if args.minutes < 1:
        parser.error("--minutes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with serving_process(args.server_args, Path(args.log) if args.log else None) as (url, proc):
            return trio.run(soak, url, proc, args)
    except (SoakFailed, ServerStartError, BaseExceptionGroup) as exc:
        failed = exc.split(SoakFailed)[0] if isinstance(exc, BaseExceptionGroup) else exc
        if failed is None:
            raise
        print(f"FAIL {failed if not isinstance(failed, BaseExceptionGroup) else failed.exceptions[0]}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
