"""The gRPC API (rpc/) through grpcio's own client against a real server.

The server runs in a thread with its own trio loop (``server_in_thread``):
grpcio's client blocks, so it cannot share the test's loop. The quick tests
serve the tiny random model; cancelling and deadlines use the default model,
whose generations are long enough that a cancel surely lands mid-stream.
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_fixtures import MODEL, server_config, server_in_thread

from trioserve.bench.scrape import wait_idle_sync
from trioserve.rpc import codegen
from trioserve.rpc import trioserve_pb2 as pb
from trioserve.rpc import trioserve_pb2_grpc as pb_grpc
from trioserve.web.app import app_grpc, create_app
from trioserve.web.settings import ModelSpec

TINY = "tiny"
PROMPT = "The capital of France is"


# The stamps of the grpcio-tools and protobuf that generated the code: a
# fresh install takes the newest patch release, which moves them and
# nothing else (the committed code keeps the oldest it needs at run time).
_STAMPS = re.compile(r"^(GRPC_GENERATED_VERSION = |# Protobuf Python Version: |\s*\d+,\s*$).*$", re.MULTILINE)


def test_committed_code_matches_the_proto(tmp_path: Path) -> None:
    generated = codegen.generate(tmp_path)
    for name, text in generated.items():
        committed = (codegen.PACKAGE_DIR / name).read_text()
        assert _STAMPS.sub("", committed) == _STAMPS.sub("", text), f"rpc/{name} is stale: run `make proto`"


@pytest.fixture(scope="module")
def tiny_server():
    from actor_fixtures import tiny_loaded

    config = server_config(
        engine=dict(max_model_len=256, max_num_batched_tokens=256, warm_up=False),
        models=(ModelSpec(TINY, None),),
        grpc_port=0,
    )
    with server_in_thread(create_app(config, loaded={TINY: tiny_loaded()})) as server:
        yield server


def channel_to(server) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{app_grpc(server.app).port}")


@pytest.fixture
def tiny(tiny_server):
    with channel_to(tiny_server) as channel:
        yield pb_grpc.GenerationStub(channel), channel


def test_health_is_serving(tiny):
    _, channel = tiny
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "trioserve.v1.Generation"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_turns_not_serving_when_the_drain_begins():
    from actor_fixtures import tiny_loaded

    config = server_config(engine=dict(max_model_len=256, warm_up=False), models=(ModelSpec(TINY, None),), grpc_port=0)
    with server_in_thread(create_app(config, loaded={TINY: tiny_loaded()})) as server, channel_to(server) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        server.run_sync(server.host.begin_drain)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()


def test_list_models_and_tokenize(tiny, tiny_server):
    stub, _ = tiny
    (model,) = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
    assert (model.name, model.max_model_len, model.vocab_size) == (TINY, 256, 49152)
    tokens = stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=10)
    tokenizer = tiny_server.host.models[TINY].engine.tokenizer
    assert list(tokens.token_ids) == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert tokens.max_model_len == 256


def test_generate_streams_the_same_completion_as_http(tiny, tiny_server):
    stub, _ = tiny
    params = pb.SamplingParameters(temperature=0.0, max_tokens=12, ignore_eos=True)
    responses = list(stub.Generate(pb.GenerateRequest(text=PROMPT, params=params, request_id="grpc-1"), timeout=60))
    assert len(responses) >= 2, "the deltas are streamed, not gathered"
    assert {r.request_id for r in responses} == {"grpc-1"}
    assert all(not r.finish_reason for r in responses[:-1])
    last = responses[-1]
    assert last.finish_reason == "length"
    prompt_ids = stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=10).token_ids
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt_ids), 12)
    token_ids = [t for r in responses for t in r.token_ids]
    assert len(token_ids) == 12
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    http = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=60).json()
    assert "".join(r.text for r in responses) == http["choices"][0]["text"]


def test_generate_from_token_ids_with_n(tiny):
    stub, _ = tiny
    params = pb.SamplingParameters(n=2, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), params=params)
    responses = list(stub.Generate(request, timeout=60))
    finals = {r.index: r for r in responses if r.finish_reason}
    assert sorted(finals) == [0, 1]
    assert all(f.usage.completion_tokens == 4 and f.usage.prompt_tokens == 3 for f in finals.values())


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        (dict(text=PROMPT, params=pb.SamplingParameters(max_tokens=0)), "max_tokens"),
        (dict(text=PROMPT, params=pb.SamplingParameters(temperature=-1.0)), "temperature"),
        (dict(text=PROMPT, params=pb.SamplingParameters(top_p=1.5)), "top_p"),
        (dict(text=PROMPT, params=pb.SamplingParameters(logit_bias={10**6: 1.0})), "logit_bias"),
        (dict(params=pb.SamplingParameters(max_tokens=4)), "prompt"),
        (dict(token_ids=pb.TokenIds(ids=[5, 10**6])), "prompt"),
        (dict(text="word " * 400), "prompt"),
    ],
)
def test_invalid_parameters_are_invalid_argument_naming_the_field(tiny, request_fields, field):
    stub, _ = tiny
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(**request_fields), timeout=30))
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.details()
    assert ("trioserve-param", field) in tuple(error.trailing_metadata())


def test_unknown_model_is_not_found(tiny):
    stub, _ = tiny
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(model="nope", text=PROMPT), timeout=30))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in info.value.details()


def test_the_engine_serves_on_after_bad_requests(tiny, tiny_server):
    stub, _ = tiny
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(pb.GenerateRequest(text=PROMPT, params=pb.SamplingParameters(n=0)), timeout=30))
    responses = list(stub.Generate(pb.GenerateRequest(text=PROMPT, params=pb.SamplingParameters(max_tokens=2)), timeout=60))
    assert responses[-1].finish_reason in ("stop", "length")
    assert tiny_server.run_sync(tiny_server.host.models[TINY].engine.statistics).num_running == 0


# -- cancelling and deadlines: the default model ----------------------------------

LONG = pb.SamplingParameters(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def server(default_loaded):
    with server_in_thread(create_app(server_config(grpc_port=0), loaded=default_loaded)) as running:
        yield running


@pytest.fixture
def stub(server):
    with channel_to(server) as channel:
        yield pb_grpc.GenerationStub(channel)


def wait_idle(server) -> dict[str, float]:
    """``trioserve.bench.scrape.wait_idle`` on the server's model: nothing
    runs or waits (an abort applies at the next step boundary)."""
    return wait_idle_sync(server.url, MODEL, timeout=20)


@pytest.mark.slow
def test_cancelling_the_call_aborts_the_request_and_frees_its_blocks(server, stub):
    engine = server.host.models[MODEL].engine
    before = server.run_sync(engine.statistics)
    call = stub.Generate(pb.GenerateRequest(text=PROMPT, params=LONG), timeout=120)
    first = next(call)
    assert first.token_ids and not first.finish_reason
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    values = wait_idle(server)
    after = server.run_sync(engine.statistics)
    assert after.scheduler.num_aborted == before.scheduler.num_aborted + 1
    assert after.scheduler.num_finished == before.scheduler.num_finished
    assert values["trioserve:kv_cache_usage_perc"] == 0.0


@pytest.mark.slow
def test_the_calls_deadline_is_the_requests(server, stub):
    engine = server.host.models[MODEL].engine
    before = server.run_sync(engine.statistics).num_deadline_exceeded
    responses = []
    try:
        for response in stub.Generate(pb.GenerateRequest(text=PROMPT, params=LONG), timeout=1.0):
            responses.append(response)
    except grpc.RpcError as exc:
        # The final delta may lose the race with the client's own deadline.
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        assert responses[-1].finish_reason == "deadline"
        assert responses[-1].usage.completion_tokens < 400
    wait_idle(server)
    assert server.run_sync(engine.statistics).num_deadline_exceeded == before + 1


@pytest.mark.slow
def test_abort_by_request_id(server, stub):
    call = stub.Generate(pb.GenerateRequest(text=PROMPT, params=LONG, request_id="to-abort"), timeout=120)
    next(call)
    assert stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=10).aborted
    rest = list(call)
    assert rest[-1].finish_reason == "abort"
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=10).aborted
    wait_idle(server)
