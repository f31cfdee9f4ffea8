"""``trioserve bench serve`` against a fake OpenAI-compatible SSE server.

The fake server streams canned chunks with ``trio.sleep`` delays that stand
for a slow model; under ``autojump_clock`` those delays cost no real time and
every timing the client measures is exact.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import socket
import sys

import attrs
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from trioserve.bench import (
    SLO,
    DatasetError,
    PlotUnavailableError,
    ProgressBar,
    RequestMeasurement,
    SampleRequest,
    Target,
    arrival_offsets,
    bench_serve,
    calculate_metrics,
    file_dataset,
    format_table,
    load_tokenizer,
    prefix_dataset,
    random_dataset,
    run_bench_serve,
    run_benchmark,
    write_plots,
)
from trioserve.bench.client import SSEParser, build_payload
from trioserve.bench.metrics import PrefixCacheCounters, parse_prefix_cache_counters, prefix_cache_hit_rate
from trioserve.bench.plot import LATENCY_CDF_PNG, THROUGHPUT_PNG, require_matplotlib

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- fake server -----------------------------------------------------------


@attrs.define
class FakeServer:
    """An ASGI app that streams ``max_tokens`` chunks: the first after
    ``ttft`` seconds, the others ``itl`` apart. A prompt containing FAIL gets
    a 500; one containing STREAMERR gets an error event after two chunks,
    GARBAGE gets data that is not JSON, and NOEOL ends its stream right
    after the last token chunk, without the blank line that ends an event.
    /metrics counts 10 queried tokens per request, all hits for a prompt
    seen before."""

    ttft: float = 0.5
    itl: float = 0.1
    usage: bool = True
    metrics: bool = True
    prompt_tokens: int = 7
    bodies: list = attrs.Factory(list)
    arrivals: list = attrs.Factory(list)
    in_flight: int = 0
    max_in_flight: int = 0
    seen: set = attrs.Factory(set)
    hits: int = 0
    queries: int = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path == "/v1/models":
            await self._reply(send, 200, json.dumps({"object": "list", "data": [{"id": "fake-model"}]}))
        elif path == "/metrics" and self.metrics:
            await self._reply(
                send,
                200,
                "# TYPE trioserve:prefix_cache_hits_total counter\n"
                f"trioserve:prefix_cache_hits_total {self.hits}.0\n"
                f"trioserve:prefix_cache_queries_total {self.queries}.0\n",
            )
        elif path in ("/v1/completions", "/v1/chat/completions"):
            await self._stream(send, json.loads(body), chat=path.endswith("chat/completions"))
        else:
            await self._reply(send, 404, "not found")

    async def _reply(self, send, status, text):
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": text.encode()})

    async def _event(self, send, data):
        payload = data if isinstance(data, str) else json.dumps(data)
        await send({"type": "http.response.body", "body": f"data: {payload}\n\n".encode(), "more_body": True})

    async def _stream(self, send, request, chat):
        self.bodies.append(request)
        self.arrivals.append(trio.current_time())
        prompt = request["messages"][-1]["content"] if chat else request["prompt"]
        if "FAIL" in prompt:
            await self._reply(send, 500, '{"error": {"message": "boom"}}')
            return
        self.queries += 10
        self.hits += 10 if prompt in self.seen else 0
        self.seen.add(prompt)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            if chat:  # a role-only header before any token, as vLLM sends
                await self._event(send, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await trio.sleep(self.ttft)
            if "GARBAGE" in prompt:
                await self._event(send, "{not json")
            n = request["max_tokens"]
            for i in range(n):
                if i:
                    await trio.sleep(self.itl)
                text = f"t{i} "
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                if "NOEOL" in prompt and i == n - 1:
                    last = json.dumps({"choices": [choice]}).encode()
                    await send({"type": "http.response.body", "body": b"data: " + last, "more_body": False})
                    return
                await self._event(send, {"choices": [choice]})
                if "STREAMERR" in prompt and i == 1:
                    await self._event(send, {"error": {"message": "engine died"}})
                    break
            if self.usage and request.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": n}
                await self._event(send, {"choices": [], "usage": usage})
            await self._event(send, "[DONE]")
        finally:
            self.in_flight -= 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def start_fake(nursery, app: FakeServer) -> str:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.errorlog = None
    binds = await nursery.start(serve, app, config)
    return binds[0]


@pytest.fixture
async def fake(nursery):
    app = FakeServer()
    return app, await start_fake(nursery, app)


def samples(n, *, output_len=5, prompt="hello", prompt_len=3):
    return [SampleRequest(f"{prompt} {i}", prompt_len, output_len) for i in range(n)]


# --- tokenizers and datasets --------------------------------------------------


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Serving engines batch requests and cache the prefixes they share.",
        "Trio nurseries make concurrency structured; channels carry messages.",
        "Der schnelle braune Fuchs springt über den faulen Hund. Ça coûte 5 €.",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_path):
    return load_tokenizer(tiny_tokenizer_path)


def n_tokens(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_random_dataset_has_exact_lengths_and_is_seeded(tiny_tokenizer):
    data = random_dataset(tiny_tokenizer, num_prompts=40, input_len=50, output_len=20, range_ratio=0.5, seed=3)
    assert len(data) == 40
    for s in data:
        assert n_tokens(tiny_tokenizer, s.prompt) == s.prompt_len
        assert 25 <= s.prompt_len <= 75 and 10 <= s.output_len <= 30
    assert len({s.prompt_len for s in data}) > 5  # the range ratio spreads lengths
    again = random_dataset(tiny_tokenizer, num_prompts=40, input_len=50, output_len=20, range_ratio=0.5, seed=3)
    assert again == data
    other = random_dataset(tiny_tokenizer, num_prompts=40, input_len=50, output_len=20, range_ratio=0.5, seed=4)
    assert [s.prompt for s in other] != [s.prompt for s in data]
    fixed = random_dataset(tiny_tokenizer, num_prompts=5, input_len=33, output_len=9)
    assert {(s.prompt_len, s.output_len) for s in fixed} == {(33, 9)}


def test_random_dataset_rejects_bad_lengths(tiny_tokenizer):
    with pytest.raises(DatasetError, match="range_ratio"):
        random_dataset(tiny_tokenizer, num_prompts=1, input_len=5, output_len=5, range_ratio=1.0)
    with pytest.raises(DatasetError, match="input_len must be >= 1"):
        random_dataset(tiny_tokenizer, num_prompts=1, input_len=0, output_len=5)


def test_prefix_dataset_shares_its_prefix(tiny_tokenizer):
    data = prefix_dataset(tiny_tokenizer, num_prompts=12, prefix_len=80, suffix_len=10, output_len=4, seed=1)
    common = os.path.commonprefix([s.prompt for s in data])
    assert n_tokens(tiny_tokenizer, common) >= 79  # the shared part is the whole prefix
    assert len({s.prompt for s in data}) == 12
    for s in data:
        assert s.prompt_len == 90 == n_tokens(tiny_tokenizer, s.prompt)
    two = prefix_dataset(tiny_tokenizer, num_prompts=10, prefix_len=40, suffix_len=5, output_len=4, num_prefixes=2)
    heads = {s.prompt[:20] for s in two}
    assert len(heads) == 2
    assert sorted(sum(s.prompt.startswith(h) for s in two) for h in heads) == [5, 5]


def test_file_dataset_jsonl_and_json(tmp_path, tiny_tokenizer):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "The quick brown fox", "output_len": 7}\n\n{"prompt": "lazy dog"}\n')
    data = file_dataset(jsonl, tiny_tokenizer, output_len=32)
    assert [(s.prompt, s.output_len) for s in data] == [("The quick brown fox", 7), ("lazy dog", 32)]
    assert data[0].prompt_len == n_tokens(tiny_tokenizer, "The quick brown fox")
    cycled = file_dataset(jsonl, tiny_tokenizer, output_len=32, num_prompts=5)
    assert [s.prompt for s in cycled] == ["The quick brown fox", "lazy dog"] * 2 + ["The quick brown fox"]
    as_list = tmp_path / "prompts.json"
    as_list.write_text(json.dumps([{"prompt": "a b"}, {"prompt": "c", "output_len": 2}]))
    assert [s.output_len for s in file_dataset(as_list, tiny_tokenizer, output_len=9)] == [9, 2]


def test_file_dataset_errors_name_the_line(tmp_path, tiny_tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: expected an object with a string 'prompt'"):
        file_dataset(bad, tiny_tokenizer, output_len=4)
    bad.write_text('{"prompt": "ok", "output_len": 0}\n')
    with pytest.raises(DatasetError, match="output_len"):
        file_dataset(bad, tiny_tokenizer, output_len=4)
    bad.write_text('{"prompt": "ok"}\n{oops\n')
    with pytest.raises(DatasetError, match="invalid JSON at line 1"):
        file_dataset(bad, tiny_tokenizer, output_len=4)
    with pytest.raises(DatasetError, match="cannot read dataset"):
        file_dataset(tmp_path / "missing.jsonl", tiny_tokenizer, output_len=4)


@pytest.mark.slow
def test_random_dataset_exact_with_default_tokenizer():
    tokenizer = load_tokenizer()
    data = random_dataset(tokenizer, num_prompts=20, input_len=128, output_len=8, range_ratio=0.9, seed=7)
    assert all(n_tokens(tokenizer, s.prompt) == s.prompt_len for s in data)
    shared = prefix_dataset(tokenizer, num_prompts=4, prefix_len=200, suffix_len=20, output_len=8)
    assert all(n_tokens(tokenizer, s.prompt) == s.prompt_len == 220 for s in shared)


# --- metrics on synthetic records -----------------------------------------------


def out(ttft, itl, *, tokens=None, prompt_len=10, success=True, error=""):
    itl = tuple(itl)
    return RequestMeasurement(
        success=success,
        prompt_len=prompt_len,
        output_tokens=len(itl) + 1 if tokens is None else tokens,
        ttft=ttft,
        itl=itl,
        e2el=ttft + sum(itl),
        error=error,
    )


def test_metric_definitions_on_known_timings():
    outputs = [
        out(0.1, [0.02, 0.02, 0.02], prompt_len=10),  # 4 tokens, e2e 0.16, tpot 0.02
        out(0.3, [0.05, 0.07], prompt_len=20),  # 3 tokens, e2e 0.42, tpot 0.06
        out(0.2, [], prompt_len=30),  # 1 token: no TPOT, no ITL
        out(0.0, [], success=False, error="HTTP 500: boom", prompt_len=99),
    ]
    m = calculate_metrics(outputs, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert m.errors == {"HTTP 500: boom": 1}
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 8)  # failed requests count for nothing
    assert m.request_throughput == 1.5
    assert m.output_throughput == 4.0
    assert m.total_token_throughput == 34.0
    assert m.ttft.mean == pytest.approx(200.0) and m.ttft.median == pytest.approx(200.0)
    assert m.ttft.p90 == pytest.approx(280.0) and m.ttft.p99 == pytest.approx(298.0)
    assert m.tpot.mean == pytest.approx(40.0) and m.tpot.median == pytest.approx(40.0)
    assert m.tpot.std == pytest.approx(20.0)
    assert m.itl.mean == pytest.approx(36.0) and m.itl.median == pytest.approx(20.0)
    assert m.itl.p90 == pytest.approx(62.0)
    assert m.e2el.mean == pytest.approx((160 + 420 + 200) / 3)
    assert m.request_goodput is None


def test_tpot_uses_reported_token_count_not_chunks():
    # Two chunks that carried 5 tokens between them (the server bundled them).
    m = calculate_metrics([out(0.1, [0.4], tokens=5)], duration_s=1.0)
    assert m.tpot.mean == pytest.approx(100.0)  # (0.5 - 0.1) / 4
    assert m.itl.mean == pytest.approx(400.0)


def test_goodput_counts_requests_meeting_every_slo():
    outputs = [
        out(0.1, [0.02, 0.02]),  # ttft 100, tpot 20, e2e 140
        out(0.3, [0.01]),  # ttft 300, tpot 10, e2e 310
        out(0.1, [0.09, 0.09]),  # ttft 100, tpot 90, e2e 280
        out(0.15, []),  # one token: tpot counts as 0
        out(0.0, [], success=False),
    ]
    assert calculate_metrics(outputs, 2.0, SLO(ttft_ms=200)).request_goodput == 1.5
    assert calculate_metrics(outputs, 2.0, SLO.parse(["ttft:200", "tpot:50"])).request_goodput == 1.0
    assert calculate_metrics(outputs, 2.0, SLO.parse(["e2el:300"])).request_goodput == 1.5
    assert calculate_metrics(outputs, 2.0, SLO.parse(["tpot:9"])).request_goodput == 0.5


def test_slo_parse_rejects_bad_specs():
    assert SLO.parse(["ttft:250", "e2el:1000.5"]) == SLO(ttft_ms=250.0, e2el_ms=1000.5)
    with pytest.raises(ValueError, match="expected ttft:MS"):
        SLO.parse(["latency:5"])
    with pytest.raises(ValueError, match="not a number"):
        SLO.parse(["ttft:fast"])


def test_metrics_with_nothing_completed_are_na():
    m = calculate_metrics([out(0, [], success=False, error="x")], duration_s=1.0)
    assert (m.completed, m.ttft, m.tpot, m.itl, m.e2el) == (0, None, None, None, None)
    table = format_table(m)
    assert "Mean TTFT (ms):" in table and "n/a" in table and "Prefix cache hit rate (%):" in table


def test_prefix_cache_counters_from_prometheus_text():
    trioserve = "trioserve:prefix_cache_hits_total 30.0\ntrioserve:prefix_cache_queries_total 120.0\n"
    assert parse_prefix_cache_counters(trioserve) == PrefixCacheCounters(30.0, 120.0)
    vllm = (
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n"
        '# TYPE vllm:prefix_cache_hits_total counter\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 20.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0\n'
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n'
    )
    assert parse_prefix_cache_counters(vllm) == PrefixCacheCounters(120.0, 300.0)
    assert parse_prefix_cache_counters("other_metric 1\n") is None
    assert prefix_cache_hit_rate(PrefixCacheCounters(10, 100), PrefixCacheCounters(40, 160)) == 0.5
    assert prefix_cache_hit_rate(PrefixCacheCounters(10, 100), PrefixCacheCounters(10, 100)) is None
    assert prefix_cache_hit_rate(None, PrefixCacheCounters(1, 2)) is None


# --- client pieces ---------------------------------------------------------------


def test_sse_parser_handles_split_chunks_crlf_and_comments():
    parser = SSEParser()
    assert parser.feed(b": ping\n\ndata: {\"a\"") == []
    assert parser.feed(b": 1}\r\n\r\ndata: x\ndata: y\n") == ['{"a": 1}']
    assert parser.feed(b"\ndata: \xc3") == ["x\ny"]
    assert parser.feed(b"\xa9\n\n") == ["\u00e9"]
    assert parser.feed(b"data: [DONE]") == []
    assert parser.close() == ["[DONE]"]


def test_payloads_for_completions_and_chat():
    sample = SampleRequest("hi", 1, 16)
    plain = build_payload(Target("http://h/", "m"), sample)
    assert plain == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 16,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chat = build_payload(Target("http://h", "m", endpoint="/v1/chat/completions", ignore_eos=True), sample)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat
    assert chat["ignore_eos"] is True
    assert Target("http://h/", "m").url == "http://h/v1/completions"


def test_arrival_offsets_are_seeded_gamma_gaps():
    offsets = arrival_offsets(50, request_rate=10.0, seed=1)
    assert offsets == sorted(offsets) and offsets[-1] == pytest.approx(5.0)
    assert offsets == arrival_offsets(50, 10.0, seed=1) != arrival_offsets(50, 10.0, seed=2)
    assert arrival_offsets(4, 2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    # Lower burstiness: more unequal gaps for the same mean.
    def spread(b):
        o = [0.0] + arrival_offsets(2000, 10.0, burstiness=b, seed=5)
        gaps = [y - x for x, y in zip(o, o[1:])]
        return max(gaps) / (sum(gaps) / len(gaps))
    assert spread(0.2) > spread(1.0) > spread(20.0)
    with pytest.raises(ValueError, match="burstiness must be > 0"):
        arrival_offsets(3, 1.0, burstiness=0)


def test_progress_bar_draws_on_its_stream():
    stream = io.StringIO()
    bar = ProgressBar(3, stream, label="c=4", width=6)
    bar(out(0.1, []))
    bar(out(0, [], success=False))
    assert stream.getvalue().endswith("\rc=4 [####..] 2/3, 1 failed")
    bar(out(0.1, []))
    assert stream.getvalue().endswith("\rc=4 [######] 3/3, 1 failed\n")


# --- against the fake server -----------------------------------------------------


async def test_timings_counts_and_throughput(fake, autojump_clock):
    app, url = fake
    target = Target(url, "fake-model", ignore_eos=True)
    run = await run_benchmark(target, samples(4), max_concurrency=1)
    assert [o.success for o in run.outputs] == [True] * 4
    for o in run.outputs:
        assert o.ttft == pytest.approx(0.5)
        assert o.itl == pytest.approx((0.1,) * 4)
        assert o.e2el == pytest.approx(0.9)
        assert (o.output_tokens, o.prompt_len) == (5, 7)  # from the server's usage
        assert o.generated_text == "t0 t1 t2 t3 t4 "
    assert run.duration_s == pytest.approx(3.6)
    m = calculate_metrics(run.outputs, run.duration_s, SLO(ttft_ms=600), run.prefix_cache_hit_rate)
    assert m.request_throughput == pytest.approx(4 / 3.6)
    assert m.output_throughput == pytest.approx(20 / 3.6)
    assert m.total_token_throughput == pytest.approx(48 / 3.6)
    assert m.tpot.mean == pytest.approx(100.0) and m.itl.p99 == pytest.approx(100.0)
    assert m.request_goodput == pytest.approx(4 / 3.6)
    assert calculate_metrics(run.outputs, run.duration_s, SLO(ttft_ms=400)).request_goodput == 0.0
    assert run.prefix_cache_hit_rate == 0.0  # four distinct prompts
    body = app.bodies[0]
    assert (body["max_tokens"], body["temperature"], body["ignore_eos"]) == (5, 0.0, True)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


async def test_failed_requests_are_counted(fake, autojump_clock):
    app, url = fake
    batch = samples(3) + [SampleRequest(p, 3, 5) for p in ("FAIL me", "STREAMERR", "GARBAGE")]
    run = await run_benchmark(Target(url, "fake-model"), batch)
    m = calculate_metrics(run.outputs, run.duration_s)
    assert (m.completed, m.failed) == (3, 3)
    assert run.outputs[3].error.startswith("HTTP 500: ") and "boom" in run.outputs[3].error
    assert "engine died" in run.outputs[4].error
    assert "malformed SSE data: {not json" in run.outputs[5].error
    assert len(m.errors) == 3
    assert m.total_output_tokens == 15 and m.request_throughput == pytest.approx(3 / 0.9)


async def test_unreachable_server_fails_requests_not_the_run(autojump_clock):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = await run_benchmark(Target(f"http://127.0.0.1:{port}", "m"), samples(2))
    assert [o.success for o in run.outputs] == [False, False]
    assert "ConnectError" in run.outputs[0].error
    assert run.prefix_cache_hit_rate is None


async def test_stream_cut_after_the_last_chunk_still_counts_it(fake, autojump_clock):
    app, url = fake
    (o,) = (await run_benchmark(Target(url, "fake-model"), [SampleRequest("NOEOL", 3, 4)])).outputs
    assert o.success and o.generated_text == "t0 t1 t2 t3 " and o.output_tokens == 4
    assert o.e2el == pytest.approx(0.8)


async def test_without_usage_counts_chunks(nursery, autojump_clock):
    app = FakeServer(usage=False, metrics=False)
    url = await start_fake(nursery, app)
    run = await run_benchmark(Target(url, "fake-model"), samples(2, output_len=6, prompt_len=11))
    assert [(o.output_tokens, o.prompt_len) for o in run.outputs] == [(6, 11), (6, 11)]
    assert run.prefix_cache_hit_rate is None


async def test_chat_endpoint_ignores_the_role_header_for_ttft(fake, autojump_clock):
    app, url = fake
    target = Target(url, "fake-model", endpoint="/v1/chat/completions")
    run = await run_benchmark(target, samples(2, output_len=3))
    for o in run.outputs:
        assert o.success and o.ttft == pytest.approx(0.5) and o.e2el == pytest.approx(0.7)
        assert o.generated_text == "t0 t1 t2 "
    assert app.bodies[0]["messages"] == [{"role": "user", "content": "hello 0"}]


async def test_concurrency_limit_holds(fake, autojump_clock):
    app, url = fake
    run = await run_benchmark(Target(url, "fake-model"), samples(7, output_len=2), max_concurrency=2)
    assert app.max_in_flight == 2
    assert run.duration_s == pytest.approx(4 * 0.6)  # ceil(7 / 2) waves of 0.6 s


async def test_request_rate_paces_arrivals(fake, autojump_clock):
    app, url = fake
    run = await run_benchmark(Target(url, "fake-model"), samples(6, output_len=1), request_rate=4.0, seed=9)
    expected = arrival_offsets(6, 4.0, seed=9)
    arrived = sorted(app.arrivals)
    first = arrived[0] - expected[0]
    assert [a - first for a in arrived] == pytest.approx(expected)
    assert run.duration_s == pytest.approx(expected[-1] + 0.5)


async def test_warmups_are_excluded_and_precede_the_cache_reading(fake, autojump_clock):
    app, url = fake
    batch = samples(3)
    run = await run_benchmark(Target(url, "fake-model"), batch, warmups=batch)
    assert len(run.outputs) == 3 and len(app.bodies) == 6
    # The warm-up sent the same prompts: every timed query is a hit.
    assert run.prefix_cache_hit_rate == 1.0
    assert run.duration_s == pytest.approx(0.9)


# --- the command line ---------------------------------------------------------------


def parse(argv):
    from trioserve.web.cli import build_parser

    return build_parser().parse_args(["bench", "serve", *argv])


async def test_cli_sweep_writes_json_table_and_plots(fake, tmp_path, tiny_tokenizer_path, capsys, autojump_clock):
    app, url = fake
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}", "output_len": 3}) + "\n" for i in range(4)))
    result = tmp_path / "out" / "result.json"
    args = parse([
        "--base-url", url, "--dataset", "file", "--dataset-path", str(data), "--tokenizer", str(tiny_tokenizer_path),
        "--num-prompts", "4", "--num-warmups", "1", "--sweep-concurrency", "1,2", "--goodput", "ttft:600",
        "--result-json", str(result), "--plot", str(tmp_path / "plots"), "--save-detailed",
    ])  # fmt: skip
    assert args.func is run_bench_serve
    assert await bench_serve(args) == 0
    captured = capsys.readouterr()
    assert "Serving Benchmark Result (concurrency 2)" in captured.out and "P99 ITL (ms):" in captured.out
    assert "conc" in captured.out  # the sweep summary
    assert "concurrency 1 [" in captured.err and "4/4" in captured.err  # the progress bar
    document = json.loads(result.read_text())
    assert document["sweep_concurrency"] == [1, 2]
    first, second = document["runs"]
    assert first["model"] == "fake-model" == app.bodies[0]["model"]  # asked GET /v1/models
    assert (first["max_concurrency"], second["max_concurrency"]) == (1, 2)
    assert first["completed"] == 4 and first["failed"] == 0 and first["request_rate"] is None
    assert first["duration"] == pytest.approx(4 * 0.7) and second["duration"] == pytest.approx(2 * 0.7)
    assert first["total_output_tokens"] == 12 and first["request_goodput"] == pytest.approx(4 / 2.8)
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p50", "p90", "p99", "std"):
            assert f"{stat}_{key}_ms" in first
    assert first["mean_ttft_ms"] == pytest.approx(500.0) and first["p99_e2el_ms"] == pytest.approx(700.0)
    assert first["goodput_slo_ms"] == {"ttft": 600.0}
    assert first["ttfts"] == pytest.approx([0.5] * 4) and first["itls"][0] == pytest.approx([0.1, 0.1])
    # The warm-up repeated prompt 0 right before each run.
    assert first["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert second["prefix_cache_hit_rate"] == 1.0
    for name in (THROUGHPUT_PNG, LATENCY_CDF_PNG):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG_MAGIC


async def test_cli_sync_entry_point_with_random_dataset(nursery, tmp_path, tiny_tokenizer_path, capsys):
    app = FakeServer(ttft=0.001, itl=0.001, metrics=False)
    url = await start_fake(nursery, app)
    result = tmp_path / "r.json"
    args = parse([
        "--base-url", url, "--model", "served", "--tokenizer", str(tiny_tokenizer_path), "--num-prompts", "5",
        "--input-len", "12", "--output-len", "2", "--max-concurrency", "3", "--result-json", str(result),
        "--no-progress",
    ])  # fmt: skip
    assert await trio.to_thread.run_sync(run_bench_serve, args) == 0
    document = json.loads(result.read_text())
    assert document["completed"] == 5 and document["prefix_cache_hit_rate"] is None
    assert document["total_input_tokens"] == 35  # the fake server's usage: 7 per request
    assert "ttfts" not in document
    assert {b["model"] for b in app.bodies} == {"served"}
    assert len(set(b["prompt"] for b in app.bodies)) == 5
    assert re.search(r"Prefix cache hit rate \(%\): +n/a", capsys.readouterr().out)


async def test_cli_reports_setup_errors(tmp_path, tiny_tokenizer_path, capsys, autojump_clock):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = ["--base-url", f"http://127.0.0.1:{port}", "--tokenizer", str(tiny_tokenizer_path), "--num-prompts", "2"]
    assert await bench_serve(parse(base)) == 2
    assert "cannot list models at" in capsys.readouterr().err
    assert await bench_serve(parse([*base, "--model", "m", "--goodput", "ttft=5"])) == 2
    assert "expected ttft:MS" in capsys.readouterr().err
    assert await bench_serve(parse([*base, "--model", "m", "--base-url", "localhost:8000"])) == 2
    assert "--base-url must start with http://" in capsys.readouterr().err
    assert await bench_serve(parse([*base, "--model", "m", "--dataset", "file"])) == 2
    assert "--dataset file needs --dataset-path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--sweep-concurrency", "1,0"])


async def test_all_failed_run_exits_1(fake, tmp_path, tiny_tokenizer_path, capsys, autojump_clock):
    app, url = fake
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "FAIL"}\n')
    args = parse(["--base-url", url, "--model", "m", "--dataset", "file", "--dataset-path", str(data),
                  "--tokenizer", str(tiny_tokenizer_path), "--num-prompts", "3", "--no-progress"])  # fmt: skip
    assert await bench_serve(args) == 1
    assert "     3 x HTTP 500: " in capsys.readouterr().out


def test_plots_need_matplotlib(monkeypatch, tmp_path):
    run_outputs = (out(0.1, [0.1]), out(0.2, [0.1]))
    from trioserve.bench import RunResult

    runs = [RunResult(run_outputs, 1.0, None, math.inf, 1.0, None)]
    assert write_plots(tmp_path, runs) == [tmp_path / LATENCY_CDF_PNG]  # unbounded: no throughput axis
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailableError, match=r"pip install 'trioserve\[plot\]'"):
        require_matplotlib()


async def test_cli_checks_matplotlib_before_running(fake, monkeypatch, tiny_tokenizer_path, capsys, tmp_path):
    app, url = fake
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = parse(["--base-url", url, "--model", "m", "--tokenizer", str(tiny_tokenizer_path),
                  "--num-prompts", "2", "--plot", str(tmp_path)])  # fmt: skip
    assert await bench_serve(args) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert app.bodies == []
