"""Security basics, against real loopback servers: the API key on every route
but the open ones (unknown paths too, so a 404 does not tell who has no key
what exists), compared in constant time; no traceback or file path in any
error body, an unexpected exception's included; request bodies and prompts
never logged unless ``--log-requests`` is set; ``--host`` on loopback by
default."""

from __future__ import annotations

import hmac
import inspect
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from actor_fixtures import tiny_loaded
from server_fixtures import MODEL, Server, parse_sse, server_config, serving
from trioserve.web import routes, serve
from trioserve.web.app import create_app
from trioserve.web.completion_bodies import CompletionStream, OutputAccumulator
from trioserve.web.serve_options import build_serve_parser, server_config_from_args, server_config_from_env
from trioserve.web.settings import ServerConfig

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CANARY = "zebra-canary-7431"  # a prompt that must not reach the logs
LEAKS = ("Traceback", 'File "', ".py", "site-packages", "/trioserve/")

PROTECTED = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/resp_x"),
    ("POST", "/v1/files"),
    ("GET", "/v1/batches"),
    ("POST", "/v1/load_lora_adapter"),
]
UNKNOWN = [
    ("GET", "/index.html"),
    ("GET", "/admin"),
    ("GET", "/v1/nothing"),
    ("POST", "/v1/audio/speech"),
    ("GET", "/docs"),
    ("GET", "/health/x"),
]


@asynccontextmanager
async def tiny_server(**server: Any) -> AsyncIterator[Server]:
    config = server_config(engine={"max_model_len": 64}, **server)
    async with serving(create_app(config, loaded=tiny_loaded())) as running:
        yield running


def assert_error(response: httpx.Response, status: int, code: str | None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert not any(leak in error["message"] for leak in LEAKS), error["message"]
    return error


# -- the API key -----------------------------------------------------------------


def test_the_open_paths_are_the_documented_ones():
    assert routes.OPEN_PATHS == {"/health", "/metrics", "/version", "/", "/chat"}


async def test_api_key_is_required_on_every_route_but_the_open_ones():
    async with tiny_server(api_key=KEY) as server, httpx.AsyncClient(base_url=server.url) as http:
        for path in sorted(routes.OPEN_PATHS):
            assert (await http.get(path)).status_code == 200, path
        wrong = {"Authorization": f"Bearer {KEY}x"}
        for method, path in PROTECTED + UNKNOWN:
            for headers in ({}, wrong, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
                response = await http.request(method, path, headers=headers)
                assert_error(response, 401, "invalid_api_key")
                assert response.headers["www-authenticate"] == "Bearer"
        # The wrong method or an OPTIONS probe tells nothing either.
        assert_error(await http.delete("/v1/completions"), 401, "invalid_api_key")
        assert_error(await http.options("/v1/completions"), 401, "invalid_api_key")
        # With the key: the known routes answer, and unknown paths are 404.
        for method, path in UNKNOWN:
            assert_error(await http.request(method, path, headers=AUTH), 404, "not_found")
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        assert (await http.post("/v1/completions", json=body, headers=AUTH)).status_code == 200
        assert (await http.get("/v1/models", headers=AUTH)).status_code == 200


async def test_api_key_is_compared_in_constant_time(monkeypatch):
    compared = []
    constant_time = hmac.compare_digest

    def compare_digest(given: bytes, expected: bytes) -> bool:
        compared.append((given, expected))
        return constant_time(given, expected)

    monkeypatch.setattr(routes.hmac, "compare_digest", compare_digest)
    async with tiny_server(api_key=KEY) as server, httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get("/v1/models", headers=AUTH)).status_code == 200
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer nope"})).status_code == 401
        # A key that is not ASCII is compared like any other (as bytes), and refused.
        odd = await http.get("/v1/models", headers={"Authorization": b"Bearer \xff\xfe"})
        assert_error(odd, 401, "invalid_api_key")
    # The bytes the client sent, as sent.
    assert [given for given, _ in compared] == [KEY.encode(), b"nope", b"\xff\xfe"]
    assert {expected for _, expected in compared} == {KEY.encode()}


async def test_a_key_that_is_not_ascii_is_accepted_as_its_utf8_bytes():
    key = "clé-ключ"
    async with tiny_server(api_key=key) as server, httpx.AsyncClient(base_url=server.url) as http:
        right = await http.get("/v1/models", headers={"Authorization": b"Bearer " + key.encode()})
        assert right.status_code == 200, right.text
        # Its UTF-8 bytes read as Latin-1 and encoded again are not the key.
        twice = key.encode().decode("latin-1").encode()
        wrong = await http.get("/v1/models", headers={"Authorization": b"Bearer " + twice})
        assert_error(wrong, 401, "invalid_api_key")


def test_an_empty_api_key_is_refused_at_startup():
    # An empty key would let "Authorization: Bearer " with no key through.
    with pytest.raises(ValueError, match="api_key must not be empty"):
        ServerConfig(api_key="")
    with pytest.raises(ValueError, match="api_key must not be empty"):
        server_config_from_env({"TRIOSERVE_API_KEY": ""})
    assert ServerConfig(api_key="k").api_key == "k" and ServerConfig().api_key is None


async def test_a_request_without_the_key_is_refused_before_its_body_is_read():
    async with tiny_server(api_key=KEY, max_body_size=4 << 20) as server, httpx.AsyncClient(base_url=server.url) as http:
        response = await http.post("/v1/completions", content=b"x" * (2 << 20))
        assert_error(response, 401, "invalid_api_key")
        assert response.headers["connection"] == "close"  # the body was never read
        assert (await http.get("/health")).status_code == 200


# -- no tracebacks in error bodies ----------------------------------------------------


def _raise_with_a_path(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(f"{CANARY}: failed in {__file__}, line 1")


async def test_an_unexpected_exception_answers_500_without_traceback_or_path(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(routes.metadata, "version", _raise_with_a_path)  # /version
    monkeypatch.setattr(OutputAccumulator, "add", _raise_with_a_path)  # a non-streamed completion
    monkeypatch.setattr(CompletionStream, "chunks", _raise_with_a_path)  # a streamed one
    async with tiny_server() as server, httpx.AsyncClient(base_url=server.url) as http:
        error = assert_error(await http.get("/version"), 500, "internal_error")
        assert (error["type"], error["message"]) == ("server_error", "internal server error (RuntimeError)")
        error = assert_error(await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}), 500, "internal_error")
        assert error["message"] == "internal server error (RuntimeError)"
        streamed = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True})
        assert streamed.status_code == 200  # sent before the failure: the stream says it
        events = parse_sse(streamed.content)
        assert events[-1] == "[DONE]"
        assert events[-2] == {
            "error": {
                "message": "internal server error (RuntimeError)",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
        }
        assert __file__ not in streamed.text and CANARY not in streamed.text
    # The log has the traceback for whoever runs the server, but not the
    # exception's message (it may quote the request): --log-requests shows it.
    assert "unexpected error in GET /version: RuntimeError" in caplog.text
    assert "Traceback (most recent call last)" in caplog.text
    assert "request failed: RuntimeError" in caplog.text
    assert CANARY not in caplog.text


# -- logging of requests -----------------------------------------------------------


@pytest.mark.parametrize("log_requests", [False, True], ids=["default", "log-requests"])
async def test_prompts_are_logged_only_with_log_requests(log_requests, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(CompletionStream, "chunks", _raise_with_a_path)
    async with tiny_server(log_requests=log_requests) as server, httpx.AsyncClient(base_url=server.url) as http:
        requests = [
            ("/v1/completions", {"prompt": CANARY, "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": CANARY}], "max_tokens": 2}),
            ("/tokenize", {"prompt": CANARY}),
            ("/v1/completions", {"prompt": CANARY, "temperature": "hot"}),  # 400
            ("/v1/completions", {"prompt": CANARY + "\ud800"}),  # 400, a lone surrogate
            ("/v1/completions", {"prompt": CANARY, "max_tokens": 2, "stream": True}),  # fails mid-stream
        ]
        statuses = [(await http.post(path, content=json.dumps(body))).status_code for path, body in requests]
    assert statuses == [200, 200, 200, 400, 400, 200]
    assert (CANARY in caplog.text) is log_requests
    if log_requests:  # each body, once
        logged = [r.getMessage() for r in caplog.records if r.name == "trioserve.web.routes" and CANARY in r.getMessage()]
        assert len(logged) == len(requests)
        assert logged[0].startswith("POST /v1/completions: {")


