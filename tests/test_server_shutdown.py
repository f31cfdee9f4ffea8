"""Graceful shutdown of a real ``trioserve serve`` process, and the app under
hypercorn's own command line; both as subprocesses on free loopback ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from server_fixtures import read_sse_lines

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
# The long request must outlast the drain on any machine: 4,000 tokens within
# SHUTDOWN_TIMEOUT would take a step under 1 ms, which no CPU runs this model
# at (one stream decodes at about 12 ms a token on 2 cores).
LONG_CONTEXT = ["--kv-cache-memory", "256M", "--max-model-len", "4096"]
LONG_TOKENS = 4000
STARTUP_TIMEOUT = 120.0
SHUTDOWN_TIMEOUT = 4.0
# The drain's timeout, plus a model step, hypercorn's close and the
# interpreter's exit (torch's teardown takes a moment).
EXIT_MARGIN = 10.0


class ServerProcess:
    """A server subprocess whose stderr is collected as it runs."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.stderr = ""
        self._changed = trio.Event()

    async def collect_stderr(self) -> None:
        async for data in self.process.stderr:
            self.stderr += data.decode(errors="replace")
            self._changed.set()
            self._changed = trio.Event()
        self._changed.set()

    async def wait_for_url(self, pattern: str) -> str:
        with trio.fail_after(STARTUP_TIMEOUT):
            while (match := re.search(pattern, self.stderr)) is None:
                assert self.process.returncode is None, f"the server exited early:\n{self.stderr}"
                await self._changed.wait()
        return match.group(1)


async def start(nursery: trio.Nursery, command: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **(env or {})}
    )
    server = ServerProcess(process)
    nursery.start_soon(server.collect_stderr)
    return server


async def wait_healthy(http: httpx.AsyncClient) -> None:
    """Poll /health (503 while loading) until 200, within the startup timeout."""
    with trio.fail_after(STARTUP_TIMEOUT):
        while True:
            response = await http.get("/health")
            if response.status_code == 200:
                return
            assert response.status_code == 503 and response.json()["error"]["code"] == "loading"
            await trio.sleep(0.1)


async def stream_events(http: httpx.AsyncClient, body: dict, first: trio.Event, into: list) -> None:
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for event in read_sse_lines(response):
            into.append(event)
            first.set()


async def test_sigterm_finishes_short_aborts_long_and_exits_zero():
    command = [str(BIN / "trioserve"), "serve", "--port", "0", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), *LONG_CONTEXT]
    async with trio.open_nursery() as nursery:
        server = await start(nursery, command)
        try:
            url = await server.wait_for_url(r"listening on (http://127\.0\.0\.1:\d+)")
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                await wait_healthy(http)
                short, long = [], []
                short_started, long_started = trio.Event(), trio.Event()
                async with trio.open_nursery() as streams:
                    body = {"prompt": "Once upon a time", "ignore_eos": True, "stream": True}
                    streams.start_soon(stream_events, http, body | {"max_tokens": LONG_TOKENS}, long_started, long)
                    streams.start_soon(stream_events, http, body | {"max_tokens": 3}, short_started, short)
                    await long_started.wait()
                    await short_started.wait()
                    server.process.send_signal(signal.SIGTERM)
                    signalled = trio.current_time()
                with trio.fail_at(signalled + SHUTDOWN_TIMEOUT + EXIT_MARGIN):
                    code = await server.process.wait()
                exited = trio.current_time() - signalled
        finally:
            if server.process.returncode is None:
                server.process.kill()
    assert code == 0, server.stderr
    # The short request finished; the long one was aborted at the timeout,
    # and both streams ended cleanly.
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]" and long[-2]["choices"][0]["finish_reason"] == "abort"
    assert "SIGTERM: draining" in server.stderr
    assert exited >= SHUTDOWN_TIMEOUT * 0.9
    print(f"SIGTERM to exit: {exited:.1f} s (shutdown timeout {SHUTDOWN_TIMEOUT} s)")


async def test_hypercorn_command_line_with_environment():
    env = {
        "TRIOSERVE_API_KEY": "k",
        "TRIOSERVE_KV_CACHE_MEMORY": "64M",
        "TRIOSERVE_MAX_MODEL_LEN": "512",
        "TRIOSERVE_SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT),
    }
    command = [str(BIN / "hypercorn"), "--worker-class", "trio", "--bind", "127.0.0.1:0", "trioserve.web.app:create_app()"]
    async with trio.open_nursery() as nursery:
        server = await start(nursery, command, env)
        try:
            url = await server.wait_for_url(r"Running on (http://127\.0\.0\.1:\d+)")
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                await wait_healthy(http)
                body = {"prompt": "Hello", "max_tokens": 3}
                assert (await http.post("/v1/completions", json=body)).status_code == 401
                response = await http.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"})
                assert response.status_code == 200
                assert response.json()["usage"]["completion_tokens"] <= 3
                models = (await http.get("/v1/models", headers={"Authorization": "Bearer k"})).json()
                assert models["data"][0]["max_model_len"] == 512
            server.process.send_signal(signal.SIGTERM)
            with trio.fail_after(SHUTDOWN_TIMEOUT + EXIT_MARGIN):
                code = await server.process.wait()
        finally:
            if server.process.returncode is None:
                server.process.kill()
    assert code == 0, server.stderr
