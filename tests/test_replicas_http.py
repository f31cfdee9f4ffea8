"""Data parallelism over HTTP: ``serve`` with two replicas answers 429 with
Retry-After at the one admission bound over both, and /metrics labels each
replica's figures."""

from __future__ import annotations

import threading

import httpx
import trio

from actor_fixtures import tiny_loaded
from server_fixtures import MODEL, read_sse_lines, scrape, server_config, serving, wait_idle
from trioserve.engine.runtime.model_runner import ModelRunner
from trioserve.web.app import create_app

BODY = {"prompt": "Tell me a story.", "max_tokens": 4, "ignore_eos": True, "stream": True}


async def until(condition, timeout: float = 60.0) -> None:
    """Wait until the in-process engine reaches a state (it runs in this trio loop)."""
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


async def test_two_replicas_share_one_admission_bound_and_label_their_metrics(monkeypatch):
    # Every model step waits for the gate: requests stay where they are
    # until the test opens it (the step threads wait, the event loop does not).
    gate = threading.Event()
    execute = ModelRunner.execute

    def gated(self, plan):
        gate.wait(timeout=120)
        return execute(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", gated)
    config = server_config(
        engine={"data_parallel_size": 2, "num_threads": 1, "max_num_seqs": 1, "max_queued_requests": 2,
                "kv_cache_memory": 8 << 20, "warm_up": False},
    )
    app = create_app(config, loaded=tiny_loaded())
    async with serving(app) as running, httpx.AsyncClient(base_url=running.url, timeout=60) as http:
        engine = running.host.models[MODEL].engine
        assert len(engine.statistics().replicas) == 2
        streams: list[httpx.Response] = []
        try:
            # Each replica holds two (one running, one ready to run), the queue two more.
            for i in range(6):
                body = {**BODY, "prompt": f"{i} " + BODY["prompt"]}
                response = await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
                streams.append(response)
                assert response.status_code == 200
                await until(lambda: engine.statistics().num_queued == max(0, i - 3))
            refused = await http.post("/v1/completions", json=BODY)
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["code"] == "engine_overloaded"
            stats = engine.statistics()
            assert stats.num_queued == 2
            assert [r.scheduler.num_live for r in stats.replicas] == [2, 2]
            metrics = await scrape(http)
            for replica in ("0", "1"):
                assert metrics[f"trioserve:replica_num_requests_running{{replica={replica}}}"] == 1
                assert metrics[f"trioserve:replica_num_requests_waiting{{replica={replica}}}"] >= 1
                assert f"trioserve:replica_kv_cache_usage_perc{{replica={replica}}}" in metrics
            assert sum(metrics[f"trioserve:replica_num_requests_waiting{{replica={r}}}"] for r in "01") == 4
            assert metrics["trioserve:num_requests_running"] == 2
        finally:
            gate.set()
        for response in streams:
            events = [event async for event in read_sse_lines(response)]
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
            await response.aclose()
        idle = await wait_idle(http)
        assert idle["trioserve:replica_kv_cache_usage_perc{replica=0}"] == 0
        assert idle["trioserve:replica_kv_cache_usage_perc{replica=1}"] == 0
        assert idle["trioserve:replica_steps_total{replica=0}"] > 0
        assert idle["trioserve:replica_steps_total{replica=1}"] > 0
