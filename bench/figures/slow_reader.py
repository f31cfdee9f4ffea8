"""``trioserve bench slow-reader``: what a client that stops reading costs
the others, on the default model over HTTP.

    trioserve bench slow-reader [--others 8] [--seconds 60] [--stall 60] [--slow-tokens 1000]
                                [--log server.log] [-- <trioserve serve options>]

Starts ``trioserve serve`` on a free loopback port (a subprocess, stopped at
the end, on failure too). ``--others`` streaming clients (64-token
completions, one after another) run for ``--seconds`` alone, then as long
again next to one client that opens a ``--slow-tokens`` stream on a socket
with a 4 KiB receive buffer, reads its first event, reads nothing for
``--stall`` seconds, then reads the rest. It prints the others'
inter-token latency in both phases (percentiles as ``trioserve.bench.stats``
defines them) and their ratio, and the preemptions meanwhile (the stalled
reader's pause is one); it exits 1 if the stalled reader lost tokens or
missed ``[DONE]``, or the server died. Everything here talks only to
127.0.0.1. docs/reliability.md, "Slow readers", records a run.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import subprocess
from pathlib import Path

import attrs
import httpx
import trio

from ..arguments import positive_float, positive_int
from ..datasets import random_words
from ..process import ServerStartError, serving_process
from ..scrape import scrape
from ..stats import percentile


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "slow-reader",
        help="the others' inter-token latency while one client stops reading",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench slow-reader``: "),
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    load = p.add_argument_group("load")
    load.add_argument("--others", type=positive_int, default=8, help="streaming clients measured (default: 8)")
    load.add_argument("--seconds", type=positive_float, default=60.0, help="length of each phase (default: 60)")
    load.add_argument("--stall", type=positive_float, default=60.0,
                      help="seconds the stalled reader reads nothing (default: 60)")  # fmt: skip
    load.add_argument("--slow-tokens", type=positive_int, default=1000,
                      help="the stalled reader's max_tokens (default: 1000)")  # fmt: skip
    server = p.add_argument_group("server")
    server.add_argument("--log", type=Path, default=None, help="write the server's log to this file")
    server.add_argument("server_args", nargs="*", help="options for trioserve serve, after --, e.g. -- --num-threads 1")
    p.set_defaults(func=run)
    return p


async def stream_itls(url: str, end: float, itls: list[float], seed: int) -> None:
    """Stream 64-token completions one after another until ``end``; collect
    the gaps between content events (the first event's is TTFT, skipped)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while trio.current_time() < end:
            body = {
                "prompt": random_words(rng, 20),
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
class StalledReaderResult:
    """What the stalled reader got; ``stalled`` is set once it stops reading."""

    tokens: int = 0
    done: bool = False
    stalled: trio.Event = attrs.field(factory=trio.Event)


async def stalled_reader(port: int, max_tokens: int, stall: float, result: StalledReaderResult) -> None:
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
    result.stalled.set()
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
    """Count, mean and percentiles of the gaps, in ms."""
    return (
        f"{len(itls)} gaps, mean {1000 * sum(itls) / len(itls):.1f} ms, p50 {1000 * percentile(itls, 50):.1f} ms, "
        f"p90 {1000 * percentile(itls, 90):.1f} ms, p99 {1000 * percentile(itls, 99):.1f} ms"
    )


async def measure(url: str, proc: subprocess.Popen[bytes], args: argparse.Namespace) -> int:
    """Both phases against the server at ``url`` (process ``proc``); the
    script's exit status."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:  # warm up
        await http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 8})
    alone: list[float] = []
    end = trio.current_time() + args.seconds
    async with trio.open_nursery() as nursery:
        for i in range(args.others):
            nursery.start_soon(stream_itls, url, end, alone, i)
    print(f"others alone:           {summary(alone)}", flush=True)

    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        before = await scrape(http)
    with_slow: list[float] = []
    result = StalledReaderResult()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stalled_reader, httpx.URL(url).port, args.slow_tokens, args.stall, result)
        await result.stalled.wait()
        end = trio.current_time() + args.seconds
        for i in range(args.others):
            nursery.start_soon(stream_itls, url, end, with_slow, i)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        after = await scrape(http)
    print(f"others with the stalled: {summary(with_slow)}", flush=True)
    ratio = ratios(with_slow, alone)
    print(f"ratio (with / alone): mean {ratio[0]:.3f}, p50 {ratio[1]:.3f}, p90 {ratio[2]:.3f}", flush=True)
    preempted = after.get("trioserve:num_preemptions_total", 0) - before.get("trioserve:num_preemptions_total", 0)
    print(
        f"the stalled reader: {result.tokens} of {args.slow_tokens} tokens, [DONE] {result.done}; "
        f"preemptions meanwhile (a pause is one): {preempted:.0f}",
        flush=True,
    )
    if proc.poll() is not None:
        print(f"FAIL the server died with status {proc.returncode}", flush=True)
        return 1
    return 0 if result.done and result.tokens == args.slow_tokens else 1


def ratios(with_slow: list[float], alone: list[float]) -> tuple[float, float, float]:
    """Mean, p50 and p90 of ``with_slow`` over those of ``alone``."""
    mean = (sum(with_slow) / len(with_slow)) / (sum(alone) / len(alone))
    return mean, percentile(with_slow, 50) / percentile(alone, 50), percentile(with_slow, 90) / percentile(alone, 90)


def run(args: argparse.Namespace) -> int:
    try:
        with serving_process(args.server_args, args.log) as (url, proc):
            return trio.run(measure, url, proc, args)
    except ServerStartError as exc:
        print(f"FAIL {exc}", flush=True)
        return 1
