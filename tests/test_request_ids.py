"""X-Request-Id (web/request_ids.py) on a real loopback server with the tiny
model: on every response, the caller's when valid, the engine's request id,
in the request's log lines and in the access log."""

from __future__ import annotations

import logging
import re

import httpx
import pytest
import trio

from trioserve import testing
from trioserve.web.app import create_app
from trioserve.web.cli import LOG_FORMAT
from trioserve.web.connections import _refusal_response
from trioserve.web.request_ids import HEADER, RequestIdFilter, choose_request_id
from trioserve.web.settings import ServerConfig

from server_fixtures import MODEL, read_sse_lines, serving

GENERATED = re.compile(r"[0-9a-f]{32}")
LONG_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 200,
    "ignore_eos": True,
    "stream": True,
}


def tiny_app(**server):
    config = ServerConfig(engine=testing.engine_config(), shutdown_timeout=5.0, **server)
    return create_app(config, loaded=testing.tiny_loaded())


@pytest.mark.parametrize(
    ("given", "kept", "why"),
    [
        (None, False, None),
        ("abc-123_X.y:z", True, None),
        ("x" * 128, True, None),
        ("", False, "empty"),
        ("x" * 129, False, "longer than 128"),
        ("a/b", False, "other than '/'"),
        ("a b", False, "visible ASCII"),
        ("caf\u00e9", False, "visible ASCII"),
    ],
)
def test_choose_request_id(given, kept, why):
    request_id, refused = choose_request_id(given)
    assert (request_id == given) is kept
    if not kept:
        assert GENERATED.fullmatch(request_id)
    assert (refused is None) is (why is None) and (why is None or why in refused)


async def test_every_response_carries_the_id_and_log_lines_name_it(caplog):
    filter = RequestIdFilter()
    caplog.handler.addFilter(filter)
    caplog.set_level(logging.INFO, logger="trioserve.web.request_ids")
    try:
        async with serving(tiny_app(api_key="sekret")) as server, httpx.AsyncClient(base_url=server.url) as http:
            generated = (await http.get("/health")).headers[HEADER]
            assert GENERATED.fullmatch(generated)
            assert (await http.get("/health")).headers[HEADER] != generated  # one per request
            assert (await http.get("/health", headers={HEADER: "mine-1"})).headers[HEADER] == "mine-1"
            refused = await http.get("/v1/models", headers={HEADER: "mine-2"})  # no key: 401
            assert refused.status_code == 401 and refused.headers[HEADER] == "mine-2"
            auth = {"Authorization": "Bearer sekret"}
            missing = await http.get("/nowhere", headers={**auth, HEADER: "mine-3"})
            assert missing.status_code == 404 and missing.headers[HEADER] == "mine-3"
            bad = await http.post("/v1/chat/completions", headers={**auth, HEADER: "mine-4"}, json={"model": MODEL})
            assert bad.status_code == 400 and bad.headers[HEADER] == "mine-4"

            replaced = await http.get("/health", headers={HEADER: "a/b"})
            new_id = replaced.headers[HEADER]
            assert GENERATED.fullmatch(new_id)
    finally:
        caplog.handler.removeFilter(filter)
    [record] = [r for r in caplog.records if "ignored X-Request-Id" in r.getMessage()]
    assert "'a/b'" in record.getMessage() and new_id in record.getMessage()
    # Written while the request was handled: the record carries its id.
    assert record.request_id == new_id
    formatted = logging.Formatter(LOG_FORMAT).format(record)
    assert f"[{new_id}] trioserve.web.request_ids: ignored" in formatted


async def test_the_id_is_the_engine_request_id(caplog):
    caplog.set_level(logging.INFO, logger="trioserve.web.request_ids")
    app = tiny_app()
    async with serving(app) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        engine = server.host.models[MODEL].engine
        async with http.stream("POST", "/v1/chat/completions", json=LONG_CHAT, headers={HEADER: "run-1"}) as first:
            assert first.headers[HEADER] == "run-1"
            events = read_sse_lines(first)
            await anext(events)  # it runs
            # A second request reusing the id while the first runs: served under an alias.
            again = await http.post("/v1/chat/completions", json={**LONG_CHAT, "stream": False, "max_tokens": 2}, headers={HEADER: "run-1"})
            assert again.status_code == 200 and again.headers[HEADER] == "run-1"
            assert engine.abort("run-1")  # the engine knows the request by the HTTP id
            reasons = [c["finish_reason"] async for e in events if e != "[DONE]" for c in e["choices"]]
            assert reasons[-1] == "abort"
    [line] = [r.getMessage() for r in caplog.records if "still in the engine" in r.getMessage()]
    assert re.fullmatch(r"request id run-1 is still in the engine; the engine calls this request run-1-[0-9a-f]{8}", line)


async def test_access_log_names_the_id(caplog):
    caplog.set_level(logging.INFO, logger="hypercorn.access")
    async with serving(tiny_app()) as server, httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get("/health", headers={HEADER: "acc-1"})).status_code == 200
        generated = (await http.get("/version")).headers[HEADER]
        await trio.testing.wait_all_tasks_blocked()  # the line is written once the response is sent
    lines = [r.getMessage() for r in caplog.records if r.name == "hypercorn.access"]
    assert any('"GET /health 1.1" 200' in line and line.endswith("request_id=acc-1") for line in lines), lines
    assert any('"GET /version 1.1" 200' in line and line.endswith(f"request_id={generated}") for line in lines), lines


async def test_no_access_log_when_turned_off(caplog):
    caplog.set_level(logging.INFO, logger="hypercorn.access")
    async with serving(tiny_app(access_log=False)) as server, httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get("/health")).status_code == 200
        await trio.testing.wait_all_tasks_blocked()
    assert not [r for r in caplog.records if r.name == "hypercorn.access"]


def test_connection_refusal_carries_an_id():
    head = _refusal_response(4).split(b"\r\n\r\n")[0].decode()
    [line] = [line for line in head.split("\r\n") if line.startswith("x-request-id: ")]
    assert GENERATED.fullmatch(line.removeprefix("x-request-id: "))
