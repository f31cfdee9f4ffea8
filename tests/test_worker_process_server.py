"""A real ``trioserve serve --worker-mode process``: its worker shows in
``/health`` and ``/metrics``, serves, and SIGTERM stops both processes."""

from __future__ import annotations

import signal

import httpx
import pytest
import trio

from test_server_shutdown import BIN, start, wait_healthy
from test_worker_process import alive, wait_gone

pytestmark = pytest.mark.slow

EXIT_TIMEOUT = 60.0
SMALL = ["--kv-cache-memory", "64M", "--max-model-len", "512"]


async def test_sigterm_stops_the_server_and_its_worker():
    command = [str(BIN / "trioserve"), "serve", "--port", "0", "--worker-mode", "process", "--shutdown-timeout", "6", *SMALL]
    async with trio.open_nursery() as nursery:
        server = await start(nursery, command)
        try:
            url = await server.wait_for_url(r"listening on (http://127\.0\.0\.1:\d+)")
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                await wait_healthy(http)
                (model,) = (await http.get("/health")).json()["models"].values()
                worker = model["worker"]
                assert worker["state"] == "ready" and worker["restarts"] == 0
                pid = worker["pid"]
                assert alive(pid) and pid != server.process.pid
                metrics = (await http.get("/metrics")).text
                assert "trioserve:worker_restarts_total" in metrics
                body = {"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
            server.process.send_signal(signal.SIGTERM)
            with trio.fail_after(EXIT_TIMEOUT):
                await server.process.wait()
            assert server.process.returncode == 0, server.stderr
            await wait_gone(pid)
            assert not alive(pid)
        finally:
            if server.process.returncode is None:
                server.process.kill()
                await server.process.wait()
        nursery.cancel_scope.cancel()
