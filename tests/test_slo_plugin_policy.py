"""A scheduling-policy plugin predicts from the engine's one latency model
(engine/core/scheduling_policy.py): the model SLO admission predicts with,
that the scheduler actor feeds and that ``--slo-profile`` seeds, passed to
a factory that takes a ``latency`` keyword. The plugin is found through a
real entry point (a distribution's metadata on ``sys.path``) and runs in a
real engine's actors, on a fake executor and the autojump clock."""

from __future__ import annotations

import importlib

import pytest

import actor_fixtures
from trioserve.engine.config import EngineConfig
from trioserve.engine.core.latency_model import LatencyModel, StepShape
from trioserve.engine.plugins import Plugins
from trioserve.engine.core.scheduling_policy import scheduling_policy
from trioserve.engine.latency_objectives import LatencyObjectives
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.testing import engine_config
from trioserve.web.slo_profile import profile_identity, save_models, seed_engine

GROUP = "trioserve.scheduling_policies"


class PredictedShortestFirst:
    """Waiting requests run by their prompt's predicted prefill time, the
    least first: a policy whose key is a prediction."""

    def __init__(self, config: EngineConfig, *, latency: LatencyModel | None = None) -> None:
        self.latency = latency
        self.steps_seen = 0

    def key(self, request, age: int) -> tuple[float, ...]:
        assert self.latency is not None, "the factory was not given the engine's latency model"
        return (self.latency.step_seconds(StepShape(request.num_prompt_tokens)), request.arrival_index)

    def outranks(self, key_a: tuple[float, ...], key_b: tuple[float, ...]) -> bool:
        return False

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.steps_seen += 1


class ShortestPromptFirst:
    """A policy of the older form: ``factory(config)`` only."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def key(self, request, age: int) -> tuple[float, ...]:
        return (request.num_prompt_tokens, request.arrival_index)

    def outranks(self, key_a: tuple[float, ...], key_b: tuple[float, ...]) -> bool:
        return False


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """This module's policies as the entry points of an installed distribution."""
    info = tmp_path / "predicting_policies-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: predicting-policies\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{GROUP}]\npredicted_shortest = {__name__}:PredictedShortestFirst\nshortest = {__name__}:ShortestPromptFirst\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield
    importlib.invalidate_caches()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def test_a_plugin_policy_predicts_from_the_engine_s_one_latency_model(installed, autojump_clock, tmp_path):
    async with actor_fixtures.fake_engine(
        step_time=0.01, token_time=0.001, scheduling_policy="slo", plugins=("predicted_shortest",)
    ) as engine:
        [model] = engine.latency_models()
        guarded = engine.core.scheduler.policy
        # One model: the plugin's, the fallback slo policy's, the door's and the one the actor feeds.
        assert guarded.policy.latency is model and guarded.fallback.latency is model
        objectives = LatencyObjectives(ttft=30.0)
        streams = [engine.generate_nowait([7 + i] * (10 + 20 * i), greedy(4), objectives=objectives) for i in range(3)]
        for stream in streams:
            async for _ in stream:
                pass
        assert not guarded.failed
        learned = model.num_steps
        assert learned > 0  # what the plugin predicts with has learned from the steps
        assert guarded.policy.steps_seen > 0  # and its own optional hook was told of them
        # A saved profile seeds what the plugin predicts with.
        law = LatencyModel(forgetting=1.0)
        for prefill in (1, 8, 32, 64, 128) * 4:
            law.observe(StepShape(prefill), 0.05 + 0.001 * prefill)
        path = str(tmp_path / "profile.json")
        save_models([law], [path], profile_identity(engine))
        assert seed_engine(engine, path) == 1
        assert guarded.policy.latency.num_steps == law.num_steps != learned
        assert guarded.policy.latency.step_seconds(StepShape(64)) == law.step_seconds(StepShape(64))


def test_a_factory_of_the_config_alone_still_loads(installed):
    config = engine_config(scheduling_policy="slo", plugins=("shortest",))
    model = LatencyModel()
    guarded = scheduling_policy(Plugins.load(config.plugins), config, model)
    assert isinstance(guarded.policy, ShortestPromptFirst) and guarded.fallback.latency is model


class BrokenBudget(ShortestPromptFirst):
    def token_budget(self, running, tokens: int, now: float) -> int:
        raise RuntimeError("broken budget")


def test_a_plugin_hook_that_fails_hands_over_to_the_builtin_policy(caplog):
    model = LatencyModel()
    guarded = scheduling_policy(Plugins(scheduling_policy=("broken", BrokenBudget)), engine_config(scheduling_policy="slo"), model)
    assert guarded.token_budget([], 256, 0.0) == 256  # the slo policy's: nothing runs, nothing is cut
    assert guarded.failed and "'broken' failed" in caplog.text
    # A plugin without the optional hooks cuts nothing and preempts nothing for a slot.
    plain = scheduling_policy(Plugins(scheduling_policy=("plain", ShortestPromptFirst)), engine_config(), model)
    assert plain.token_budget([], 256, 0.0) == 256 and plain.slot_victim(None, [], running=[], now=0.0, limits=None) is None
