"""Latency objectives on every API surface (issue #44): ``/v1/responses``
with the ``openai`` client, ``/v1/messages`` with the ``anthropic``
client and gRPC's ``Generate`` over a real channel, against real loopback
servers on the tiny model, one with ``--scheduling-policy slo`` and one
without, both traced to an in-memory exporter. Each surface validates,
refuses (in its own error shape), admits best effort and reports
``usage.slo`` as ``/v1/chat/completions`` does (tests/test_slo_web.py);
the door's decision is on the request's span and in /metrics."""

from __future__ import annotations

import contextlib
import uuid

import anthropic
import grpc
import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from trioserve import testing
from trioserve.actors.slo_admission import SloDecision, SloPrediction, SloRefused
from trioserve.engine.core.latency_model import LatencyModel, StepShape
from trioserve.engine.latency_objectives import LatencyObjectives
from trioserve.rpc import messages as rpc_messages
from trioserve.rpc import trioserve_pb2 as pb
from trioserve.rpc import trioserve_pb2_grpc as pb_grpc
from trioserve.web.anthropic_api import error_json
from trioserve.web.anthropic_messages import MessagesBody
from trioserve.web.app import app_grpc, create_app
from trioserve.web.errors import from_exception
from trioserve.web.openai_responses import ResponsesBody
from trioserve.web.protocol import ChatCompletionRequest
from trioserve.web.request_ids import HEADER
from trioserve.web.slo import SloReport
from trioserve.web.slo_metrics import SloMetrics
from trioserve.web.tracing import Tracing

from server_fixtures import MODEL, metric_values, server_config, server_in_thread

# A TTFT (or TPOT) target no step can meet (a microsecond): refused whatever the load.
IMPOSSIBLE_MS = 0.001
LOOSE_MS = 600_000
CHAT = [{"role": "user", "content": "Hi"}]
BAD_TARGETS = [
    ({"ttft_ms": -5}, "ttft_ms"),
    ({"tpot_ms": 86_400_001}, "tpot_ms"),
    ({"slo_mode": "whenever"}, "slo_mode"),
    ({"slo_allow_shorter": "yes"}, "slo_allow_shorter"),
    ({"headers": {"x-slo-ttft-ms": "soon"}}, "x-slo-ttft-ms"),
]


@pytest.fixture(scope="module")
def exporter():
    return InMemorySpanExporter()


def _app(exporter, **engine):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = server_config(engine=engine, grpc_port=0)
    return create_app(config, loaded=testing.tiny_loaded(), tracing=Tracing(provider))


@pytest.fixture(scope="module")
def slo_server(exporter):
    with server_in_thread(_app(exporter, scheduling_policy="slo")) as running:
        yield running


@pytest.fixture(scope="module")
def plain_server(exporter):
    with server_in_thread(_app(exporter)) as running:
        yield running


def _request_id() -> str:
    return f"slo-{uuid.uuid4().hex[:12]}"


def _metrics(server) -> dict[str, float]:
    return metric_values(httpx.get(f"{server.url}/metrics", timeout=60).text)


