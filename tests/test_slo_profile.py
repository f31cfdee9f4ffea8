"""``--slo-profile`` (web/slo_profile.py): the latency model saved as a
versioned profile (``LatencyModel.to_profile`` / ``from_profile``), its
validation naming the field, the flag's checks, and a real loopback server
that writes the profile at its stop and, started again, admits from it."""

from __future__ import annotations

import json
import math

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve import testing
from trioserve.engine.core.latency_model import LatencyModel, LatencyProfileError, StepShape
from trioserve.web.app import app_host, create_app
from trioserve.web.serve_options import build_serve_parser, server_config_from_args
from trioserve.web.slo_profile import profile_identity, replica_paths

from server_fixtures import MODEL, server_config, server_in_thread

shapes = st.builds(
    StepShape,
    prefill_tokens=st.integers(0, 4096),
    prefill_pairs=st.integers(0, 4_000_000),
    decodes=st.integers(0, 64),
    decode_context=st.integers(0, 30_000),
)
steps = st.lists(st.tuples(shapes, st.floats(1e-4, 2.0)), max_size=40)


def _trained(observed) -> LatencyModel:
    model = LatencyModel()
    for shape, seconds in observed:
        model.observe(shape, seconds)
    return model


@settings(max_examples=40, deadline=None)
@given(observed=steps, probe=shapes, then=steps)
def test_a_profile_round_trip_predicts_and_learns_as_the_original(observed, probe, then):
    original = _trained(observed)
    restored = LatencyModel.from_profile(json.loads(json.dumps(original.to_profile({"model": "m"}))))
    assert restored.step_seconds(probe) == original.step_seconds(probe)
    assert restored.predict_ttft(300, running=[(40, 0, 9)], ahead=[(100, 5)]) == original.predict_ttft(
        300, running=[(40, 0, 9)], ahead=[(100, 5)]
    )
    # The covariance came along: both go on learning alike.
    for shape, seconds in then:
        original.observe(shape, seconds)
        restored.observe(shape, seconds)
    assert restored.to_profile() == original.to_profile()


def _valid() -> dict:
    return _trained([(StepShape(100, 5000, 2, 300), 0.02)] * 5).to_profile({"model": "m"})


def _without(name: str) -> dict:
    profile = _valid()
    del profile[name]
    return profile


@pytest.mark.parametrize(
    ("profile", "field"),
    [
        ([], "(top level)"),
        ({**_valid(), "version": 2}, "version"),
        ({**_valid(), "version": "1"}, "version"),
        ({**_valid(), "format": "other"}, "format"),
        (_without("covariance"), "covariance"),
        (_without("identity"), "identity"),
        ({**_valid(), "num_steps": True}, "num_steps"),
        ({**_valid(), "num_steps": -1}, "num_steps"),
        ({**_valid(), "coefficients": [0.0] * 4}, "coefficients"),
        ({**_valid(), "coefficients": [0.0, 0.0, math.nan, 0.0, 0.0]}, "coefficients[2]"),
        ({**_valid(), "prior": [0.0, 0.0, 0.0, "x", 0.0]}, "prior[3]"),
        ({**_valid(), "covariance": [[0.0] * 5] * 4 + [[0.0, math.inf, 0.0, 0.0, 0.0]]}, "covariance[4][1]"),
        ({**_valid(), "covariance": [[0.0] * 5] * 4}, "covariance"),
        ({**_valid(), "forgetting": 0.2}, "forgetting"),
        ({**_valid(), "window": 1.5}, "window"),
    ],
)
def test_an_invalid_profile_is_refused_naming_the_field(profile, field):
    with pytest.raises(LatencyProfileError) as refused:
        LatencyModel.from_profile(profile)
    assert refused.value.field == field
    assert repr(field) in str(refused.value)


def _serve_args(*argv: str):
    return build_serve_parser().parse_args(list(argv))


def test_the_flag_needs_the_slo_policy_and_a_valid_file(tmp_path):
    with pytest.raises(ValueError, match="--scheduling-policy slo"):
        server_config_from_args(_serve_args("--slo-profile", str(tmp_path / "p.json")))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**_valid(), "version": 7}))
    with pytest.raises(ValueError, match="'version'"):
        server_config_from_args(_serve_args("--scheduling-policy", "slo", "--slo-profile", str(bad)))
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        server_config_from_args(_serve_args("--scheduling-policy", "slo", "--slo-profile", str(bad)))
    # Missing is fine: the first run writes it.
    fresh = str(tmp_path / "p.json")
    config = server_config_from_args(_serve_args("--scheduling-policy", "slo", "--slo-profile", fresh))
    assert config.slo_profile == fresh
    assert replica_paths("p.json", 2) == ["p.json.0", "p.json.1"]


def _engine(server):
    return app_host(server.app).models[MODEL].engine


def _chat(server, **extra):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body=extra
    )


def test_a_server_saves_its_model_at_stop_and_starts_again_from_it(tmp_path):
    path = tmp_path / "slo.json"
    config = server_config(engine={"scheduling_policy": "slo"}, slo_profile=str(path))
    loaded = testing.tiny_loaded()
    with server_in_thread(create_app(config, loaded=loaded)) as first:
        for _ in range(3):
            _chat(first)
        engine = _engine(first)
        learned = engine.latency_models()[0]
        identity = profile_identity(engine)
        assert not path.exists()  # written at stop, not before
    saved = json.loads(path.read_text())
    # What the first server ended with, after its drain.
    assert saved == json.loads(json.dumps(learned.to_profile(identity)))
    assert saved["num_steps"] > 0 and saved["identity"]["model"] is None

    with server_in_thread(create_app(config, loaded=loaded)) as second:
        seeded = second.run_sync(lambda: _engine(second).latency_models()[0].to_profile(identity))
        assert json.loads(json.dumps(seeded)) == saved
        # The door's first decision predicts with the saved fit, not the prior.
        reply = _chat(second, ttft_ms=60_000, tpot_ms=60_000)
        predicted = reply.usage.model_extra["slo"]["predicted"]["tpot_ms"]
        context = reply.usage.prompt_tokens + 4 / 2
        expected = LatencyModel.from_profile(saved).predict_tpot(1, int(context)) * 1000
        assert predicted == pytest.approx(expected, abs=0.051)
        assert expected != pytest.approx(LatencyModel().predict_tpot(1, int(context)) * 1000, abs=0.051)


def test_a_profile_for_other_settings_is_set_aside(tmp_path, caplog):
    path = tmp_path / "slo.json"
    path.write_text(json.dumps({**_valid(), "identity": {"model": "another"}}))
    config = server_config(engine={"scheduling_policy": "slo"}, slo_profile=str(path))
    with caplog.at_level("WARNING", logger="trioserve.web.slo_profile"):
        with server_in_thread(create_app(config, loaded=testing.tiny_loaded())) as server:
            steps = server.run_sync(lambda: _engine(server).latency_models()[0].num_steps)
    assert steps == 0
    assert "learned for" in caplog.text and "starts fresh" in caplog.text
    assert json.loads(path.read_text())["identity"]["model"] is None  # overwritten with this run's
