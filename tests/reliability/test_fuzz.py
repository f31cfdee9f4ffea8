"""Fuzzed bad requests against one real loopback server: every field of
every route with wrong types, out-of-range numbers, NaN and infinities (as
raw JSON tokens too), huge and empty values, invalid UTF-8 and lone
surrogates, deep nesting, oversized bodies, wrong methods, paths, content
types and API keys (the cases: ``fuzz_cases.py``).

Every answer must be a 4xx with OpenAI's error JSON (naming the field when
one field is at fault, with no traceback or file path), or a 2xx when the
fuzzed value happened to be valid; never a 5xx (a 504 only for a request
that set itself a deadline), a reset connection or a hang. The server must
serve normally afterwards, with nothing left running.

The server runs a tiny random-weight model with the default model's real
tokenizer and chat template, so requests that happen to be valid cost
little. ``TRIOSERVE_FUZZ_EXAMPLES`` sets the examples per family (default
500, about 40 s for the three families); the number of requests tried is
printed at the end.
"""

from __future__ import annotations

import collections
import json
import os
import re

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from actor_fixtures import tiny_loaded
from fuzz_cases import AUTH, KEY, MAX_BODY, Case, body_cases, field_cases, http_cases
from server_fixtures import MODEL, parse_sse, server_config, server_in_thread, wait_idle
from trioserve.web.app import create_app

EXAMPLES = int(os.environ.get("TRIOSERVE_FUZZ_EXAMPLES", "500"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
# A hang is a failure: no answer takes this long on the tiny model.
CLIENT_TIMEOUT = 60.0
ERROR_KEYS = {"message", "type", "param", "code"}
# What a traceback or a source path looks like in an error message.
LEAKS = re.compile(r'Traceback|File "|\.py\b|site-packages|/trioserve/')


@pytest.fixture(scope="module")
def server():
    # max_model_len 64: a request valid by accident generates little.
    config = server_config(api_key=KEY, max_body_size=MAX_BODY, engine={"max_model_len": 64, "max_num_batched_tokens": 256})
    with server_in_thread(create_app(config, loaded=tiny_loaded())) as running:
        yield running


@pytest.fixture(scope="module")
def tally(pytestconfig):
    """Counts the requests tried, by status; reported when the module ends."""
    counts: collections.Counter[int] = collections.Counter()
    yield counts
    summary = ", ".join(f"{status}: {count}" for status, count in sorted(counts.items()))
    line = f"fuzz: {sum(counts.values())} requests tried ({EXAMPLES} examples per family); by status: {summary}"
    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\n{line}")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT) as client:
        yield client


def send(http: httpx.Client, case: Case, tally: collections.Counter[int]) -> httpx.Response:
    # Any transport error (a reset connection, a timeout) fails the test.
    response = http.request(case.method, case.path, content=case.body, headers=case.headers)
    tally[response.status_code] += 1
    return response


def check(case: Case, response: httpx.Response) -> None:
    status = response.status_code
    where = (
        f"{case.method} {case.path} [{case.note}] {case.body[:300] if case.body else b''!r} -> {status}: {response.text[:400]}"
    )
    if status >= 400:
        assert response.headers.get("content-type") == "application/json", where
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, where
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert (
            isinstance(error["type"], str) and isinstance(error["param"], str | None) and isinstance(error["code"], str | None)
        ), where
        assert not LEAKS.search(error["message"]), where
        if status == 504:
            assert case.may_time_out and error["code"] == "request_timeout", where
        else:
            assert status < 500, where
        if status == 400 and case.fields:
            assert error["param"] is not None and error["param"].startswith(case.fields), where
    else:
        assert 200 <= status < 300 and not case.error, where
        content_type = response.headers.get("content-type", "")
        if content_type.startswith("text/event-stream"):
            events = parse_sse(response.content)
            assert events[-1] == "[DONE]", where
            errors = [e["error"] for e in events[:-1] if "error" in e]
            assert all(e["type"] != "server_error" for e in errors), where
            assert all(e["code"] == "request_timeout" for e in errors) or not errors, where
        elif content_type == "application/json":
            assert isinstance(response.json(), dict), where
    if case.status is not None:
        assert status == case.status, where


@FUZZ
@given(case=field_cases())
def test_fuzzed_fields(http, tally, case):
    check(case, send(http, case, tally))


@FUZZ
@given(case=body_cases())
def test_fuzzed_bodies(http, tally, case):
    check(case, send(http, case, tally))


@FUZZ
@given(case=http_cases())
def test_fuzzed_methods_paths_and_headers(http, tally, case):
    check(case, send(http, case, tally))


async def test_serves_normally_after_the_fuzz(server, tally):
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=CLIENT_TIMEOUT) as client:
        completion = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
        )
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
        chat = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        )
        assert chat.status_code == 200, chat.text
        stream = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True})
        assert parse_sse(stream.content)[-1] == "[DONE]"
        assert (await client.get("/health")).json()["status"] == "ready"
        idle = await wait_idle(client)
        tally.update([200] * 5)
    assert idle["trioserve:num_requests_running"] == 0 and idle["trioserve:num_requests_waiting"] == 0
    assert json.loads((await _get_models(server.url)))["data"][0]["id"] == MODEL


async def _get_models(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, headers=AUTH) as client:
        return (await client.get("/v1/models")).text