def _grew(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _decisions(server, action, priority: int = 0) -> dict[str, float]:
    """How ``action()`` moved the door's counts and the histograms of the
    ``priority`` class: {"refused_ttft": 1.0, "predicted_ttft": 1.0, ...}."""
    before = _metrics(server)
    action()
    after = _metrics(server)
    moved = {}
    for decision in ("admitted", "refused_ttft", "refused_tpot", "shortened", "not_enforced"):
        key = f"trioserve:slo_requests_total{{decision={decision},priority={priority}}}"
        moved[decision] = _grew(before, after, key)
    for objective in ("ttft", "tpot"):
        for outcome in ("met", "missed"):
            key = f"trioserve:slo_outcomes_total{{objective={objective},outcome={outcome},priority={priority}}}"
            moved[f"{objective}_{outcome}"] = _grew(before, after, key)
        for kind in ("predicted", "measured"):
            key = f"trioserve:slo_{kind}_{objective}_seconds_count{{priority={priority}}}"
            moved[f"{kind}_{objective}"] = _grew(before, after, key)
        key = f"trioserve:slo_{objective}_relative_error_count{{priority={priority}}}"
        moved[f"{objective}_error"] = _grew(before, after, key)
    return {name: value for name, value in moved.items() if value}


# What one judged request that ran moves: each prediction against what came.
OBSERVED = {
    "predicted_ttft": 1, "measured_ttft": 1, "ttft_error": 1,
    "predicted_tpot": 1, "measured_tpot": 1, "tpot_error": 1,
}  # fmt: skip


def _slo_events(exporter, request_id: str) -> list[tuple[str, dict]]:
    """The ``slo.*`` events of the one span of ``request_id`` (the
    request's id once queued, else the HTTP request's)."""
    spans = [
        span
        for span in exporter.get_finished_spans()
        if request_id in (span.attributes.get("gen_ai.response.id"), span.attributes.get("trioserve.request_id"))
    ]
    assert len(spans) == 1, [s.name for s in spans]
    return [(e.name, dict(e.attributes)) for e in spans[0].events if e.name.startswith("slo.")]


# -- /v1/responses, with the openai client ---------------------------------------


def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _respond(server, request_id: str | None = None, **extra):
    headers = {HEADER: request_id or _request_id(), **extra.pop("headers", {})}
    extra.setdefault("ignore_eos", True)  # two tokens or more: a TPOT is measured
    with _openai(server) as client:
        return client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=3, extra_body=extra, extra_headers=headers
        )


