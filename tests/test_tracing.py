"""Request tracing (web/tracing.py): spans read back from the OpenTelemetry
SDK's in-memory exporter for requests to a real loopback server on the tiny
model, the request timeline the engine carries in ``RequestTimes``, and the
OTLP/HTTP export to a stand-in collector on loopback."""

from __future__ import annotations

import http.server
import logging
import threading

import httpx
import pytest
import trio
from actor_fixtures import tiny_loaded
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from trioserve import testing
from trioserve.engine.core.engine_core import EngineCore
from trioserve.web.app import create_app
from trioserve.web.cli import main
from trioserve.web.request_ids import HEADER
from trioserve.web.settings import ServerConfig
from trioserve.web.tracing import Tracing, TracingUnavailable, traces_url, tracing_wanted

from server_fixtures import MODEL, read_sse_lines, serving
from test_step_plan import REQUESTS

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "ignore_eos": True}


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


def traced_app(exporter, **server):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = ServerConfig(engine=testing.engine_config(), shutdown_timeout=5.0, **server)
    return create_app(config, loaded=testing.tiny_loaded(), tracing=Tracing(provider))


def event_names(span) -> list[str]:
    return [event.name for event in span.events]


async def test_a_streamed_chat_is_one_span_under_the_callers_trace(exporter):
    async with serving(traced_app(exporter)) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        body = {**CHAT, "stream": True, "temperature": 0.5, "top_p": 0.9, "seed": 3}
        headers = {"traceparent": TRACEPARENT, HEADER: "trace-1"}
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            events = [e async for e in read_sse_lines(response)]
        assert events[-1] == "[DONE]"
        assert (await http.get("/health")).status_code == 200  # not a generation: no span
    [span] = exporter.get_finished_spans()
    assert span.name == f"chat {MODEL}" and span.kind is SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID and span.parent.is_remote
    attributes = dict(span.attributes)
    assert attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": MODEL,
        "gen_ai.response.id": "trace-1",
        "trioserve.request_id": "trace-1",
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.max_tokens": 5,
        "gen_ai.request.seed": 3,
        "http.response.status_code": 200,
        "gen_ai.usage.input_tokens": attributes["gen_ai.usage.input_tokens"],
        "gen_ai.usage.output_tokens": 5,
        "gen_ai.response.finish_reasons": ("length",),
    }
    assert attributes["gen_ai.usage.input_tokens"] > 1
    assert event_names(span) == ["queued", "admitted", "first_scheduled", "first_token", "finished"]
    times = [event.timestamp for event in span.events]
    assert times == sorted(times) and span.start_time <= times[0] and times[-1] <= span.end_time
    assert span.events[-1].attributes["gen_ai.response.finish_reason"] == "length"
    assert span.status.status_code is StatusCode.UNSET


async def test_malformed_traceparent_is_ignored_with_a_log_line(exporter, caplog):
    caplog.set_level(logging.INFO, logger="trioserve.web.tracing")
    async with serving(traced_app(exporter)) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2, "seed": 1, "ignore_eos": True}
        response = await http.post("/v1/completions", json=body, headers={"traceparent": "00-not-a-trace-01"})
        assert response.status_code == 200
    [span] = exporter.get_finished_spans()
    assert span.parent is None and span.name == f"text_completion {MODEL}"
    assert span.attributes["gen_ai.request.choice.count"] == 2
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length", "length")
    assert span.attributes["gen_ai.usage.output_tokens"] == 4
    # Each completion has its own points, told apart by index.
    firsts = [e.attributes["gen_ai.response.choice.index"] for e in span.events if e.name == "first_token"]
    assert sorted(firsts) == [0, 1]
    [line] = [r.getMessage() for r in caplog.records if "traceparent" in r.getMessage()]
    assert line == "ignored malformed traceparent '00-not-a-trace-01': the span starts a new trace"


async def test_deadline_abort_and_refusal_spans(exporter):
    long = {**CHAT, "max_tokens": 200, "stream": True}
    async with serving(traced_app(exporter)) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        # A deadline that passes long before 200 tokens.
        timed = await http.post("/v1/chat/completions", json={**long, "stream": False}, headers={"X-Request-Timeout": "0.01"})
        assert timed.status_code == 504
        # A client that goes away mid-stream.
        async with http.stream("POST", "/v1/chat/completions", json=long, headers={HEADER: "gone-1"}) as response:
            await anext(read_sse_lines(response))
        # A refusal: no messages.
        refused = await http.post("/v1/chat/completions", json={"model": MODEL})
        assert refused.status_code == 400
        with trio.fail_after(10):
            while len(exporter.get_finished_spans()) < 3:  # the disconnect lands at the engine's pace
                await trio.sleep(0.01)
    deadline, gone, bad = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time)
    assert "deadline" in event_names(deadline) and deadline.attributes["gen_ai.response.finish_reasons"] == ("timeout",)
    assert event_names(deadline)[-2:] == ["deadline", "finished"]
    [aborted] = [e for e in gone.events if e.name == "aborted"]
    assert aborted.attributes["trioserve.abort.cause"] == "client disconnected"
    assert gone.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert gone.attributes["gen_ai.response.id"] == "gone-1"
    assert bad.attributes["http.response.status_code"] == 400
    assert bad.attributes["error.type"] == "invalid_request_error"
    assert not bad.events and "gen_ai.response.id" not in bad.attributes


