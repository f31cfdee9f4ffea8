"""Plugins (engine/plugins.py, web/plugins.py) end to end.

The example package (examples/plugin_example) is really installed, with
pip, into a folder put on ``sys.path``: its entry points are found through
``importlib.metadata`` like any installed package's. Each hook is checked
through a real server on the tiny model (the policy through a real engine
core), including that a plugin which raises fails only its own request.
"""

from __future__ import annotations

import collections
import importlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import trio
from server_fixtures import metric_values, parse_sse, server_config, server_in_thread

from trioserve.engine.plugins import GROUPS, PluginError, Plugins, PriorityPolicy, UnknownPluginError
from trioserve.engine.core.scheduler import Scheduler
from trioserve.engine.core.scheduling_policy import GuardedPolicy
from trioserve.rpc import trioserve_pb2 as pb
from trioserve.rpc import trioserve_pb2_grpc as pb_grpc
from trioserve.web.app import app_grpc, create_app
from trioserve.web.cli import main
from trioserve.web.settings import ModelSpec

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "plugin_example"
TINY = "tiny"
PLUGINS = ("example", "ban_tokens", "fail_after", "faulty_metrics")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def example_installed(tmp_path_factory):
    """pip-install the example package into a folder on ``sys.path``."""
    root = tmp_path_factory.mktemp("plugin_example")
    source, target = root / "src", root / "site"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(source)],
        check=True,
    )  # fmt: skip
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))
    importlib.invalidate_caches()


@pytest.fixture(scope="module")
def server(example_installed):
    from actor_fixtures import tiny_loaded

    config = server_config(
        engine=dict(max_model_len=256, max_num_batched_tokens=256, warm_up=False, plugins=PLUGINS),
        models=(ModelSpec(TINY, None),),
        grpc_port=0,
    )
    with server_in_thread(create_app(config, loaded={TINY: tiny_loaded()})) as running:
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