@pytest.mark.parametrize(("extra", "param"), BAD_TARGETS)
def test_responses_bad_target_is_a_400_naming_its_field(plain_server, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        _respond(plain_server, **extra)
    assert refused.value.body["param"] == param


def test_responses_refuses_what_cannot_meet_its_targets(slo_server, exporter):
    request_id = _request_id()

    def refuse() -> None:
        with pytest.raises(openai.RateLimitError) as ttft:
            _respond(slo_server, request_id, ttft_ms=IMPOSSIBLE_MS)
        assert int(ttft.value.response.headers["retry-after"]) >= 1
        body = ttft.value.body
        assert (body["code"], body["param"], body["type"]) == ("slo_unattainable", "ttft_ms", "rate_limit_error")
        assert "exceeds ttft_ms 0.001 by" in body["message"]
        # The header's target, the same. A shorter answer is allowed, but
        # a 3-token request has none of 16 tokens or more: refused for TPOT.
        with pytest.raises(openai.RateLimitError):
            _respond(slo_server, headers={"x-slo-ttft-ms": str(IMPOSSIBLE_MS)})
        with pytest.raises(openai.RateLimitError) as tpot:
            _respond(slo_server, ttft_ms=LOOSE_MS, tpot_ms=IMPOSSIBLE_MS, slo_allow_shorter=True)
        assert tpot.value.body["param"] == "tpot_ms"

    assert _decisions(slo_server, refuse) == {"refused_ttft": 2, "refused_tpot": 1}
    [(name, attributes)] = _slo_events(exporter, request_id)
    assert name == "slo.refused" and attributes["trioserve.slo.objective"] == "ttft_ms"
    assert attributes["trioserve.slo.predicted_ms"] > attributes["trioserve.slo.target_ms"] == IMPOSSIBLE_MS


def test_responses_best_effort_is_admitted_and_reported_in_usage(slo_server, exporter):
    request_id = _request_id()
    replies = []

    def admit() -> None:
        extra = {"ttft_ms": IMPOSSIBLE_MS, "tpot_ms": LOOSE_MS, "slo_mode": "best_effort", "priority": 1}
        replies.append(_respond(slo_server, request_id, **extra))

    # Counted in its own priority class.
    assert _decisions(slo_server, admit, priority=1) == {"admitted": 1, "ttft_missed": 1, "tpot_met": 1, **OBSERVED}
    slo = replies[0].usage.model_extra["slo"]
    assert slo["enforced"] is True and slo["slo_mode"] == "best_effort"
    assert slo["predicted"]["ttft_ms"] > 0 and slo["met"] == {"ttft": False, "tpot": True}
    [(name, attributes)] = _slo_events(exporter, request_id)
    assert name == "slo.admitted" and attributes["trioserve.slo.predicted_ttft_ms"] > 0
    assert attributes["trioserve.slo.ttft_ms"] == IMPOSSIBLE_MS and attributes["trioserve.slo.mode"] == "best_effort"
    # Streamed: the usage of the whole response the last event carries
    # (incomplete: it ran to max_output_tokens).
    with _openai(slo_server) as client:
        events = list(
            client.responses.create(
                model=MODEL, input="Hi", max_output_tokens=3, stream=True, extra_body={"ttft_ms": LOOSE_MS}
            )
        )
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.model_extra["slo"]["met"]["ttft"] is True


def test_responses_targets_without_the_slo_policy_are_reported_not_enforced(plain_server, exporter):
    request_id = _request_id()
    replies = []

    def carry() -> None:
        replies.append(_respond(plain_server, request_id, headers={"x-slo-tpot-ms": "500"}, ttft_ms=IMPOSSIBLE_MS))

    # Met or missed is counted; nothing was predicted.
    assert _decisions(plain_server, carry) == {"not_enforced": 1, "ttft_missed": 1, "tpot_met": 1}
    slo = replies[0].usage.model_extra["slo"]
    assert slo["enforced"] is False and "not enforced" in slo["reason"] and slo["tpot_ms"] == 500
    [(name, attributes)] = _slo_events(exporter, request_id)
    assert name == "slo.not_enforced" and attributes == {
        "trioserve.slo.enforced": False,
        "trioserve.slo.decision": "not_enforced",
        "trioserve.slo.mode": "enforced",
        "trioserve.slo.ttft_ms": IMPOSSIBLE_MS,
        "trioserve.slo.tpot_ms": 500.0,
    }
    assert "slo" not in (_respond(plain_server).usage.model_extra or {})


def test_responses_body_passes_the_objectives_to_the_chat_request():
    body = {"input": "Hi", "max_output_tokens": 40, "ttft_ms": 250, "tpot_ms": 20, "slo_allow_shorter": True}
    parsed = ChatCompletionRequest.from_json(ResponsesBody.from_json(body).chat)
    objectives = parsed.request.objectives
    assert (objectives.ttft, objectives.tpot, objectives.allow_shorter) == (0.25, 0.02, True)
    # The max_tokens a TPOT refusal may lower is the one max_output_tokens set.
    assert parsed.request.params.max_tokens == 40


# -- /v1/chat/completions and /v1/completions: the door's events on the span -------


def test_chat_and_completions_spans_mark_the_prediction_and_the_decision(slo_server, exporter):
    admitted_id, refused_id = _request_id(), _request_id()
    with httpx.Client(base_url=slo_server.url, timeout=120) as http:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "ttft_ms": LOOSE_MS, "tpot_ms": LOOSE_MS}
        assert http.post("/v1/chat/completions", json=body, headers={HEADER: admitted_id}).status_code == 200
        plain = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
        headers = {HEADER: refused_id, "x-slo-ttft-ms": str(IMPOSSIBLE_MS)}
        assert http.post("/v1/completions", json=plain, headers=headers).status_code == 429
    [(name, admitted)] = _slo_events(exporter, admitted_id)
    assert name == "slo.admitted" and admitted["trioserve.slo.enforced"] is True
    assert (admitted["trioserve.slo.decision"], admitted["trioserve.slo.mode"]) == ("admitted", "enforced")
    assert admitted["trioserve.slo.predicted_ttft_ms"] > 0 and admitted["trioserve.slo.predicted_tpot_ms"] > 0
    assert "trioserve.slo.max_tokens_lowered_to" not in admitted
    [(name, refusal)] = _slo_events(exporter, refused_id)
    assert name == "slo.refused" and refusal["trioserve.slo.decision"] == "refused_ttft"
    assert refusal["trioserve.slo.objective"] == "ttft_ms" and refusal["trioserve.slo.degraded"] is False
    over = refusal["trioserve.slo.predicted_ms"] - refusal["trioserve.slo.target_ms"]
    assert refusal["trioserve.slo.over_ms"] == pytest.approx(over) and over > 0


