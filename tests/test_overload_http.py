"""Overload control over HTTP: queue timeouts answer 503, shedding and the
degradation policy's refusals 429, all in OpenAI's error JSON with
Retry-After, counted in /metrics; a stream already started when its request
is shed ends with finish reason "shed"."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import trio

from trioserve.web.app import create_app

from server_fixtures import MODEL, read_sse_lines, scrape, server_config, serving, wait_idle

pytestmark = pytest.mark.slow

# Long enough to hold the only running slot for the whole test.
HELD = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True, "stream": True}


def assert_error(response: httpx.Response, status: int, *, type: str, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (type, code, param)
    assert int(response.headers["Retry-After"]) >= 1
    return error


async def until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait until the in-process engine reaches a state (it runs in this trio loop)."""
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


async def test_a_request_waiting_past_max_queue_time_answers_503(default_loaded):
    config = server_config(engine={"max_num_seqs": 1, "max_queued_requests": 4, "max_queue_time": 0.5})
    app = create_app(config, loaded=default_loaded)
    async with serving(app) as running, httpx.AsyncClient(base_url=running.url, timeout=60) as http:
        # With --max-queue-time a stream's status waits for its first token.
        async with http.stream("POST", "/v1/completions", json=HELD) as held:
            assert held.status_code == 200
            events = read_sse_lines(held)  # kept: dropping it would close the response
            first = await events.__anext__()
            assert first["choices"][0]["finish_reason"] is None
            late = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            error = assert_error(late, 503, type="service_unavailable_error", code="queue_timeout")
            assert "max_queue_time (0.5 s)" in error["message"]
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=chat) as late_stream:
                await late_stream.aread()
                assert_error(late_stream, 503, type="service_unavailable_error", code="queue_timeout")
            metrics = await scrape(http)
            assert metrics["trioserve:overload_actions_total{action=queue_timeout}"] == 2
            assert metrics["trioserve:request_rejected_total{reason=queue_timeout}"] == 2
            assert metrics["trioserve:concurrency_limit"] == 1
        await wait_idle(http)
        body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as ok:
            events = [event async for event in read_sse_lines(ok)]
        assert ok.status_code == 200
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


async def test_shedding_and_expensive_refusals_answer_429_before_plain_overload(default_loaded):
    config = server_config(engine={"max_num_seqs": 1, "max_queued_requests": 2})
    app = create_app(config, loaded=default_loaded)
    async with serving(app) as running, httpx.AsyncClient(base_url=running.url, timeout=60) as http:
        engine = running.host.models[MODEL].engine
        streams: list[httpx.Response] = []
        results: dict[str, httpx.Response] = {}

        async def stream(body: dict) -> httpx.Response:
            response = await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
            streams.append(response)
            return response

        async def post(name: str, body: dict) -> None:
            results[name] = await http.post("/v1/completions", json=body)

        try:
            async with trio.open_nursery() as nursery:
                assert (await stream(HELD)).status_code == 200  # running
                assert (await stream(HELD)).status_code == 200  # waiting in the engine
                await until(lambda: engine.statistics().num_waiting == 1)
                nursery.start_soon(post, "low", {"prompt": "Hi", "max_tokens": 2, "priority": 5})
                await until(lambda: engine.statistics().num_queued == 1)
                started = await stream({**HELD, "priority": 4})  # its 200 goes out at once
                assert started.status_code == 200 and engine.statistics().num_queued == 2
                # The queue is full: priority 0 takes the places of 5, then of 4.
                assert (await stream({**HELD, "priority": 0})).status_code == 200
                await until(lambda: "low" in results)
                error = assert_error(results["low"], 429, type="rate_limit_error", code="request_shed")
                assert "higher priority" in error["message"]
                assert (await stream({**HELD, "priority": 0})).status_code == 200
                events = [event async for event in read_sse_lines(started)]
                assert events[-1] == "[DONE]"
                assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == ["shed"]
                assert events[0]["choices"][0]["text"] == ""
            # Expensive requests are refused first, naming the field...
            two = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2})
            assert_error(two, 429, type="rate_limit_error", code="expensive_request_refused", param="n")
            chat = {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2,
                "logprobs": True,
                "top_logprobs": 10,
            }
            many = await http.post("/v1/chat/completions", json=chat)
            assert_error(many, 429, type="rate_limit_error", code="expensive_request_refused", param="top_logprobs")
            # ... and plain ones once nothing queued is of lower priority.
            plain = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "priority": 5})
            assert_error(plain, 429, type="rate_limit_error", code="engine_overloaded")
            metrics = await scrape(http)
            assert metrics["trioserve:overload_actions_total{action=shed}"] == 2
            assert metrics["trioserve:overload_actions_total{action=refuse_expensive}"] == 2
            assert metrics["trioserve:request_rejected_total{reason=overloaded}"] == 4
            assert metrics["trioserve:overload_pressure"] == 1.0
        finally:
            for response in streams:  # hang up: their requests are aborted
                await response.aclose()
        await wait_idle(http)
        ok = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200