def complete(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/completions", json={"model": TINY, "prompt": PROMPT, **body})


def greedy(client: httpx.Client, max_tokens: int = 12, **body) -> str:
    response = complete(client, max_tokens=max_tokens, temperature=0, ignore_eos=True, **body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def wait_idle(server, timeout: float = 10.0) -> None:
    """Poll the engine's statistics until nothing is queued, waits or runs
    (an abort applies at the next step boundary)."""
    engine = server.host.models[TINY].engine
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        stats = server.run_sync(engine.statistics)
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_queued == 0:
            return
        time.sleep(0.02)
    raise AssertionError("the engine did not become idle")


# -- loading -----------------------------------------------------------------------


def test_plugins_are_found_through_entry_points(example_installed):
    plugins = Plugins.load(["example", "ban_tokens", "shortest_prompt_first"])
    assert [name for name, _ in plugins.request_preprocessors] == ["example"]
    assert [name for name, _ in plugins.output_postprocessors] == ["example"]
    assert sorted(plugins.logits_processors) == ["ban_tokens"]
    assert plugins.scheduling_policy[0] == "shortest_prompt_first"
    assert [name for name, _ in plugins.metrics] == ["example"]
    assert set(GROUPS.values()) == {
        "trioserve.request_preprocessors",
        "trioserve.output_postprocessors",
        "trioserve.logits_processors",
        "trioserve.scheduling_policies",
        "trioserve.metrics",
    }


def test_an_unknown_plugin_stops_startup_naming_it(example_installed, capsys):
    with pytest.raises(UnknownPluginError) as info:
        Plugins.load(["example", "nope"])
    assert "'nope'" in str(info.value) and "ban_tokens" in str(info.value) and "fail_after" in str(info.value)
    assert main(["serve", "--port", "0", "--plugins", "example,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown plugin 'nope'" in err and "shortest_prompt_first" in err


# -- request pre-processors ------------------------------------------------------


def test_a_preprocessor_rejects_with_an_api_error(client):
    response = complete(client, user="blocked", max_tokens=2)
    assert response.status_code == 403
    assert response.json()["error"] == {
        "message": "user 'blocked' may not use this server",
        "type": "invalid_request_error",
        "param": "user",
        "code": "user_blocked",
    }


def test_a_preprocessor_rewrites_the_request(client):
    response = complete(client, max_tokens=40, ignore_eos=True, example_max_tokens=3)
    assert response.status_code == 200
    body = response.json()
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_preprocessor_that_raises_fails_only_its_request(client):
    response = complete(client, example="crash-preprocessor", max_tokens=2)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "plugin_error" and "'example'" in error["message"] and "RuntimeError" in error["message"]
    assert "crashed" not in error["message"]  # the plugin's own text stays in the log
    assert greedy(client, max_tokens=2)


# -- output post-processors ------------------------------------------------------


def test_a_postprocessor_redacts_each_delta(client):
    plain = greedy(client)
    letter = collections.Counter(c for c in plain if c.isalnum()).most_common(1)[0][0]
    redacted = greedy(client, example_redact=letter)
    assert redacted == plain.replace(letter, "***")


def test_a_postprocessor_stops_the_completion_and_the_request_ends(client, server):
    with client.stream(
        "POST",
        "/v1/completions",
        json={"model": TINY, "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True, "example_stop_after": 3},
    ) as response:
        events = parse_sse(response.read())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert len([c for c in chunks if c["choices"][0]["text"]]) <= 3
    wait_idle(server)


def test_a_postprocessor_that_raises_fails_only_its_stream(client):
    with client.stream(
        "POST",
        "/v1/completions",
        json={"model": TINY, "prompt": PROMPT, "max_tokens": 20, "ignore_eos": True, "stream": True, "example": "crash-postprocessor"},
    ) as response:
        assert response.status_code == 200
        events = parse_sse(response.read())
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "plugin_error"
    assert "'example'" in errors[0]["error"]["message"]
    response = complete(client, max_tokens=20, example="crash-postprocessor")
    assert response.status_code == 500 and response.json()["error"]["code"] == "plugin_error"
    assert greedy(client, max_tokens=2)


# -- logits processors -----------------------------------------------------------


def generate_ids(server, **params) -> list[int]:
    with grpc.insecure_channel(f"127.0.0.1:{app_grpc(server.app).port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text=PROMPT, params=pb.SamplingParameters(temperature=0.0, ignore_eos=True, **params))
        return [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]


def test_a_logits_processor_runs_in_the_sampler(server):
    plain = generate_ids(server, max_tokens=8)
    banned = sorted(set(plain[:3]))
    processor = pb.LogitsProcessor(name="ban_tokens", args_json=json.dumps({"token_ids": banned}))
    constrained = generate_ids(server, max_tokens=8, logits_processors=[processor])
    assert len(constrained) == 8
    assert not set(constrained) & set(banned)


def test_logits_processors_are_checked_at_the_edge(client):
    response = complete(client, max_tokens=2, logits_processors=["nope"])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "logits_processors" and "'nope'" in error["message"] and "ban_tokens" in error["message"]
    response = complete(client, max_tokens=2, logits_processors=[{"name": "ban_tokens", "args": {"token_ids": "x"}}])
    assert response.status_code == 400 and "token_ids" in response.json()["error"]["message"]
    response = complete(client, max_tokens=2, logits_processors="ban_tokens")
    assert response.status_code == 400 and response.json()["error"]["param"] == "logits_processors"


async def test_a_logits_processor_that_raises_fails_only_its_request(server):
    """Two requests sent together run in the same steps; the one whose
    processor raises fails with plugin_error, the other completes."""
    results = {}

    async def send(name, extra):
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            body = {"model": TINY, "prompt": PROMPT, "max_tokens": 30, "ignore_eos": True, "temperature": 0, **extra}
            results[name] = await http.post("/v1/completions", json=body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, "faulty", {"logits_processors": [{"name": "fail_after", "args": {"tokens": 2}}]})
        nursery.start_soon(send, "healthy", {})
    faulty, healthy = results["faulty"], results["healthy"]
    assert faulty.status_code == 500, faulty.text
    error = faulty.json()["error"]
    assert error["code"] == "plugin_error" and "'fail_after'" in error["message"]
    assert healthy.status_code == 200 and healthy.json()["usage"]["completion_tokens"] == 30
    await trio.to_thread.run_sync(wait_idle, server)


# -- metrics -----------------------------------------------------------------------


def test_metrics_plugins_register_collectors_and_a_failing_one_is_left_out(client):
    response = client.get("/metrics")
    assert response.status_code == 200
    assert "example_plugin_loaded_timestamp_seconds " in response.text
    assert metric_values(response.text, TINY)["trioserve:num_requests_running"] == 0


# -- scheduling policy -------------------------------------------------------------


def test_a_scheduling_policy_plugin_orders_the_waiting_requests(example_installed):
    from actor_fixtures import tiny_loaded

    from trioserve.engine.core.engine_core import EngineCore
    from trioserve.testing.tiny_model import engine_config

    prompts = {"long": "word " * 60, "longer": "word " * 90, "short": "word", "medium": "word " * 20}
    first_steps = {}
    for plugins in ((), ("shortest_prompt_first",)):
        core = EngineCore(tiny_loaded(), engine_config(max_num_seqs=2, plugins=plugins))
        for request_id, prompt in prompts.items():
            core.add_request(request_id, prompt)
        first_steps[plugins] = {chunk.request_id for chunk in core.schedule().plan.chunks}
    assert first_steps[()] == {"long", "longer"}  # the built-in policy: arrival order
    assert first_steps[("shortest_prompt_first",)] == {"short", "medium"}


class _Failing:
    def key(self, request, age):
        raise RuntimeError("broken policy")

    def outranks(self, key_a, key_b):
        return False


def test_a_failing_policy_falls_back_to_the_builtin_one(caplog):
    from factories import make_request

    builtin = PriorityPolicy(None)
    policy = GuardedPolicy("broken", _Failing(), builtin)
    scheduler = Scheduler(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=16, block_size=4, policy=policy
    )
    for i, priority in enumerate((2, 0, 1)):
        scheduler.add_request(make_request(f"r{i}", prompt_len=4, priority=priority))
    assert policy.failed and "'broken' failed" in caplog.text
    scheduler.check_invariants()
    assert [r.request_id for r in scheduler._queues.waiting] == ["r1", "r2", "r0"]


def test_plugin_errors_pickle_with_their_message():
    import pickle

    error = PluginError.from_exception("x", "logits processor", ValueError("secret"))
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.plugin, copy.detail) == (str(error), "x", "ValueError: secret")