# -- /v1/messages, with the anthropic client ---------------------------------------


def _anthropic(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _message(server, request_id: str | None = None, **extra):
    headers = {HEADER: request_id or _request_id(), **extra.pop("headers", {})}
    with _anthropic(server) as client:
        return client.messages.create(model=MODEL, max_tokens=3, messages=CHAT, extra_body=extra, extra_headers=headers)


@pytest.mark.parametrize(("extra", "param"), BAD_TARGETS)
def test_messages_bad_target_is_anthropics_400_naming_its_field(plain_server, extra, param):
    with pytest.raises(anthropic.BadRequestError) as refused:
        _message(plain_server, **extra)
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error" and param in error["message"]


def test_messages_refuses_in_anthropics_shape(slo_server, exporter):
    request_id = _request_id()

    def refuse() -> None:
        with pytest.raises(anthropic.RateLimitError) as ttft:
            _message(slo_server, request_id, ttft_ms=IMPOSSIBLE_MS)
        assert int(ttft.value.response.headers["retry-after"]) >= 1
        assert ttft.value.body["type"] == "error"
        error = ttft.value.body["error"]
        assert error["type"] == "rate_limit_error" and "exceeds ttft_ms 0.001 by" in error["message"]
        with pytest.raises(anthropic.RateLimitError) as tpot:
            _message(slo_server, headers={"x-slo-tpot-ms": str(IMPOSSIBLE_MS)}, slo_allow_shorter=True)
        assert "tpot_ms" in tpot.value.body["error"]["message"]

    assert _decisions(slo_server, refuse) == {"refused_ttft": 1, "refused_tpot": 1}
    [(name, attributes)] = _slo_events(exporter, request_id)
    assert name == "slo.refused" and attributes["trioserve.slo.objective"] == "ttft_ms"


def test_messages_best_effort_is_admitted_and_reported_in_usage(slo_server, exporter):
    request_id = _request_id()
    replies = []

    def admit() -> None:
        replies.append(_message(slo_server, request_id, ttft_ms=IMPOSSIBLE_MS, slo_mode="best_effort"))

    # Both predictions are observed; only the TTFT has a target to count.
    assert _decisions(slo_server, admit) == {"admitted": 1, "ttft_missed": 1, **OBSERVED}
    slo = replies[0].usage.model_extra["slo"]
    assert slo["enforced"] is True and slo["slo_mode"] == "best_effort" and slo["met"] == {"ttft": False}
    [(name, attributes)] = _slo_events(exporter, request_id)
    assert name == "slo.admitted" and attributes["trioserve.slo.predicted_tpot_ms"] > 0
    # Streamed: the final message_delta's usage.
    with _anthropic(slo_server) as client:
        events = list(client.messages.create(model=MODEL, max_tokens=3, messages=CHAT, stream=True, extra_body={"ttft_ms": LOOSE_MS}))
    [delta] = [event for event in events if event.type == "message_delta"]
    assert delta.usage.model_extra["slo"]["met"]["ttft"] is True


def test_messages_targets_without_the_slo_policy_are_reported_not_enforced(plain_server, exporter):
    request_id = _request_id()
    reply = _message(plain_server, request_id, tpot_ms=500)
    slo = reply.usage.model_extra["slo"]
    assert slo["enforced"] is False and "not enforced" in slo["reason"] and slo["tpot_ms"] == 500
    assert [name for name, _ in _slo_events(exporter, request_id)] == ["slo.not_enforced"]
    assert "slo" not in (_message(plain_server).usage.model_extra or {})


def test_messages_body_passes_the_objectives_to_the_chat_request():
    body = {"max_tokens": 40, "messages": CHAT, "tpot_ms": 20, "slo_mode": "best_effort", "slo_allow_shorter": True}
    objectives = ChatCompletionRequest.from_json(MessagesBody.from_json(body).chat).request.objectives
    assert (objectives.tpot, objectives.best_effort, objectives.allow_shorter) == (0.02, True, True)


def test_a_refusal_while_degraded_is_each_apis_unavailable():
    refused = SloRefused(objective="tpot_ms", predicted=0.3, target=0.1, retry_after=2.0, degraded=True)
    error = from_exception(refused)
    assert (error.status, error.code, error.headers["Retry-After"]) == (503, "slo_unattainable", "2")
    assert error_json(error.status, error.message, error.param)["error"]["type"] == "overloaded_error"


# -- gRPC's Generate, over a real channel --------------------------------------------


def _generate(server, metadata=(), **fields) -> list[pb.GenerateResponse]:
    params = pb.SamplingParameters(max_tokens=3, ignore_eos=True)
    with grpc.insecure_channel(f"127.0.0.1:{app_grpc(server.app).port}") as channel:
        request = pb.GenerateRequest(model=MODEL, text="Hi", params=params, **fields)
        return list(pb_grpc.GenerationStub(channel).Generate(request, metadata=metadata, timeout=120))


@pytest.mark.parametrize(
    ("fields", "metadata", "param"),
    [
        ({"ttft_ms": -5}, (), "ttft_ms"),
        ({"tpot_ms": 86_400_001}, (), "tpot_ms"),
        ({"slo_mode": 7}, (), "slo_mode"),  # no such SloMode
        ({}, (("x-slo-ttft-ms", "soon"),), "x-slo-ttft-ms"),
    ],
)
def test_grpc_bad_target_is_invalid_argument_naming_its_field(plain_server, fields, metadata, param):
    with pytest.raises(grpc.RpcError) as refused:
        _generate(plain_server, metadata, **fields)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(refused.value.trailing_metadata())["trioserve-param"] == param


def test_grpc_refuses_with_resource_exhausted_and_the_details(slo_server):
    def refuse() -> None:
        with pytest.raises(grpc.RpcError) as ttft:
            _generate(slo_server, ttft_ms=IMPOSSIBLE_MS)
        assert ttft.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "exceeds ttft_ms 0.001 by" in ttft.value.details()
        trailing = dict(ttft.value.trailing_metadata())
        assert (trailing["trioserve-code"], trailing["trioserve-param"]) == ("slo_unattainable", "ttft_ms")
        assert (trailing["trioserve-slo-objective"], trailing["trioserve-slo-target-ms"]) == ("ttft_ms", "0.001")
        assert float(trailing["trioserve-slo-over-ms"]) > 0 and int(trailing["retry-after"]) >= 1
        # The call's metadata states a target as the HTTP headers do.
        with pytest.raises(grpc.RpcError) as tpot:
            _generate(slo_server, [("x-slo-tpot-ms", str(IMPOSSIBLE_MS))], slo_allow_shorter=True)
        assert dict(tpot.value.trailing_metadata())["trioserve-slo-objective"] == "tpot_ms"

    assert _decisions(slo_server, refuse) == {"refused_ttft": 1, "refused_tpot": 1}


def test_grpc_best_effort_is_admitted_and_reported_in_usage(slo_server):
    responses: list[pb.GenerateResponse] = []

    def admit() -> None:
        mode = pb.SLO_MODE_BEST_EFFORT
        responses.extend(_generate(slo_server, ttft_ms=IMPOSSIBLE_MS, tpot_ms=LOOSE_MS, slo_mode=mode, priority=2))

    assert _decisions(slo_server, admit, priority=2) == {"admitted": 1, "ttft_missed": 1, "tpot_met": 1, **OBSERVED}
    slo = responses[-1].usage.slo
    assert slo.enforced and slo.slo_mode == pb.SLO_MODE_BEST_EFFORT
    assert slo.HasField("ttft_ms") and slo.tpot_ms == LOOSE_MS  # usage.slo's ms, to 0.1
    assert slo.predicted_ttft_ms > 0 and slo.measured_ttft_ms > 0 and slo.measured_tpot_ms > 0
    assert (slo.ttft_met, slo.tpot_met) == (False, True) and not slo.HasField("max_tokens_lowered_to")


def test_grpc_targets_without_the_slo_policy_are_reported_not_enforced(plain_server):
    last = _generate(plain_server, [("x-slo-ttft-ms", "250")])[-1]
    assert last.usage.HasField("slo") and not last.usage.slo.enforced
    assert last.usage.slo.ttft_ms == 250 and "not enforced" in last.usage.slo.reason
    assert not _generate(plain_server)[-1].usage.HasField("slo")


def test_a_grpc_refusal_while_degraded_is_unavailable():
    refused = SloRefused(objective="ttft_ms", predicted=2.5, target=0.5, retry_after=2.0, degraded=True)
    assert rpc_messages.status_of(from_exception(refused)) == grpc.StatusCode.UNAVAILABLE
    assert dict(rpc_messages.refusal_metadata(refused)) == {
        "trioserve-slo-objective": "ttft_ms",
        "trioserve-slo-predicted-ms": "2500.0",
        "trioserve-slo-target-ms": "500",
        "trioserve-slo-over-ms": "2000.0",
    }


def test_a_shortened_admission_is_counted_and_reported_as_on_every_surface():
    # Which max_tokens fits a TPOT target depends on the live load: the
    # decision is made here, and what each surface reports of it checked.
    objectives = LatencyObjectives(ttft=0.5, tpot=0.01, allow_shorter=True)
    report = SloReport(objectives, enforced=True, decision=SloDecision(SloPrediction(ttft=0.2, tpot=0.05), max_tokens=20))
    registry = CollectorRegistry()
    SloMetrics(registry).track("r1", MODEL, 0, report)
    labels = {"model_name": MODEL, "priority": "0", "decision": "shortened"}
    assert registry.get_sample_value("trioserve:slo_requests_total", labels) == 1
    usage = report.usage(None, 0)
    assert usage["max_tokens_lowered_to"] == 20 and "slo_allow_shorter" in usage["reason"]
    assert rpc_messages.slo_report(usage).max_tokens_lowered_to == 20


# -- what each surface names: the field a shortened answer lowered, the objective a 503 refused --


@contextlib.contextmanager
def _steps_of(server, seconds: float):
    """The server's latency model fitted to steps of ``seconds`` whatever
    they compute (so its predictions are known: a TTFT and a TPOT of about
    that), for the body of the ``with``; then its own fit back. It learns
    from the steps it sees: the value yielded fits it again."""
    engine = server.host.models[MODEL].engine
    [model] = server.run_sync(engine.latency_models)
    own = server.run_sync(model.to_profile)
    law = LatencyModel(forgetting=1.0)
    for prefill, decodes in [(1, 0), (8, 1), (32, 2), (64, 0), (2, 3), (16, 1), (48, 4), (4, 2), (100, 0), (0, 6)] * 10:
        law.observe(StepShape(prefill, prefill * prefill, decodes, 40 * decodes), seconds)

    def fit() -> None:
        server.run_sync(model.adopt, law)

    try:
        yield fit
    finally:
        server.run_sync(model.adopt, LatencyModel.from_profile(own))


# A TTFT target of 1.5 s at 50 ms a step: an answer of about 29 tokens fits a
# TPOT target no step can meet; asked for 40, a shorter one is given.
SHORTER = {"ttft_ms": 1500, "tpot_ms": IMPOSSIBLE_MS, "slo_allow_shorter": True}


def test_a_shortened_answer_names_the_field_each_surface_caps_its_output_with(slo_server):
    with _steps_of(slo_server, 0.05) as fit:
        fit()
        with _openai(slo_server) as client:
            response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=40, extra_body=SHORTER)
        fit()
        chat = httpx.post(
            f"{slo_server.url}/v1/chat/completions",
            json={"model": MODEL, "messages": CHAT, "max_completion_tokens": 40, **SHORTER},
            timeout=120,
        ).json()
        fit()
        with _anthropic(slo_server) as client:
            message = client.messages.create(model=MODEL, max_tokens=40, messages=CHAT, extra_body=SHORTER)
        fit()
        params = pb.SamplingParameters(max_tokens=40)
        with grpc.insecure_channel(f"127.0.0.1:{app_grpc(slo_server.app).port}") as channel:
            request = pb.GenerateRequest(model=MODEL, text="Hi", params=params, ttft_ms=1500, tpot_ms=IMPOSSIBLE_MS, slo_allow_shorter=True)
            grpc_slo = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=120))[-1].usage.slo
    reasons = {
        "max_output_tokens": response.usage.model_extra["slo"],
        "max_completion_tokens": chat["usage"]["slo"],
        "max_tokens": message.usage.model_extra["slo"],
    }
    for field, slo in reasons.items():
        assert 16 <= slo["max_tokens_lowered_to"] < 40, slo
        assert slo["reason"] == f"predicted to miss tpot_ms at the {field} asked; slo_allow_shorter lowered it"
    assert 16 <= grpc_slo.max_tokens_lowered_to < 40
    assert grpc_slo.reason == "predicted to miss tpot_ms at the params.max_tokens asked; slo_allow_shorter lowered it"


