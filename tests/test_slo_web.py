"""Latency objectives over HTTP (web/slo.py), with the ``openai`` client
against real loopback servers on the tiny model: the body's fields and the
headers, their 400s, a refusal at the door (429, Retry-After, the field
named), best effort, ``usage.slo``, and the counters in /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest

from trioserve import testing
from trioserve.web.app import create_app

from server_fixtures import MODEL, metric_values, server_config, server_in_thread

CHAT = [{"role": "user", "content": "Hi"}]
# A TTFT target no step can meet (a microsecond): refused whatever the load.
IMPOSSIBLE_MS = 0.001


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def slo_server():
    config = server_config(engine={"scheduling_policy": "slo"})
    with server_in_thread(create_app(config, loaded=testing.tiny_loaded())) as running:
        yield running


@pytest.fixture(scope="module")
def plain_server():
    with server_in_thread(create_app(server_config(), loaded=testing.tiny_loaded())) as running:
        yield running


def _chat(client: openai.OpenAI, **extra):
    headers = extra.pop("headers", None)
    return client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, extra_body=extra, extra_headers=headers
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"ttft_ms": -5}, "ttft_ms"),
        ({"ttft_ms": 0}, "ttft_ms"),
        ({"tpot_ms": "fast"}, "tpot_ms"),
        ({"tpot_ms": 86_400_001}, "tpot_ms"),
        ({"slo_mode": "whenever"}, "slo_mode"),
        ({"slo_allow_shorter": "yes"}, "slo_allow_shorter"),
        ({"headers": {"x-slo-ttft-ms": "soon"}}, "x-slo-ttft-ms"),
        ({"headers": {"x-slo-tpot-ms": "nan"}}, "x-slo-tpot-ms"),
    ],
)
def test_a_bad_target_is_a_400_naming_its_field(plain_server, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(_client(plain_server), **extra)
    assert refused.value.body["param"] == param


def test_without_the_slo_policy_targets_are_reported_not_enforced(plain_server):
    reply = _chat(_client(plain_server), ttft_ms=IMPOSSIBLE_MS, tpot_ms=500)
    slo = reply.usage.model_extra["slo"]
    assert slo["enforced"] is False and "not enforced" in slo["reason"]
    assert slo["ttft_ms"] == 0.0 and slo["tpot_ms"] == 500
    assert slo["met"]["ttft"] is False and slo["measured"]["ttft_ms"] > 0
    plain = _chat(_client(plain_server))
    assert "slo" not in (plain.usage.model_extra or {})


def test_a_request_that_cannot_meet_its_ttft_is_refused_at_once(slo_server):
    with httpx.Client(base_url=slo_server.url, timeout=60) as http:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "ttft_ms": IMPOSSIBLE_MS}
        refused = http.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("slo_unattainable", "ttft_ms")
        assert "exceeds ttft_ms 0.001" in error["message"]
        # The header's target, the same.
        headers = {"x-slo-ttft-ms": str(IMPOSSIBLE_MS)}
        plain = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
        assert http.post("/v1/completions", json=plain, headers=headers).status_code == 429
        # The body wins over the header.
        loose = http.post("/v1/completions", json={**plain, "ttft_ms": 600_000}, headers=headers)
        assert loose.status_code == 200, loose.text
        assert loose.json()["usage"]["slo"]["ttft_ms"] == 600_000
        metrics = metric_values(http.get("/metrics").text)
    assert metrics["trioserve:slo_requests_total{decision=refused_ttft,priority=0}"] == 2
    assert metrics["trioserve:slo_requests_total{decision=admitted,priority=0}"] >= 1
    assert metrics["trioserve:slo_outcomes_total{objective=ttft,outcome=met,priority=0}"] >= 1


def test_best_effort_is_admitted_and_its_usage_says_what_was_predicted(slo_server):
    client = _client(slo_server)
    reply = _chat(client, ttft_ms=IMPOSSIBLE_MS, tpot_ms=60_000, slo_mode="best_effort")
    slo = reply.usage.model_extra["slo"]
    assert slo["enforced"] is True and slo["slo_mode"] == "best_effort"
    assert slo["predicted"]["ttft_ms"] > 0 and slo["predicted"]["tpot_ms"] > 0
    assert slo["met"] == {"ttft": False, "tpot": True}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ttft_ms": 600_000},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].model_extra["slo"]["met"]["ttft"] is True
