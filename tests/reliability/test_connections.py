"""Connections, checked with raw sockets and real clients against real
loopback servers: ``Connection: close`` and HTTP/1.0 honoured; idle
keep-alive connections, request headers that never finish and bodies that
stop arriving closed after their timeouts; a cap on open connections that
answers 503; a client that reads nothing dropped after the send timeout;
idle connections closed at shutdown.

The servers run a tiny random-weight model (the default model's tokenizer)
with timeouts of a fraction of a second; ``FAIL_SAFE`` bounds every wait.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from actor_fixtures import tiny_loaded
from raw_http import FAIL_SAFE, RawConnection, request
from server_fixtures import STARTUP_TIMEOUT, Server, parse_sse, server_config, serving
from trioserve.web import serve as serve_module
from trioserve.web.app import create_app
from trioserve.web.connections import ClientStream, ConnectionGate, ConnectionLimits, ConnectionStatistics

SHORT = 0.5  # seconds: the timeouts under test
LONG = 60.0  # seconds: timeouts that must not be what closes a connection (> FAIL_SAFE)
COMPLETION = json.dumps({"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}).encode()
STREAM = json.dumps({"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "stream": True}).encode()


@asynccontextmanager
async def tiny_server(**server: Any) -> AsyncIterator[Server]:
    server.setdefault("keep_alive_timeout", LONG)
    server.setdefault("body_timeout", LONG)
    config = server_config(engine={"max_model_len": 64}, **server)
    async with serving(create_app(config, loaded=tiny_loaded())) as running:
        yield running


# -- closing when asked ------------------------------------------------------------


@pytest.mark.parametrize(
    "first_line",
    [
        request("GET", "/health", headers={"Connection": "close"}),
        request("POST", "/v1/completions", COMPLETION, headers={"Connection": "close"}),
        request("POST", "/v1/completions", STREAM, headers={"Connection": "close"}),
        request("GET", "/health", version="1.0"),
        request("POST", "/v1/completions", COMPLETION, version="1.0"),
        request("POST", "/v1/completions", STREAM, version="1.0"),
        request("GET", "/health", version="1.0", headers={"Connection": "keep-alive"}),
    ],
    ids=["close-get", "close-post", "close-stream", "1.0-get", "1.0-post", "1.0-stream", "1.0-keep-alive"],
)
async def test_close_after_the_response_when_asked(first_line):
    # The idle timer is longer than the fail-safe: only honouring the
    # request's close can close the connection in time.
    async with tiny_server() as server:
        connection = await RawConnection.open(server.url)
        await connection.send(first_line)
        response = await connection.response()
        assert response.status == 200
        assert response.headers.get("connection") == "close"
        if b'"stream": true' in first_line:
            assert parse_sse(response.body)[-1] == "[DONE]"
        else:
            assert json.loads(response.body)
        await connection.wait_closed()


async def test_keep_alive_serves_requests_then_closes_when_idle():
    async with tiny_server(keep_alive_timeout=SHORT) as server:
        connection = await RawConnection.open(server.url)
        for line in (request("GET", "/health"), request("POST", "/v1/completions", COMPLETION), request("GET", "/version")):
            await connection.send(line)
            response = await connection.response()
            assert response.status == 200 and "connection" not in response.headers
        idle = await connection.wait_closed()
        # Not at once (the client's clock starts after the server's timer,
        # by however long a loaded machine takes to read the response).
        assert idle >= SHORT / 2


async def test_a_connection_without_a_whole_request_is_closed_after_the_idle_timeout():
    async with tiny_server(keep_alive_timeout=SHORT) as server:
        silent = await RawConnection.open(server.url)
        partial = await RawConnection.open(server.url)
        await partial.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(silent.wait_closed)
            nursery.start_soon(partial.wait_closed)
        # The server still serves.
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.get("/health")).status_code == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes(chunked):
    async with tiny_server(body_timeout=SHORT) as server:
        connection = await RawConnection.open(server.url)
        head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        if chunked:
            await connection.send(f'{head}Transfer-Encoding: chunked\r\n\r\n5\r\n{{"pro\r\n'.encode())
        else:
            await connection.send(f"{head}Content-Length: {len(COMPLETION)}\r\n\r\n".encode() + COMPLETION[:10])
        started = trio.current_time()
        response = await connection.response()
        assert trio.current_time() - started >= SHORT / 2  # not at once (see above)
        assert response.status == 408 and response.headers["connection"] == "close"
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("timeout_error", "body_timeout")
        assert "10 bytes came" in error["message"] or chunked
        await connection.wait_closed()
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.post("/v1/completions", content=COMPLETION)).status_code == 200


# -- the connection cap ----------------------------------------------------------


async def test_connections_past_the_cap_get_503_and_the_others_are_served():
    async with tiny_server(max_connections=2) as server:
        held = [await RawConnection.open(server.url) for _ in range(2)]
        for connection in held:  # both admitted: each is served
            await connection.send(request("GET", "/health"))
            assert (await connection.response()).status == 200

        # A real client, on a third connection.
        async with httpx.AsyncClient(base_url=server.url) as http:
            refused = await http.post("/v1/completions", content=COMPLETION)
        assert refused.status_code == 503
        assert refused.headers["connection"] == "close" and int(refused.headers["retry-after"]) >= 1
        assert refused.headers["content-type"] == "application/json"
        error = refused.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("service_unavailable_error", "too_many_connections", None)
        assert "2 connections" in error["message"]

        # A raw one: the 503 comes whatever it sends, and then the close.
        extra = await RawConnection.open(server.url)
        await extra.send(request("GET", "/v1/models"))
        response = await extra.response()
        assert response.status == 503 and response.json()["error"]["code"] == "too_many_connections"
        await extra.aclose()

        # The held connections are served on, on the same sockets.
        await held[0].send(request("POST", "/v1/completions", COMPLETION))
        assert (await held[0].response()).status == 200

        # One hangs up: once the server has seen it go, a new one is served.
        await held[1].aclose()
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.get("/health")).status_code == 200
        await held[0].aclose()


async def test_the_gate_counts_connections_and_refuses_past_the_cap():
    gate = ConnectionGate(ConnectionLimits(max_connections=1, send_timeout=LONG))
    release = trio.Event()
    handled = []

    async def handle(stream: trio.abc.HalfCloseableStream) -> None:
        handled.append(stream)
        await release.wait()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(FAIL_SAFE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gate.serve, listeners[0], handle, nursery)
            first = await RawConnection.open(f"http://127.0.0.1:{port}")
            await trio.testing.wait_all_tasks_blocked()
            assert gate.statistics() == ConnectionStatistics(open=1, refusing=0, refused=0)
            second = await RawConnection.open(f"http://127.0.0.1:{port}")
            refused = await second.response()  # sent before any request: nothing to wait for
            assert refused.status == 503 and refused.json()["error"]["code"] == "too_many_connections"
            assert gate.statistics() == ConnectionStatistics(open=1, refusing=1, refused=1)
            await second.aclose()  # the refusal reads until the client hangs up
            await trio.testing.wait_all_tasks_blocked()
            assert gate.statistics() == ConnectionStatistics(open=1, refusing=0, refused=1)
            release.set()  # the handler returns: its connection is closed and no longer counted
            await first.wait_closed()
            await trio.testing.wait_all_tasks_blocked()
            assert gate.statistics() == ConnectionStatistics(open=0, refusing=0, refused=1)
            nursery.cancel_scope.cancel()
    assert len(handled) == 1


# -- clients that stop reading ---------------------------------------------------


async def test_send_timeout_breaks_a_connection_whose_client_reads_nothing(autojump_clock):
    # A real socket pair with small buffers; the reading end never reads.
    left, right = trio.socket.socketpair()
    for sock in (left, right):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stream = ClientStream(trio.SocketStream(left), send_timeout=30.0)
    reader = trio.SocketStream(right)
    await stream.send_all(b"x" * 100)  # room for this: sent at once
    started = trio.current_time()
    with pytest.raises(trio.BrokenResourceError, match="read nothing for 30 s"):
        await stream.send_all(b"x" * (8 << 20))
    assert trio.current_time() - started == pytest.approx(30.0)
    with pytest.raises(trio.ClosedResourceError):
        await stream.send_all(b"more")  # closed by the timeout
    assert await reader.receive_some(100) == b"x" * 100
    await reader.aclose()


async def test_send_timeout_leaves_a_slow_but_reading_client_alone(autojump_clock):
    left, right = trio.socket.socketpair()
    stream = ClientStream(trio.SocketStream(left), send_timeout=30.0)
    reader = trio.SocketStream(right)
    received = bytearray()

    async def read_slowly() -> None:
        while len(received) < (4 << 20):
            await trio.sleep(1.0)  # virtual time: a reader that takes its time
            received.extend(await reader.receive_some(1 << 20))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_slowly)
        for _ in range(4):
            await stream.send_all(b"y" * (1 << 20))
    assert len(received) == 4 << 20
    await stream.aclose()
    await reader.aclose()


# -- shutdown --------------------------------------------------------------------


async def test_shutdown_closes_idle_connections_at_once(monkeypatch):
    # Nothing else may close the connection within the fail-safe: not the
    # idle timer, nor the sweep of lingering connections once the engines
    # have stopped (CLOSE_GRACE), nor the graceful timeout (15 s here).
    monkeypatch.setattr(serve_module, "CLOSE_GRACE", LONG)
    with trio.fail_after(STARTUP_TIMEOUT) as bound:
        async with tiny_server(keep_alive_timeout=LONG) as server:
            connection = await RawConnection.open(server.url)
            await connection.send(request("GET", "/health"))
            assert (await connection.response()).status == 200
            bound.deadline = trio.current_time() + FAIL_SAFE  # from here: the shutdown
        # The server has stopped, and the idle connection went with it.
        await connection.wait_closed()