@pytest.fixture
def degraded(slo_server, monkeypatch):
    """The slo server's engine reporting itself degraded (a hung step or a
    worker down, as /health says) while the test runs."""
    monkeypatch.setattr(slo_server.host.models[MODEL].engine, "_degraded", lambda: True)
    return slo_server


def test_a_refusal_while_degraded_names_its_objective_in_each_apis_shape(degraded):
    with pytest.raises(openai.InternalServerError) as responses:
        _respond(degraded, ttft_ms=IMPOSSIBLE_MS)
    assert responses.value.status_code == 503 and int(responses.value.response.headers["retry-after"]) >= 1
    body = responses.value.body
    assert (body["code"], body["param"], body["type"]) == ("slo_unattainable", "ttft_ms", "service_unavailable_error")
    completion = httpx.post(
        f"{degraded.url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "tpot_ms": IMPOSSIBLE_MS},
        timeout=120,
    )
    assert completion.status_code == 503 and completion.json()["error"]["param"] == "tpot_ms"
    # Anthropic's error object has a type and a message only (the client
    # parses it as its OverloadedErrorObject): the message names the field.
    with pytest.raises(anthropic.ServiceUnavailableError) as messages:
        _message(degraded, ttft_ms=IMPOSSIBLE_MS)
    assert int(messages.value.response.headers["retry-after"]) >= 1
    error = messages.value.body["error"]
    assert set(error) == {"type", "message"} and error["type"] == "overloaded_error"
    assert "exceeds ttft_ms 0.001 by" in error["message"]
    with pytest.raises(grpc.RpcError) as generate:
        _generate(degraded, ttft_ms=IMPOSSIBLE_MS)
    assert generate.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(generate.value.trailing_metadata())["trioserve-param"] == "ttft_ms"
