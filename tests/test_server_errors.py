"""Every error status of the HTTP API, in OpenAI's JSON shape, and that no bad
request disturbs the engine or the requests around it."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import trio

from trioserve.engine.errors import ModelLoadError
from trioserve.engine.core import engine_core as engine_core_module
from trioserve.web.app import create_app
from trioserve.web.host import HostState
from trioserve.web.settings import ModelSpec

from server_fixtures import MODEL, parse_sse, read_sse_lines, scrape, server_config, server_in_thread, serving, wait_idle

pytestmark = pytest.mark.slow

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 4096


@pytest.fixture(scope="module")
def server(default_loaded):
    config = server_config(api_key=KEY, max_body_size=MAX_BODY)
    with server_in_thread(create_app(config, loaded=default_loaded)) as running:
        yield running


def assert_error(response: httpx.Response, status: int, *, type: str, code: str | None = None, param: str | None = None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (type, code, param)
    return error


async def test_api_key(server):
    async with httpx.AsyncClient(base_url=server.url) as http:
        missing = await http.post("/v1/completions", json={"prompt": "Hi"})
        assert_error(missing, 401, type="authentication_error", code="invalid_api_key")
        assert missing.headers["WWW-Authenticate"] == "Bearer"
        wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401, type="authentication_error", code="invalid_api_key")
        not_bearer = await http.post("/tokenize", json={"prompt": "Hi"}, headers={"Authorization": f"Basic {KEY}"})
        assert_error(not_bearer, 401, type="authentication_error", code="invalid_api_key")
        assert (await http.get("/v1/models", headers=AUTH)).status_code == 200
        # Load balancers and scrapers need no key.
        for path in ("/health", "/metrics", "/version"):
            assert (await http.get(path)).status_code == 200, path
        assert (await scrape(http))["trioserve:request_rejected_total{reason=unauthorized}"] >= 3


async def test_bad_requests_name_the_field(server):
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH) as http:

        async def post(path: str, **kwargs) -> httpx.Response:
            return await http.post(path, **kwargs)

        malformed = await post("/v1/completions", content=b'{"prompt": "Hi",', headers={"content-type": "application/json"})
        error = assert_error(malformed, 400, type="invalid_request_error")
        assert "not valid JSON" in error["message"]
        assert_error(await post("/v1/completions", json=["Hi"]), 400, type="invalid_request_error")
        error = assert_error(
            await post("/v1/completions", json={"prompt": "Hi", "temperature": "hot"}),
            400,
            type="invalid_request_error",
            param="temperature",
        )
        assert "temperature must be a number" in error["message"]
        assert_error(await post("/v1/completions", json={"prompt": "Hi", "n": 0}), 400, type="invalid_request_error", param="n")
        assert_error(await post("/v1/completions", json={"max_tokens": 3}), 400, type="invalid_request_error", param="prompt")
        bad_role = {"messages": [{"role": "bot", "content": "Hi"}]}
        assert_error(await post("/v1/chat/completions", json=bad_role), 400, type="invalid_request_error", param="messages[0].role")
        assert_error(
            await post("/v1/completions", json={"prompt": "Hi", "logit_bias": {"999999": 5}}),
            400,
            type="invalid_request_error",
            param="logit_bias",
        )
        assert_error(
            await post("/v1/completions", json={"prompt": "Hi"}, headers={"X-Request-Timeout": "soon"}),
            400,
            type="invalid_request_error",
            param="timeout",
        )
        assert_error(await post("/detokenize", json={"tokens": [10**9]}), 400, type="invalid_request_error", param="tokens")

        too_long = await post("/v1/completions", json={"prompt": [42] * 600})
        error = assert_error(too_long, 400, type="invalid_request_error", code="context_length_exceeded", param="prompt")
        assert "600" in error["message"] and "512" in error["message"]


async def test_text_that_is_not_unicode_and_deep_nesting_are_400(server):
    # The bodies of issue 10, each a 500 before.
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH) as http:
        surrogate = [
            ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
            ("/tokenize", {"prompt": "\ud800"}, "prompt"),
            ("/tokenize", {"messages": [{"role": "user", "content": "Hi \udfff"}]}, "messages[0].content"),
        ]
        for path, body, param in surrogate:
            # json.dumps escapes the surrogate as "\\ud800" (httpx's json= cannot encode it).
            response = await http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
            error = assert_error(response, 400, type="invalid_request_error", param=param)
            assert "lone UTF-16 surrogate" in error["message"]
        raw = {"Content-Type": "application/json"}
        response = await http.post("/v1/completions", content=b'{"prompt": "\xed\xa0\x80"}', headers=raw)
        error = assert_error(response, 400, type="invalid_request_error")
        assert "not valid UTF-8" in error["message"]
        deep = b"[" * 1000 + b"]" * 1000
        error = assert_error(await http.post("/v1/completions", content=deep, headers=raw), 400, type="invalid_request_error")
        assert "levels deep" in error["message"]
        ok = await http.post("/v1/completions", json={"prompt": "Hi \U0001f600", "max_tokens": 2})
        assert ok.status_code == 200


async def test_not_found_and_too_large(server):
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH) as http:
        unknown = await http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
        error = assert_error(unknown, 404, type="invalid_request_error", code="model_not_found", param="model")
        assert f"'{MODEL}'" in error["message"]
        assert_error(await http.get("/v1/nothing-here"), 404, type="invalid_request_error", code="not_found")
        assert_error(await http.get("/v1/completions"), 405, type="invalid_request_error", code="method_not_allowed")

        big = {"prompt": "x" * (MAX_BODY + 10)}
        error = assert_error(await http.post("/v1/completions", json=big), 413, type="invalid_request_error", code="request_too_large")
        assert str(MAX_BODY) in error["message"]

        async def chunked():  # no Content-Length: counted as it arrives
            for _ in range(8):
                yield b" " * 1024

        response = await http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert_error(response, 413, type="invalid_request_error", code="request_too_large")
        rejected = await scrape(http)
        assert rejected["trioserve:request_rejected_total{reason=too_large}"] == 2
        assert rejected["trioserve:request_rejected_total{reason=not_found}"] >= 2


async def test_bad_requests_do_not_disturb_others(server):
    bad_bodies = [
        {"prompt": "Hi", "top_p": 0},
        {"prompt": [49152]},  # outside the vocabulary
        {"prompt": "Hi", "stop_token_ids": [-1]},
        {"prompt": "Hi", "max_tokens": 0},
        {"prompt": [7] * 1000},
        {"prompt": "Hi", "n": 2, "best_of": 3},
        {"prompt": "Hi", "min_tokens": 50, "max_tokens": 5},
        {"prompt": "Hi", "stream_options": {"include_usage": True}},
    ]
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
        before = await scrape(http)
        good = {"prompt": "Count to ten:", "max_tokens": 12, "ignore_eos": True, "stream": True}
        good["stream_options"] = {"include_usage": True}
        async with http.stream("POST", "/v1/completions", json=good) as response:
            events = []
            async for event in read_sse_lines(response):
                events.append(event)
                if len(events) == 2:  # in flight: now send the garbage
                    statuses = []
                    async with trio.open_nursery() as nursery:
                        for body in bad_bodies * 3:
                            nursery.start_soon(_post_status, http, body, statuses)
                    assert statuses == [400] * len(bad_bodies) * 3
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 12
        after = await wait_idle(http)
        assert after["trioserve:request_rejected_total{reason=invalid}"] - before["trioserve:request_rejected_total{reason=invalid}"] == 24
        assert (await http.get("/health")).status_code == 200
        again = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert again.status_code == 200


async def _post_status(http: httpx.AsyncClient, body: dict, statuses: list[int]) -> None:
    statuses.append((await http.post("/v1/completions", json=body)).status_code)


# -- servers of their own ---------------------------------------------------------------


async def test_overload_answers_429_with_retry_after(default_loaded):
    # One running sequence, one more held by the scheduler, one queued:
    # a fourth request in flight cannot fit.
    config = server_config(engine={"max_num_seqs": 1, "max_queued_requests": 1})
    app = create_app(config, loaded=default_loaded)
    body = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with serving(app) as running, httpx.AsyncClient(base_url=running.url, timeout=60) as http:
        held, overloaded = [], None
        try:
            for _ in range(4):
                response = await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
                if response.status_code == 429:
                    overloaded = response
                    break
                assert response.status_code == 200
                held.append(response)
            assert overloaded is not None, "four requests in flight were all accepted"
            await overloaded.aread()
            error = assert_error(overloaded, 429, type="rate_limit_error", code="engine_overloaded")
            assert int(overloaded.headers["Retry-After"]) >= 1
            assert f"retry after {overloaded.headers['Retry-After']} s" in error["message"]
            metrics = await scrape(http)
            assert metrics["trioserve:request_rejected_total{reason=overloaded}"] == 1
        finally:
            for response in held:  # hang up: their slots free up
                await response.aclose()
        await wait_idle(http)
        ok = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


async def test_draining_answers_503_and_lets_in_flight_finish(default_loaded):
    app = create_app(server_config(shutdown_timeout=60), loaded=default_loaded)
    async with serving(app) as running, httpx.AsyncClient(base_url=running.url, timeout=60) as http:
        body = {"prompt": "Count:", "max_tokens": 10, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            events = read_sse_lines(response)
            first = await events.__anext__()
            assert first["choices"][0]["finish_reason"] is None
            running.host.begin_drain()
            health = await http.get("/health")
            assert_error(health, 503, type="service_unavailable_error", code="draining")
            refused = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert_error(refused, 503, type="service_unavailable_error", code="draining")
            rest = [event async for event in events]
        assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
    assert running.host.state is HostState.STOPPED


async def test_health_503_while_loading(default_loaded, monkeypatch):
    release = threading.Event()

    def slow_load(config):
        release.wait(timeout=60)
        return default_loaded

    monkeypatch.setattr(engine_core_module, "load_model_for", slow_load)  # the engine loads through it
    app = create_app(server_config())
    try:
        async with serving(app, wait_ready=False) as running, httpx.AsyncClient(base_url=running.url) as http:
            health = await http.get("/health")
            assert_error(health, 503, type="service_unavailable_error", code="loading")
            assert int(health.headers["Retry-After"]) >= 1
            early = await http.post("/v1/completions", json={"prompt": "Hi"})
            assert_error(early, 503, type="service_unavailable_error", code="loading")
            models = await http.get("/v1/models")
            assert models.json()["data"][0]["id"] == MODEL
            release.set()
            with trio.fail_after(60):
                await running.host.wait_ready()
            assert (await http.get("/health")).status_code == 200
    finally:
        release.set()


async def test_failed_load_stops_the_server():
    config = server_config(models=(ModelSpec("broken", "/nonexistent/model.gguf"),))
    app = create_app(config)
    with trio.fail_after(60):
        async with serving(app, wait_ready=False) as running:
            await running.host.wait_stopped()
    # serve() returned by itself: the block above ended once hypercorn did.
    assert running.host.state is HostState.FAILED
    assert isinstance(running.host.error, ModelLoadError)
    with pytest.raises(Exception, match="engine failed"):
        running.host.raise_unless_ready()


def test_sse_parser_rejects_bad_framing():
    assert parse_sse(b'data: {"a":1}\n\ndata: [DONE]\n\n') == [{"a": 1}, "[DONE]"]
    with pytest.raises(AssertionError):
        parse_sse(b'data: {"a":1}\ndata: [DONE]\n\n')
