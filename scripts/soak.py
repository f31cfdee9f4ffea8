"""Soak: serve the default model for a while under a mixed load and watch for leaks.

    .venv/bin/python scripts/soak.py --minutes 30 [--concurrency 6] [--json soak.json]
    .venv/bin/python scripts/soak.py --slow-reader [--stall 60]

The soak starts ``trioserve serve`` on a free loopback port (a subprocess,
stopped at the end, on failure too) and drives it with ``--concurrency``
clients, each sending one request after another: streaming and not, chat
and plain completions, ``n`` of 1 to 3, prompts of 3 to 150 words, 4 to 64
tokens, some with a short deadline, some hung up on mid-stream. Every minute
it prints the server's resident memory, open file descriptors and trio task
count, and the minute's request latencies (p50, p99) and time to first
token (p99).

It exits 1 if the server died, any request failed (a 5xx, an error event, a
broken connection; 429 counts as refused, not failed), or a leak check
fails:

- resident memory at the last minute more than max(64 MiB, 10 %) above
  its value at the middle of the run (minute ceil(N / 2); minute 1 for a
  2-minute run). The first half is the warm-up: oneDNN caches a kernel
  ("primitive") for each new batch shape it meets, up to its cache's
  capacity, and the allocator's arenas grow to the load's working set;
  a leak keeps growing after that;
- once the load stops and the engine is idle: the task count not back to
  its value before the load, more open file descriptors than before the
  load (2 of slack), or KV-cache blocks still in use;
- the server not exiting with status 0 within a minute of SIGTERM.

``--slow-reader`` measures instead what a client that stops reading costs
the others: ``--others`` streaming clients run for ``--seconds`` alone, then
as long again next to one client that opens a long stream on a socket with
a 4 KiB receive buffer and reads nothing for ``--stall`` seconds. It prints
the others' inter-token latency in both phases, and exits 1 if the slow
reader lost tokens. Everything here talks only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from trioserve.bench.process import free_port, open_fds, rss_bytes

BIN = Path(sys.executable).parent / "trioserve"
MIB = 1 << 20
WORDS = (
    "the a river stone amber quiet lantern copper meadow falcon winter orchard signal harbor velvet ember "
    "north glass thunder silver market garden bridge candle paper island"
).split()


# -- the server ------------------------------------------------------------------


@attrs.define
class Server:
    url: str
    port: int
    proc: subprocess.Popen[bytes]

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise SoakFailed(f"the server died with status {self.proc.returncode}")


class SoakFailed(Exception):
    pass


@contextlib.contextmanager
def running_server(args: argparse.Namespace) -> Iterator[Server]:
    """``trioserve serve`` on a free port, ready; SIGTERM (then a kill, if
    it takes over a minute) when the block ends."""
    port = free_port()
    command = [str(BIN), "serve", "--port", str(port), "--shutdown-timeout", "5", *args.server_args]
    log = open(args.log, "w") if args.log else subprocess.DEVNULL
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", port, proc)
    try:
        deadline = time.monotonic() + 300  # a cold start converts the GGUF
        while True:
            server.check_alive()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SoakFailed("the server did not become ready in 300 s")
            time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()


async def server_tasks(url: str) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return (await http.get("/health")).json()["tasks"]


async def server_metrics(url: str) -> dict[str, float]:
    """The model's gauges and counters from ``/metrics`` (name -> value)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        text = (await http.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        match = re.match(r"^(trioserve:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if match and "le=" not in line:
            values.setdefault(match.group(1), float(match.group(2)))
    return values


async def wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    with trio.fail_after(timeout):
        while True:
            values = await server_metrics(url)
            if values["trioserve:num_requests_running"] == 0 and values["trioserve:num_requests_waiting"] == 0:
                return values
            await trio.sleep(0.2)


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


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def draw_request(rng: random.Random) -> tuple[str, dict[str, Any], int | None]:
    """A path, a body, and after how many events to hang up (None: never)."""
    stream = rng.random() < 0.7
    chat = rng.random() < 0.3
    words = [rng.choice(WORDS) for _ in range(int(rng.choice([3, 10, 40, 150]) * rng.uniform(0.7, 1.0)))]
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
        body["messages"] = [{"role": "user", "content": " ".join(words)}]
    else:
        body["prompt"] = " ".join(words)
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