# -- options -----------------------------------------------------------------------


def test_host_defaults_to_loopback():
    args = build_serve_parser().parse_args([])
    assert args.host == "127.0.0.1"
    assert inspect.signature(serve.run).parameters["host"].default == "127.0.0.1"
    assert "default: 127.0.0.1" in build_serve_parser().format_help()


def test_connection_and_logging_options():
    args = build_serve_parser().parse_args([])
    config = server_config_from_args(args)
    assert (config.keep_alive_timeout, config.body_timeout, config.send_timeout) == (5.0, 30.0, 120.0)
    assert config.max_connections is None and config.log_requests is False
    argv = [
        "--keep-alive-timeout",
        "2",
        "--body-timeout",
        "3.5",
        "--send-timeout",
        "9",
        "--max-connections",
        "10",
        "--log-requests",
    ]
    config = server_config_from_args(build_serve_parser().parse_args(argv))
    assert (config.keep_alive_timeout, config.body_timeout, config.send_timeout, config.max_connections) == (2.0, 3.5, 9.0, 10)
    assert config.log_requests is True
    env = server_config_from_env(
        {"TRIOSERVE_LOG_REQUESTS": "1", "TRIOSERVE_MAX_CONNECTIONS": "7", "TRIOSERVE_BODY_TIMEOUT": "4"}
    )
    assert (env.log_requests, env.max_connections, env.body_timeout) == (True, 7, 4.0)
    for bad in (
        ["--max-connections", "0"],
        ["--keep-alive-timeout", "-1"],
        ["--body-timeout", "nan"],
        ["--send-timeout", "soon"],
    ):
        with pytest.raises(SystemExit):
            build_serve_parser().parse_args(bad)
