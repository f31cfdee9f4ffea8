"""Faults injected into the model step (an exception, a hang past the
watchdog, a step thread that dies or is closed) and into the tokenizer and
detokenizer: the affected requests end with a clear error, the others are
served, the engine keeps serving and says what happened.

The hang tests on the fake executor run on the autojump clock; the ones on
the real executor (tiny model, a step thread) use a short wall-clock
watchdog. The HTTP tests serve the default model.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

from actor_fixtures import assert_clean, tiny_loaded
from trioserve.testing import engine_config
from fault_fixtures import (
    STEP,
    FaultyRunner,
    HangOnce,
    FaultyTokenizer,
    fake_engine,
    greedy,
    prompt_has,
    tokens,
    wait_until,
)
from server_fixtures import read_sse_lines, server_config, serving, wait_idle
from trioserve.actors import ModelExecutor, RequestFailed, open_engine
from trioserve.actors.executor import fake_token
from trioserve.engine.errors import InvalidRequestError, TokenizerError
from trioserve.engine.runtime.model_runner import ModelRunner
from trioserve.engine.core.sequence import FinishReason
from trioserve.engine.runtime.step_thread import StepThread
from trioserve.web.app import create_app
from trioserve.web.health import model_health

WATCHDOG = 2.0  # wall seconds, for the real executor: far above a tiny model's step


async def collect(engine, prompt: Any, p=None, **kw: Any):
    return [out async for out in engine.generate(prompt, p or greedy(), **kw)]


async def expect_failure(engine, prompt: Any, p=None, **kw: Any) -> tuple[list, BaseException]:
    """Read a request to its error; return what it streamed and the error."""
    got = []
    with pytest.raises((RequestFailed, InvalidRequestError)) as raised:
        async for out in engine.generate(prompt, p or greedy(), **kw):
            got.append(out)
    return got, raised.value


# -- a hung step, on the fake executor and the autojump clock --------------------


async def test_a_hung_step_fails_its_requests_quarantines_their_blocks_and_the_engine_serves_on(autojump_clock):
    hang = HangOnce("hung", 1000.0)
    async with fake_engine(watchdog_timeout=1.0, delay=hang) as engine:
        failures: dict[str, BaseException] = {}
        streamed: dict[str, list] = {}

        async def doomed(name: str) -> None:
            streamed[name], failures[name] = await expect_failure(engine, f"{name} prompt", greedy(50), request_id=name)

        # The engine's loops wait for work: both requests are then taken
        # from the queue together (not one before the admission loop's first
        # receive and one after), so they run in the same steps.
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(doomed, "hung")
            nursery.start_soon(doomed, "same-step")  # batched with it: the step's requests all fail
        # Caught by the watchdog, not waited on for 1000 s.
        assert trio.current_time() - start == pytest.approx(2 * STEP + 1.0, abs=2 * STEP)
        for name in ("hung", "same-step"):
            assert isinstance(failures[name], RequestFailed) and failures[name].code == "step_hung"
            assert "watchdog" in failures[name].public_message
            assert len(tokens(streamed[name])) == 2
        quarantined = {b for c in hang.plan.chunks for b in c.block_ids}

        await trio.testing.wait_all_tasks_blocked()
        stats = engine.statistics()
        assert stats.executor.num_hung_steps == 1 and stats.executor.num_hung_steps_running == 1
        assert stats.scheduler.num_quarantined_blocks == len(quarantined) > 0
        assert stats.allocator.kv.num_free_blocks == stats.allocator.kv.num_blocks - len(quarantined)
        assert model_health(stats)["degraded"] and model_health(stats)["last_error"]["kind"] == "step_hung"
        # The ids stay taken until the step returns: the pool knows them.
        _, refused = await expect_failure(engine, "again", request_id="hung")
        assert isinstance(refused, InvalidRequestError) and refused.field == "request_id"

        # Meanwhile others are served, and never get a quarantined block.
        before = len(engine.fake.plans)
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(functools.partial(collect, engine, f"other {i} " * (i + 1), greedy(20)))
        assert engine.statistics().scheduler.num_finished == 6
        assert not quarantined & {b for p in engine.fake.plans[before:] for c in p.chunks for b in c.block_ids}

        # The hung step returns at last: its blocks go back, the id is free.
        await trio.sleep(1000.0)
        await trio.testing.wait_all_tasks_blocked()
        stats = engine.statistics()
        assert stats.executor.num_hung_steps_running == 0 and stats.scheduler.num_quarantined_blocks == 0
        assert stats.allocator.kv.num_free_blocks == stats.allocator.kv.num_blocks
        assert not model_health(stats)["degraded"]
        assert (await collect(engine, "again", request_id="hung"))[-1].finish_reason is FinishReason.LENGTH


async def test_without_a_watchdog_a_slow_step_is_waited_for(autojump_clock):
    async with fake_engine(watchdog_timeout=None, delay=HangOnce("slow", 1000.0)) as engine:
        start = trio.current_time()
        outputs = await collect(engine, "slow prompt", greedy(5), request_id="slow")
        assert tokens(outputs) and outputs[-1].finish_reason is FinishReason.LENGTH
        assert trio.current_time() - start >= 1000.0
        assert engine.statistics().executor.num_hung_steps == 0


# -- the real executor: a hung step and a dying thread ---------------------------

MARK = [4001, 4002, 4003, 4004]  # token ids that mark the request to misbehave


def faulty_executor(runners: list[FaultyRunner], fault, *, step_thread: StepThread | None = None, **kw: Any):
    def make(core) -> ModelExecutor:
        runners.append(FaultyRunner(core.runner, fault))
        return ModelExecutor(runners[-1], step_thread, **kw)

    return make


async def test_a_hung_real_step_is_abandoned_and_its_late_writes_corrupt_no_one():
    runners: list[FaultyRunner] = []

    def fault(plan):
        return "hang" if prompt_has(plan, MARK) and not runners[0].hung.is_set() else None

    config = engine_config()
    peer_prompt = list(range(300, 340))
    async with open_engine(config, loaded=tiny_loaded(), executor=faulty_executor(runners, fault, watchdog_timeout=WATCHDOG)) as engine:
        runner = runners[0]
        reference = tokens(await collect(engine, peer_prompt, greedy(60)))

        with trio.fail_after(60):
            _, failure = await expect_failure(engine, [7, 8, *MARK, 9] * 6, greedy(10), request_id="hung")
        assert isinstance(failure, RequestFailed) and failure.code == "step_hung"
        assert engine.statistics().scheduler.num_quarantined_blocks > 0

        # A request now runs on a fresh thread while the hung one still
        # holds its own. Its blocks came fresh from the pool; were they the
        # hung request's, the late step below would overwrite its KV.
        got = []
        async for out in engine.generate(peer_prompt, greedy(60)):
            got.append(out)
            if len(got) == 1:
                runner.release.set()  # the hung step wakes and writes its blocks
                with trio.fail_after(60):
                    await wait_until(lambda: engine.statistics().executor.num_hung_steps_running == 0)
        assert tokens(got) == reference
        assert runner.threads[-1] is not runner.hung_thread
        await trio.to_thread.run_sync(runner.hung_thread.join, 60)  # it ends once its step returned
        assert not runner.hung_thread.is_alive()
        with trio.fail_after(60):
            await wait_until(lambda: engine.statistics().scheduler.num_quarantined_blocks == 0)
        stats = engine.statistics()
        assert stats.executor.num_thread_restarts == 1 and stats.executor.num_hung_steps == 1
        assert stats.allocator.kv.num_free_blocks == stats.allocator.kv.num_blocks
    assert_clean(engine)


async def test_an_engine_with_a_step_hung_for_good_still_shuts_down():
    runners: list[FaultyRunner] = []
    make = faulty_executor(runners, lambda plan: "hang" if prompt_has(plan, MARK) else None, watchdog_timeout=WATCHDOG)
    try:
        with trio.fail_after(60):
            async with open_engine(engine_config(), loaded=tiny_loaded(), executor=make) as engine:
                _, failure = await expect_failure(engine, [1, *MARK], greedy(4))
                assert failure.code == "step_hung"
                assert (await collect(engine, [3, 4, 5], greedy(4)))[-1].finish_reason is FinishReason.LENGTH
            # Left without waiting for the hung step (nor its blocks).
        assert runners[0].hung_thread.is_alive() and runners[0].hung_thread.daemon
    finally:
        runners[0].release.set()


async def test_a_step_thread_that_dies_fails_its_step_and_is_replaced():
    runners: list[FaultyRunner] = []
    died = []

    def fault(plan):
        if prompt_has(plan, MARK) and not died:
            died.append(plan)
            return "exit"
        return None

    async with open_engine(engine_config(), loaded=tiny_loaded(), executor=faulty_executor(runners, fault)) as engine:
        _, failure = await expect_failure(engine, [5, *MARK, 6], greedy(8))
        assert isinstance(failure, RequestFailed) and failure.code == "step_thread_died"
        first_thread = runners[0].threads[0]
        await trio.to_thread.run_sync(first_thread.join, 60)  # it ended
        outputs = await collect(engine, [11, 12, 13], greedy(8))
        assert outputs[-1].finish_reason is FinishReason.LENGTH
        assert runners[0].threads[-1] is not first_thread
        stats = engine.statistics()
        assert stats.executor.num_failed_steps == 1 and stats.executor.num_thread_restarts == 1
        assert stats.executor.last_fault.kind == "step_thread_died"
    assert_clean(engine)


async def test_a_step_thread_closed_between_steps_is_replaced_unnoticed():
    runners: list[FaultyRunner] = []
    thread = StepThread()
    try:
        make = faulty_executor(runners, lambda plan: None, step_thread=thread)
        async with open_engine(engine_config(), loaded=tiny_loaded(), executor=make) as engine:
            assert (await collect(engine, [21, 22, 23], greedy(4)))[-1].finish_reason is FinishReason.LENGTH
            thread.close()  # shut down from outside
            assert (await collect(engine, [24, 25, 26], greedy(4)))[-1].finish_reason is FinishReason.LENGTH
            stats = engine.statistics()
            assert stats.executor.num_thread_restarts == 1 and stats.executor.num_failed_steps == 0
        assert_clean(engine)
    finally:
        thread.close()


# -- the tokenizer and the detokenizer -------------------------------------------

POISON = 5000  # never a fake token (those are in [100, 1100))


def poisoned_loaded(**kw: Any):
    return attrs.evolve(tiny_loaded(), tokenizer=FaultyTokenizer(tiny_loaded().tokenizer, **kw))


async def test_a_tokenizer_fault_refuses_only_that_request(autojump_clock):
    loaded = poisoned_loaded(encode_marker="BOOM", poison=POISON)
    async with open_engine(engine_config(), loaded=loaded, executor=lambda core: _fake(core)) as engine:
        async with trio.open_nursery() as nursery:
            results: dict[str, Any] = {}

            async def run(name: str, prompt: Any) -> None:
                try:
                    results[name] = await collect(engine, prompt, greedy(6))
                except TokenizerError as exc:
                    results[name] = exc

            nursery.start_soon(run, "encode", "this BOOM breaks the tokenizer")
            # Admitted, but decoding its prompt's tail for the detokenizer fails.
            nursery.start_soon(run, "decode", [1, 2, POISON, 3])
            for i in range(4):
                nursery.start_soon(run, f"ok{i}", f"an ordinary prompt number {i}")
        assert results["encode"].field == "prompt" and "RuntimeError" in str(results["encode"])
        assert "BOOM" not in str(results["encode"])  # the prompt is not echoed
        assert isinstance(results["decode"], TokenizerError)
        for i in range(4):
            assert results[f"ok{i}"][-1].finish_reason is FinishReason.LENGTH
        stats = engine.statistics()
        assert stats.scheduler.num_tokenizer_errors == 2 and stats.scheduler.last_fault.kind == "tokenizer_failed"
    assert_clean(engine)


def _fake(core, **kw: Any):
    from trioserve.actors import FakeExecutor

    return FakeExecutor.for_core(core, step_time=STEP, **kw)


@pytest.mark.parametrize("n", [1, 3])
async def test_a_detokenizer_fault_mid_stream_fails_only_that_request(autojump_clock, n):
    def token(chunk, context):
        if chunk.request_id.startswith("bad") and chunk.request_id.endswith(("bad", "/1")):
            if chunk.sampling.num_output_tokens == 2:
                return POISON  # its third token cannot be decoded
        return fake_token(context, 49152)

    loaded = poisoned_loaded(poison=POISON)
    async with open_engine(engine_config(), loaded=loaded, executor=lambda core: _fake(core, token=token)) as engine:
        results: dict[str, Any] = {}

        async def run(name: str, p) -> None:
            got = []
            try:
                async for out in engine.generate(f"prompt of {name}", p, request_id=name):
                    got.append(out)
            except RequestFailed as exc:
                results[name] = (got, exc)
            else:
                results[name] = (got, None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "bad", greedy(10, n=n, seed=1))
            for i in range(3):
                nursery.start_soon(run, f"peer{i}", greedy(10))
        got, error = results["bad"]
        assert error is not None and error.code == "detokenizer_failed"
        assert "ValueError" in error.public_message
        assert len(tokens(got, 0 if n == 1 else 1)) == 2  # it streamed until the fault
        for i in range(3):
            got, error = results[f"peer{i}"]
            assert error is None and len(tokens(got)) == 10 and got[-1].finish_reason is FinishReason.LENGTH
        await trio.testing.wait_all_tasks_blocked()
        stats = engine.statistics()
        assert stats.scheduler.num_detokenizer_errors == 1 and stats.scheduler.num_failed == 1
        assert stats.allocator.kv.num_free_blocks == stats.allocator.kv.num_blocks
    assert_clean(engine)


# -- over HTTP, on the default model -----------------------------------------------

RAISE_MARK = [2001, 2002, 2003]
HANG_MARK = [2011, 2012, 2013]


async def stream_completion(http: httpx.AsyncClient, prompt: Any, max_tokens: int) -> list[Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        return [event async for event in read_sse_lines(response)]


def stream_error(events: list[Any]) -> dict[str, Any] | None:
    return next((e["error"] for e in events if isinstance(e, dict) and "error" in e), None)


def stream_finish(events: list[Any]) -> str | None:
    reasons = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", ())]
    return reasons[-1] if reasons else None


@pytest.mark.slow
async def test_step_faults_over_http_are_clear_errors_and_health_reports_them(default_loaded, monkeypatch):
    real_execute = ModelRunner.execute
    release = trio.Event()
    hung = []
    token = trio.lowlevel.current_trio_token()

    def execute(self, plan):
        if prompt_has(plan, RAISE_MARK):
            raise RuntimeError("injected fault; see /secret/path/model.py:12")
        if prompt_has(plan, HANG_MARK) and not hung:
            hung.append(plan)
            trio.from_thread.run(release.wait, trio_token=token)
        return real_execute(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    app = create_app(server_config(engine={"watchdog_timeout": WATCHDOG}), loaded=default_loaded)
    async with serving(app) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        # (a) a step that raises: its request gets the error in its stream.
        events = await stream_completion(http, [*RAISE_MARK, 42], 4)
        error = stream_error(events)
        assert error["code"] == "step_failed" and "RuntimeError" in error["message"]
        assert "/secret" not in error["message"] and events[-1] == "[DONE]"
        body = {"prompt": [*RAISE_MARK, 43], "max_tokens": 4}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 500 and response.json()["error"]["code"] == "step_failed"

        # (b) a step that hangs: caught by the watchdog; the others stream on a new thread.
        results: dict[str, list[Any]] = {}

        async def run(name: str, prompt: Any) -> None:
            results[name] = await stream_completion(http, prompt, 8)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "hung", [*HANG_MARK, 44])
            with trio.fail_after(30):
                while not hung:
                    await trio.sleep(0.01)
            for i in range(4):  # they arrive while it hangs
                nursery.start_soon(run, f"other{i}", f"Count to ten, take {i}:")
        assert stream_error(results["hung"])["code"] == "step_hung"
        for i in range(4):
            assert stream_error(results[f"other{i}"]) is None and stream_finish(results[f"other{i}"]) == "length"
        health = await http.get("/health")
        assert health.status_code == 200  # still serving
        model = health.json()["models"][server.host.default_name]
        assert health.json()["degraded"] and model["hung_steps_running"] == 1 and model["quarantined_kv_blocks"] > 0
        assert model["last_error"]["kind"] == "step_hung"

        release.set()  # the hung step returns; its blocks come back
        with trio.fail_after(30):
            while (await http.get("/health")).json()["degraded"]:
                await trio.sleep(0.05)
        model = (await http.get("/health")).json()["models"][server.host.default_name]
        assert (model["failed_steps"], model["hung_steps"], model["step_thread_restarts"]) == (2, 1, 1)
        assert model["failed_requests"] == 3
        idle = await wait_idle(http)
        assert idle["trioserve:kv_cache_usage_perc"] == 0


@pytest.mark.slow
async def test_tokenizer_and_detokenizer_faults_over_http(default_loaded, monkeypatch):
    faulty = FaultyTokenizer(default_loaded.tokenizer, encode_marker="BOOM")
    monkeypatch.setattr(default_loaded.tokenizer, "encode", faulty.encode)
    monkeypatch.setattr(default_loaded.tokenizer, "decode", faulty.decode)
    app = create_app(server_config(), loaded=default_loaded)
    async with serving(app) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        response = await http.post("/v1/completions", json={"prompt": "a BOOM prompt", "max_tokens": 2})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "prompt" and "BOOM" not in response.text

        # Four streams; once each has begun, the next decode fails: one
        # stream ends with the error, the other three finish.
        started = [trio.Event() for _ in range(4)]
        results: list[list[Any]] = [[] for _ in range(4)]

        async def run(i: int) -> None:
            body = {"prompt": f"Tell a story, number {i}:", "max_tokens": 24, "stream": True, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for event in read_sse_lines(response):
                    results[i].append(event)
                    started[i].set()

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(run, i)
            for event in started:
                await event.wait()
            faulty.arm_decode()
        errors = [stream_error(events) for events in results]
        failed = [e for e in errors if e is not None]
        assert len(failed) == 1 and failed[0]["code"] == "detokenizer_failed"
        assert sum(stream_finish(events) == "length" for events in results) == 3
        model = (await http.get("/health")).json()["models"][server.host.default_name]
        assert (model["tokenizer_errors"], model["detokenizer_errors"]) == (1, 1)
        assert model["last_error"]["kind"] == "detokenizer_failed"
        assert (await wait_idle(http))["trioserve:kv_cache_usage_perc"] == 0


def test_the_watchdog_flag_and_its_environment_variable():
    from trioserve.engine.config import DEFAULT_WATCHDOG_TIMEOUT, EngineConfig
    from trioserve.web.serve_options import build_serve_parser, server_config_from_args, server_config_from_env

    parse = build_serve_parser().parse_args
    assert server_config_from_args(parse([])).engine.watchdog_timeout == DEFAULT_WATCHDOG_TIMEOUT == 300
    assert server_config_from_args(parse(["--watchdog-timeout", "12.5"])).engine.watchdog_timeout == 12.5
    assert server_config_from_args(parse(["--watchdog-timeout", "0"])).engine.watchdog_timeout is None
    assert server_config_from_env({"TRIOSERVE_WATCHDOG_TIMEOUT": "7"}).engine.watchdog_timeout == 7
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            parse(["--watchdog-timeout", bad])
    with pytest.raises(ValueError, match="watchdog_timeout"):
        EngineConfig(watchdog_timeout=float("nan"))