async def test_a_request_without_the_api_key_has_its_span(exporter):
    async with serving(traced_app(exporter, api_key="k")) as server, httpx.AsyncClient(base_url=server.url) as http:
        refused = await http.post("/v1/chat/completions", json=CHAT, headers={HEADER: "nokey-1"})
        assert refused.status_code == 401
    [span] = exporter.get_finished_spans()
    assert span.attributes["http.response.status_code"] == 401
    assert span.attributes["error.type"] == "invalid_api_key"
    assert span.attributes["trioserve.request_id"] == "nokey-1"
    assert span.status.status_code is StatusCode.UNSET  # a client's error, not the server's


def test_the_timeline_records_each_preemption():
    # 4 blocks of 16 tokens for 7 sequences of about 30: preemptions happen.
    core = EngineCore(tiny_loaded(), testing.engine_config(num_blocks=4))
    for request_id, prompt, params in REQUESTS:
        core.add_request(request_id, prompt, params)
    finals = []
    while core.has_unfinished():
        finals += [o for o in core.step() if o.finished]
    preemptions = [t for o in finals for t in o.times.preemptions]
    assert len(preemptions) == core.scheduler.statistics().num_preemptions > 0
    for output in finals:
        t = output.times
        assert t.arrival <= t.admitted <= t.first_scheduled <= t.first_token <= t.now
        assert list(t.preemptions) == sorted(t.preemptions)
        assert all(t.first_scheduled <= p <= t.now for p in t.preemptions)


def test_tracing_is_off_unless_asked(capsys):
    assert not tracing_wanted(None, {})
    assert tracing_wanted("http://127.0.0.1:4318", {})
    assert tracing_wanted(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert not tracing_wanted("http://127.0.0.1:4318", {"OTEL_SDK_DISABLED": "true"})
    assert Tracing.from_endpoint(None, {}) is None
    app = create_app(ServerConfig(engine=testing.engine_config()), loaded=testing.tiny_loaded())
    hooks = [f.__qualname__ for f in app.before_request_funcs[None]]
    assert not any("tracing" in name for name in hooks), hooks
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
        traces_url("c:4317")
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
        ServerConfig(otlp_traces_endpoint="collector:4318")
    assert main(["serve", "--otlp-traces-endpoint", "collector:4318"]) == 2
    assert "otlp_traces_endpoint must be an http:// or https:// URL, got 'collector:4318'" in capsys.readouterr().err
    with pytest.raises(TracingUnavailable, match="opentelemetry-exporter-otlp-proto-grpc"):
        Tracing.from_endpoint("http://c:4317", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})


class _Collector(http.server.BaseHTTPRequestHandler):
    """A stand-in OTLP/HTTP collector: keeps each export's decoded body."""

    received: list[tuple[str, ExportTraceServiceRequest]]

    def do_POST(self) -> None:  # noqa: N802 (the handler's API)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, ExportTraceServiceRequest.FromString(body)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


async def test_otlp_traces_endpoint_exports_over_http(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "trioserve-test")
    received: list = []
    handler = type("Collector", (_Collector,), {"received": received})
    collector = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
        config = ServerConfig(engine=testing.engine_config(), shutdown_timeout=5.0, otlp_traces_endpoint=endpoint)
        app = create_app(config, loaded=testing.tiny_loaded())
        async with serving(app) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http_client:
            response = await http_client.post("/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT})
            assert response.status_code == 200
        # Leaving the server flushed the batch (after_serving).
    finally:
        collector.shutdown()
        thread.join()
    [(path, export)] = received
    assert path == "/v1/traces"
    [resource_spans] = export.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "trioserve-test"
    [span] = [s for scope in resource_spans.scope_spans for s in scope.spans]
    assert span.name == f"chat {MODEL}" and span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert [e.name for e in span.events] == ["queued", "admitted", "first_scheduled", "first_token", "finished"]
    attributes = {a.key: a.value for a in span.attributes}
    assert attributes["gen_ai.usage.output_tokens"].int_value == 5
    assert attributes["gen_ai.request.model"].string_value == MODEL