async def soak(server: Server, args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    pid = server.proc.pid
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:  # warm up
        await http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 4})
    idle_tasks = await server_tasks(server.url)
    idle_fds = open_fds(pid)
    print(f"server pid {pid} at {server.url}; idle before the load: {idle_tasks} tasks, {idle_fds} fds", flush=True)
    header = "| minute | requests ok | refused | hung up | timed out | failed | p50 s | p99 s | TTFT p99 s | RSS MiB | fds | tasks |"
    print(header + "\n|" + "---|" * (header.count("|") - 1), flush=True)
    windows = [Window()]
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    end = trio.current_time() + args.minutes * 60

    async def client(seed: int) -> None:
        client_rng = random.Random(seed)
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
            while trio.current_time() < end:
                await one_request(http, client_rng, lambda: windows[-1])

    async def sample(minute: int) -> None:
        window = windows[-1]
        windows.append(Window())
        server.check_alive()
        row = {
            "minute": minute,
            "ok": window.ok,
            "refused": window.refused,
            "hung_up": window.disconnected,
            "timed_out": window.timed_out,
            "failed": window.failed,
            "p50_s": percentile(window.latencies, 50),
            "p99_s": percentile(window.latencies, 99),
            "ttft_p99_s": percentile(window.ttfts, 99),
            "rss_mib": rss_bytes(pid) / MIB,
            "fds": open_fds(pid),
            "tasks": await server_tasks(server.url),
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
    idle = await wait_idle(server.url)
    with trio.move_on_after(30):  # closing connections takes the server a moment to see
        while (tasks_after := await server_tasks(server.url)) != idle_tasks or open_fds(pid) > idle_fds + 2:
            await trio.sleep(0.2)
    fds_after = open_fds(pid)
    print(
        f"idle after the load: {tasks_after} tasks, {fds_after} fds, KV usage {idle['trioserve:kv_cache_usage_perc']:.3f}, "
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
    checks.append((idle["trioserve:kv_cache_usage_perc"] == 0, f"KV usage when idle: {idle['trioserve:kv_cache_usage_perc']}"))
    checks.append((not failures, f"{len(failures)} failed requests"))
    server.check_alive()
    server.proc.send_signal(signal.SIGTERM)
    try:
        status = await trio.to_thread.run_sync(lambda: server.proc.wait(timeout=60))
    except subprocess.TimeoutExpired:
        status = None
    checks.append((status == 0, f"exit status after SIGTERM: {status}"))
    for passed, what in checks:
        print(f"{'ok  ' if passed else 'FAIL'} {what}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "checks": [[p, w] for p, w in checks]}, indent=2))
    return 0 if all(passed for passed, _ in checks) else 1


# -- a reader that stops reading ----------------------------------------------------


async def stream_itls(url: str, end: float, itls: list[float], seed: int) -> None:
    """Stream 64-token completions one after another until ``end``; collect
    the gaps between content events (the first event's is TTFT, skipped)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while trio.current_time() < end:
            body = {
                "prompt": " ".join(rng.choice(WORDS) for _ in range(20)),
                "max_tokens": 64,
                "stream": True,
                "ignore_eos": True,
            }
            last = None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = trio.current_time()
                    if last is not None:
                        itls.append(now - last)
                    last = now


@attrs.define
class SlowReaderResult:
    tokens: int = 0
    done: bool = False
    stalled_at: float = 0.0


async def slow_reader(port: int, max_tokens: int, stall: float, result: SlowReaderResult) -> None:
    """Open a long stream on a socket with a 4 KiB receive buffer, read its
    first event, read nothing for ``stall`` seconds, then read it all."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", port))
    body = json.dumps(
        {
            "prompt": "Write a very long story about a lighthouse keeper.",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    await sock.send(head + body)
    received = b""
    while b"data: " not in received:
        received += await sock.recv(1024)
    result.stalled_at = trio.current_time()
    await trio.sleep(stall)  # reads nothing
    while b"data: [DONE]" not in received:
        chunk = await sock.recv(65536)
        if not chunk:
            break
        received += chunk
    sock.close()
    usage = re.findall(rb'"completion_tokens":(\d+)', received)
    result.tokens = int(usage[-1]) if usage else 0
    result.done = b"data: [DONE]" in received


def summary(itls: list[float]) -> str:
    return (
        f"{len(itls)} gaps, mean {1000 * sum(itls) / len(itls):.1f} ms, p50 {1000 * percentile(itls, 50):.1f} ms, "
        f"p90 {1000 * percentile(itls, 90):.1f} ms, p99 {1000 * percentile(itls, 99):.1f} ms"
    )


async def slow_reader_run(server: Server, args: argparse.Namespace) -> int:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:  # warm up
        await http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 8})
    alone: list[float] = []
    end = trio.current_time() + args.seconds
    async with trio.open_nursery() as nursery:
        for i in range(args.others):
            nursery.start_soon(stream_itls, server.url, end, alone, i)
    print(f"others alone:           {summary(alone)}", flush=True)

    before = await server_metrics(server.url)
    with_slow: list[float] = []
    result = SlowReaderResult()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(slow_reader, server.port, args.slow_tokens, args.stall, result)
        while not result.stalled_at:
            await trio.sleep(0.05)
        end = trio.current_time() + args.seconds
        for i in range(args.others):
            nursery.start_soon(stream_itls, server.url, end, with_slow, i)
    after = await server_metrics(server.url)
    print(f"others with the stalled: {summary(with_slow)}", flush=True)
    ratio = statistics_ratio(with_slow, alone)
    print(f"ratio (with / alone): mean {ratio[0]:.3f}, p50 {ratio[1]:.3f}, p90 {ratio[2]:.3f}", flush=True)
    preempted = after.get("trioserve:num_preemptions_total", 0) - before.get("trioserve:num_preemptions_total", 0)
    print(
        f"the stalled reader: {result.tokens} of {args.slow_tokens} tokens, [DONE] {result.done}; "
        f"preemptions meanwhile (a pause is one): {preempted:.0f}",
        flush=True,
    )
    server.check_alive()
    return 0 if result.done and result.tokens == args.slow_tokens else 1


def statistics_ratio(with_slow: list[float], alone: list[float]) -> tuple[float, float, float]:
    mean = (sum(with_slow) / len(with_slow)) / (sum(alone) / len(alone))
    return mean, percentile(with_slow, 50) / percentile(alone, 50), percentile(with_slow, 90) / percentile(alone, 90)


# -- the command line -------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=30, help="how long the soak runs (default: 30)")
    parser.add_argument("--concurrency", type=int, default=6, help="clients sending at once (default: 6)")
    parser.add_argument("--seed", type=int, default=1, help="seeds the load's choices (default: 1)")
    parser.add_argument("--json", default=None, help="also write the rows and checks to this file")
    parser.add_argument("--log", default=None, help="write the server's log to this file")
    parser.add_argument("--slow-reader", action="store_true", help="measure a stalled reader's cost to the others")
    parser.add_argument("--others", type=int, default=8, help="--slow-reader: streaming clients measured (default: 8)")
    parser.add_argument("--seconds", type=float, default=60.0, help="--slow-reader: length of each phase (default: 60)")
    parser.add_argument("--stall", type=float, default=60.0, help="--slow-reader: seconds it reads nothing (default: 60)")
    parser.add_argument("--slow-tokens", type=int, default=1000, help="--slow-reader: its max_tokens (default: 1000)")
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
        with running_server(args) as server:
            run = slow_reader_run if args.slow_reader else soak
            return trio.run(run, server, args)
    except (SoakFailed, BaseExceptionGroup) as exc:
        failed = exc.split(SoakFailed)[0] if isinstance(exc, BaseExceptionGroup) else exc
        if failed is None:
            raise
        print(f"FAIL {failed if isinstance(failed, SoakFailed) else failed.exceptions[0]}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
