"""The HTTP server end to end: a real server on a loopback port, driven by the
official openai client (sync and async) and by httpx for SSE framing,
concurrency, disconnects and deadlines."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import trio
from conftest import ON_CUDA

from trioserve.web.app import create_app
from trioserve.web.serve_options import server_config_from_env
from trioserve.web.settings import ModelSpec

from server_fixtures import MODEL, metric_values, parse_sse, scrape, server_config, server_in_thread, serving, wait_idle

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(default_loaded):
    with server_in_thread(create_app(server_config(), loaded=default_loaded)) as running:
        yield running


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as sync_client:
        yield sync_client


def tokenize(server, **body) -> list[int]:
    response = httpx.post(server.url + "/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


# -- the openai client -----------------------------------------------------------


def test_openai_sync_chat_n2_logprobs_seed(server, client):
    params = dict(model=MODEL, messages=CHAT, n=2, logprobs=True, top_logprobs=2, max_tokens=6, seed=11, temperature=1.0)
    first = client.chat.completions.create(**params)
    again = client.chat.completions.create(**params)

    assert sorted(c.index for c in first.choices) == [0, 1]
    # The seed makes sampling reproducible, completion by completion.
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    num_tokens = 0
    for choice in first.choices:
        assert choice.message.role == "assistant"
        assert choice.finish_reason in ("stop", "length")
        entries = choice.logprobs.content
        assert entries and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
        assert "".join(e.token for e in entries).startswith(choice.message.content.strip()[:3])
        num_tokens += len(entries)
    assert first.usage.completion_tokens == num_tokens
    assert first.usage.prompt_tokens == len(tokenize(server, messages=CHAT))
    assert first.usage.total_tokens == first.usage.prompt_tokens + num_tokens


def test_openai_sync_completion_stop_and_logprobs(client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    text = greedy.choices[0].text
    assert len(greedy.choices[0].logprobs.tokens) == greedy.usage.completion_tokens == 8
    assert "".join(greedy.choices[0].logprobs.tokens) == text
    stop = text[4:6]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    choice = stopped.choices[0]
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop


def test_openai_sync_streaming_matches_non_streaming(client):
    params = dict(model=MODEL, prompt=PROMPT, n=2, max_tokens=6, seed=5, temperature=0.8, logprobs=1)
    whole = client.completions.create(**params)
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in client.completions.create(**params, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()


def test_openai_sync_chat_streaming_with_stop(client):
    greedy = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    text = greedy.choices[0].message.content
    stop = text[3:5]
    pieces, finish = [], None
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stop=stop, stream=True)
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == text[: text.index(stop)]
    assert finish == "stop"


async def test_openai_async_chat_streaming_and_completion(server):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, n=2, max_tokens=6, seed=3, stream=True, stream_options={"include_usage": True}
        )
        contents, roles, usage = {0: "", 1: ""}, set(), None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.role:
                    roles.add(choice.index)
                contents[choice.index] += choice.delta.content or ""
        assert roles == {0, 1}
        whole = await client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=6, seed=3)
        assert contents == {c.index: c.message.content for c in whole.choices}
        assert usage.completion_tokens == whole.usage.completion_tokens

        completion = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, stop=["."]
        )
        choice = completion.choices[0]
        assert "." not in choice.text and choice.finish_reason in ("stop", "length")
        assert len(choice.logprobs.tokens) == completion.usage.completion_tokens

        params = dict(model=MODEL, prompt=PROMPT, n=2, max_tokens=6, seed=9, temperature=1.0, logprobs=1, stop=["\n"])
        whole = await client.completions.create(**params)
        texts, tokens = {0: "", 1: ""}, {0: 0, 1: 0}
        async for chunk in await client.completions.create(**params, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                tokens[choice.index] += len(choice.logprobs.tokens)
        assert texts == {c.index: c.text for c in whole.choices}
        assert sum(tokens.values()) == whole.usage.completion_tokens


# -- SSE framing and usage ----------------------------------------------------


async def test_sse_framing_and_usage(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    body |= {"logprobs": True}
    async with httpx.AsyncClient(base_url=server.url) as http:
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.content)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage_chunk["choices"] == []
    num_tokens = sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks if c["choices"][0]["logprobs"])
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == num_tokens
    assert usage["prompt_tokens"] == len(tokenize(server, messages=CHAT))
    assert usage["total_tokens"] == usage["prompt_tokens"] + num_tokens


async def test_sixty_four_concurrent_streams(server):
    prompts = [f"Item {i}: the next number after {i} is" for i in range(64)]
    results: dict[int, list] = {}

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": 6, "ignore_eos": True, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        results[i] = parse_sse(response.content)

    start = time.monotonic()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
        async with trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(one, http, i)
    elapsed = time.monotonic() - start
    assert sorted(results) == list(range(64))
    for i, events in results.items():
        assert events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] == 6
        assert usage["prompt_tokens"] == len(tokenize(server, prompt=prompts[i]))
        assert events[-3]["choices"][0]["finish_reason"] == "length"
    print(f"64 concurrent streams of 6 tokens: {elapsed:.1f} s")


# -- disconnects and deadlines ---------------------------------------------------


async def test_disconnect_aborts_and_frees_blocks(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        baseline = await scrape(http)
        assert baseline["trioserve:num_requests_running"] == 0
        body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            seen = 0
            async for line in lines:
                seen += line.startswith("data: ")
                if seen == 2:
                    break
            during = await scrape(http)
            assert during["trioserve:num_requests_running"] == 1
            assert during["trioserve:kv_cache_usage_perc"] > baseline["trioserve:kv_cache_usage_perc"]
        # Leaving the block closed the connection mid-stream.
        closed = time.monotonic()
        with trio.fail_after(10):
            while True:
                after = await scrape(http)
                idle = after["trioserve:num_requests_running"] == 0 and after["trioserve:num_requests_waiting"] == 0
                if idle and after["trioserve:kv_cache_usage_perc"] == baseline["trioserve:kv_cache_usage_perc"]:
                    break
                await trio.sleep(0.02)
        freed = time.monotonic() - closed
        # 400 tokens would take far longer than this: the request was aborted.
        assert after["trioserve:generation_tokens_total"] - during["trioserve:generation_tokens_total"] < 100
    print(f"disconnect to freed blocks: {freed:.2f} s")


async def test_timeout_ends_stream_with_timeout_chunk(server):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True, "timeout": 1.0}
    body["stream_options"] = {"include_usage": True}
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        response = await http.post("/v1/completions", json=body)
        elapsed = time.monotonic() - start
        events = parse_sse(response.content)
        assert response.status_code == 200
        assert events[-1] == "[DONE]"
        assert events[-3]["choices"][0]["finish_reason"] == "timeout"
        assert events[-2]["usage"]["completion_tokens"] < 400
        assert elapsed < 10

        # The header works too, and a non-streaming request answers 504.
        start = time.monotonic()
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
        response = await http.post("/v1/completions", json=body, headers={"X-Request-Timeout": "0.5"})
        assert response.status_code == 504
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("timeout_error", "request_timeout", "timeout")
        assert "0.5 s" in error["message"]
        assert time.monotonic() - start < 10
        await wait_idle(http)


async def test_max_request_time_caps_every_request(default_loaded):
    app = create_app(server_config(max_request_time=0.5), loaded=default_loaded)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "timeout": 100}
    async with serving(app) as running, httpx.AsyncClient(base_url=running.url, timeout=60) as http:
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 504
        assert "deadline of 0.5 s" in response.json()["error"]["message"]
        streamed = parse_sse((await http.post("/v1/completions", json=body | {"stream": True})).content)
        assert streamed[-2]["choices"][0]["finish_reason"] == "timeout"


async def test_long_stream_outlives_response_and_keep_alive_timeouts(default_loaded):
    app = create_app(server_config(), loaded=default_loaded)
    # What quart and hypercorn would do to a slow stream, made short: the
    # stream must not be cut by either.
    app.config["RESPONSE_TIMEOUT"] = 0.1
    async with serving(app, keep_alive_timeout=0.1) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as http:
            start = time.monotonic()
            body = {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True, "stream": True}
            response = await http.post("/v1/completions", json=body)
            events = parse_sse(response.content)
    assert time.monotonic() - start > 0.1
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


# -- sampling extras -----------------------------------------------------------------


async def test_vllm_extras_and_logit_bias(server):
    paris, period = tokenize(server, prompt=" Paris", add_special_tokens=False)[0], tokenize(server, prompt=".", add_special_tokens=False)[0]
    base = {"prompt": PROMPT, "temperature": 0, "max_tokens": 6}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

        async def complete(**extra):
            response = await http.post("/v1/completions", json=base | extra)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]

        greedy = await complete()
        assert greedy["text"].startswith(" Paris.")
        banned = await complete(logit_bias={str(paris): -100}, max_tokens=1)
        assert not banned["text"].startswith(" Paris")
        forced = await complete(logit_bias={str(period): 100}, max_tokens=3)
        assert forced["text"] == "..."
        kept = await complete(stop=["."], include_stop_str_in_output=True)
        assert kept["text"] == " Paris." and kept["stop_reason"] == "."
        by_id = await complete(stop_token_ids=[period])
        assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == period
        # Accepted and applied without error (their effect is the engine's, tested there).
        extras = await complete(
            top_k=5, min_p=0.05, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5,
            min_tokens=6, ignore_eos=True, priority=-1, seed=1, temperature=0.7,
        )
        assert extras["finish_reason"] == "length"
        chat = await http.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "max_completion_tokens": 3, "top_k": 1, "ignore_eos": True, "min_tokens": 3},
        )
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3


# -- the other endpoints ---------------------------------------------------------------


async def test_models_health_version_tokenize_metrics(server):
    async with httpx.AsyncClient(base_url=server.url) as http:
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert models["data"][0]["max_model_len"] == 512 and models["object"] == "list"
        health = await http.get("/health")
        assert (health.status_code, health.json()["status"], health.json()["degraded"]) == (200, "ready", False)
        version = (await http.get("/version")).json()
        assert version["version"] == "0.1.0"
        # The CPU paths a CPU model took (tests/test_cpu_paths.py checks their content).
        if ON_CUDA:
            assert version["cpu"] is None
        else:
            chosen = version["cpu"]["models"][MODEL]
            assert (chosen["device"], chosen["dtype"]) == ("cpu", "float32")
        # Whether a request's tokens depend on what shares its steps, and why, on any device.
        invariance = version["invariance"][MODEL]
        assert set(invariance) == {"invariant", "reason"} and invariance["reason"]

        tokens = await http.post("/tokenize", json={"prompt": "Hello world"})
        assert tokens.json()["count"] == len(tokens.json()["tokens"]) and tokens.json()["max_model_len"] == 512
        text = await http.post("/detokenize", json={"tokens": tokens.json()["tokens"]})
        assert text.json() == {"prompt": "Hello world"}
        chat_ids = await http.post("/tokenize", json={"messages": CHAT})
        assert len(chat_ids.json()["tokens"]) > len(tokens.json()["tokens"])

        before = await scrape(http)
        response = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert response.status_code == 200
        after = metric_values((await http.get("/metrics")).text)
    for name in (
        "trioserve:num_requests_waiting",
        "trioserve:prefix_cache_queries_total",
        "trioserve:prefix_cache_hits_total",
        "trioserve:num_preemptions_total",
        "trioserve:time_to_first_token_seconds_count",
        "trioserve:inter_token_latency_seconds_count",
        "trioserve:time_per_output_token_seconds_count",
        "trioserve:request_queue_time_seconds_count",
        "trioserve:request_rejected_total{reason=unauthorized}",
    ):
        assert name in after, name
    assert after["trioserve:generation_tokens_total"] - before["trioserve:generation_tokens_total"] == 3
    assert after["trioserve:prompt_tokens_total"] > before["trioserve:prompt_tokens_total"]
    assert after["trioserve:request_success_total{finished_reason=length}"] == before["trioserve:request_success_total{finished_reason=length}"] + 1
    assert after["trioserve:e2e_request_latency_seconds_count"] == before["trioserve:e2e_request_latency_seconds_count"] + 1


async def test_several_models_route_by_name(default_loaded):
    config = server_config(models=(ModelSpec("small", None), ModelSpec("other", None)), engine={"kv_cache_memory": 32 << 20})
    app = create_app(config, loaded={"small": default_loaded, "other": default_loaded})
    async with serving(app) as running, httpx.AsyncClient(base_url=running.url, timeout=60) as http:
        listed = (await http.get("/v1/models")).json()
        assert [m["id"] for m in listed["data"]] == ["small", "other"]
        for name in ("small", "other"):
            response = await http.post("/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 2})
            assert response.status_code == 200 and response.json()["model"] == name
        default = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert default.json()["model"] == "small"
        missing = await http.post("/v1/completions", json={"model": "gpt-4", "prompt": PROMPT})
        assert missing.status_code == 404 and "'small', 'other'" in missing.json()["error"]["message"]
        text = (await http.get("/metrics")).text
        assert metric_values(text, "small")["trioserve:generation_tokens_total"] == 4
        assert metric_values(text, "other")["trioserve:generation_tokens_total"] == 2


def test_config_from_environment():
    env = {
        "TRIOSERVE_MODEL": "a=/models/a.gguf, SmolLM2-135M-Instruct",
        "TRIOSERVE_API_KEY": "k",
        "TRIOSERVE_MAX_MODEL_LEN": "1024",
        "TRIOSERVE_KV_CACHE_MEMORY": "64M",
        "TRIOSERVE_NO_PREFIX_CACHING": "true",
        "TRIOSERVE_MAX_REQUEST_TIME": "30",
        "TRIOSERVE_ARGS": "--max-queued-requests 8 --shutdown-timeout 2.5",
    }
    config = server_config_from_env(env)
    assert config.models == (ModelSpec("a", "/models/a.gguf"), ModelSpec(MODEL, None))
    assert (config.api_key, config.max_request_time, config.shutdown_timeout) == ("k", 30.0, 2.5)
    engine = config.engine
    assert (engine.max_model_len, engine.kv_cache_memory, engine.enable_prefix_caching) == (1024, 64 << 20, False)
    assert engine.max_queued_requests == 8
    assert server_config_from_env({}).models == (ModelSpec(MODEL, None),)
