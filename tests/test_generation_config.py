"""The model's sampling defaults (engine/loading/generation_config.py): read from a
generation_config.json or a GGUF's sampling keys, they fill the sampling
fields a request leaves out, on a real server and through the Python API;
an explicit field always wins; a bad --generation-config stops startup
naming the path and the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve import testing
from trioserve.actors import open_engine
from trioserve.engine.config import EngineConfig
from trioserve.engine.errors import GenerationConfigError
from trioserve.engine.loading.generation_config import (
    BUILT_IN_SAMPLING,
    SamplingDefaults,
    load_sampling_defaults,
    read_gguf_metadata,
    read_generation_config,
)
from trioserve.engine.loading.sources import default_model_path
from trioserve.engine.sampling.sampling_params import DEFAULTABLE_FIELDS, NEUTRAL_SAMPLING, SamplingParams
from trioserve.web.app import create_app
from trioserve.web.settings import ModelSpec, ServerConfig

from server_fixtures import serving

PROMPT = "the cat sat on the mat and"


def write_json(path: Path, value: object) -> Path:
    path.write_text(json.dumps(value))
    return path


def write_gguf(path: Path, **sampling: float) -> Path:
    """A GGUF holding only metadata: a vocabulary (an array of strings, as
    every model's) and llama.cpp's sampling keys."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    for name, value in sampling.items():
        getattr(writer, f"add_sampling_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- reading -------------------------------------------------------------------


def test_a_generation_config_sets_what_it_names_and_leaves_the_rest_neutral(tmp_path):
    # Other fields (eos ids, do_sample, max_new_tokens) and nulls are not sampling defaults.
    path = write_json(
        tmp_path / "generation_config.json",
        {"eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": None, "max_new_tokens": 9},
    )
    assert read_generation_config(path) == {"temperature": 0.6, "top_p": 0.9}
    defaults = load_sampling_defaults(str(tmp_path), None)  # a folder holding one
    assert defaults.values == {**NEUTRAL_SAMPLING, "temperature": 0.6, "top_p": 0.9}
    assert (defaults.source, defaults.path) == ("flag", str(path))


def test_a_source_without_sampling_fields_gives_the_built_in_defaults(tmp_path):
    path = write_json(tmp_path / "gc.json", {"bos_token_id": 1, "eos_token_id": 2})
    for defaults in (load_sampling_defaults(str(path), None), load_sampling_defaults("none", str(tmp_path))):
        assert defaults == SamplingDefaults.built_in()
        assert defaults.values == BUILT_IN_SAMPLING and defaults.source == "built-in"


def test_the_default_model_has_no_sampling_keys_and_gets_the_built_in_defaults():
    defaults = load_sampling_defaults("auto", None)
    assert defaults.source == "built-in"
    assert defaults.values == {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.0}


def test_a_gguf_s_sampling_keys_are_the_model_s_defaults(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", temp=0.6, top_k=20, top_p=0.95, min_p=0.1, penalty_repeat=1.1)
    defaults = load_sampling_defaults("auto", str(path))
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1}
    assert (defaults.source, defaults.path) == ("model", str(path))


def test_the_metadata_reader_agrees_with_gguf_py_on_the_default_model():
    path = default_model_path()
    reader = gguf.GGUFReader(path)
    scalars = {k: f.contents() for k, f in reader.fields.items() if len(f.types) == 1 and f.types[0] != gguf.GGUFValueType.STRING}
    scalars = {k: v for k, v in scalars.items() if not k.startswith("GGUF.")}
    assert read_gguf_metadata(path, wanted=set(scalars)) == pytest.approx(scalars)


@settings(max_examples=25, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["temp", "top_k", "top_p", "min_p", "penalty_repeat"]),
        st.floats(1 / 64, 1.0, width=32),
    ).map(lambda d: {k: (max(1, round(v * 100)) if k == "top_k" else v) for k, v in d.items()})
)
def test_every_written_sampling_key_is_read_back(tmp_path_factory, sampling):
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "m.gguf", **sampling)
    names = {"temp": "temperature", "penalty_repeat": "repetition_penalty"}
    want = {names.get(k, k): v for k, v in sampling.items()}
    assert load_sampling_defaults("auto", str(path)).values == pytest.approx({**(NEUTRAL_SAMPLING if want else BUILT_IN_SAMPLING), **want}, rel=1e-6)


# -- filling a request -----------------------------------------------------------

EXPLICIT = {
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    "top_p": st.sampled_from([0.1, 0.9, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 50]),
    "min_p": st.sampled_from([0.0, 0.2]),
    "repetition_penalty": st.sampled_from([0.8, 1.0, 1.3]),
}


@given(
    explicit=st.fixed_dictionaries({}, optional=EXPLICIT),
    defaults=st.fixed_dictionaries(EXPLICIT),
)
def test_an_explicit_field_wins_and_an_unset_one_takes_the_default(explicit, defaults):
    params = SamplingParams(max_tokens=4, **explicit)
    assert set(params.unset_fields) == set(DEFAULTABLE_FIELDS) - set(explicit)
    filled = SamplingDefaults(**defaults, source="flag", path="x").apply(params)
    assert filled.unset_fields == ()
    for name in DEFAULTABLE_FIELDS:
        assert getattr(filled, name) == explicit.get(name, defaults[name])
    # Greedy stays greedy, whatever the model's defaults.
    assert filled.greedy == (explicit.get("temperature", defaults["temperature"]) == 0.0)
    assert SamplingDefaults.built_in().apply(filled) == filled  # filling twice changes nothing


def test_an_unfilled_request_reads_the_neutral_values():
    params = SamplingParams()
    assert {name: getattr(params, name) for name in DEFAULTABLE_FIELDS} == NEUTRAL_SAMPLING


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (None, "no such file"),
        ("{not json", "not valid JSON"),
        ("[0.7]", "JSON object"),
        ('{"temperature": "hot"}', "temperature"),
        ('{"top_k": 40.5}', "top_k"),
        ('{"top_k": true}', "top_k"),
        ('{"top_p": 0}', "top_p"),
    ],
)
def test_a_bad_generation_config_is_refused_naming_the_path_and_the_field(tmp_path, content, named):
    path = tmp_path / "generation_config.json"
    if content is not None:
        path.write_text(content)
    # A missing path is refused as the config is made; a file's fields when
    # an engine opens and reads it.
    with pytest.raises(GenerationConfigError) as info:
        config = EngineConfig(generation_config=str(path))
        load_sampling_defaults(config.generation_config, config.model)
    assert str(path) in str(info.value) and named in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_folder_without_a_generation_config_is_refused(tmp_path):
    with pytest.raises(GenerationConfigError, match="holds no generation_config.json"):
        EngineConfig(generation_config=str(tmp_path))


def test_the_model_s_own_broken_file_is_refused_naming_it(tmp_path):
    path = write_json(tmp_path / "generation_config.json", {"temperature": -1})
    with pytest.raises(GenerationConfigError) as info:
        load_sampling_defaults("auto", str(tmp_path))
    assert str(path) in str(info.value) and "temperature" in str(info.value) and "none" in str(info.value)


@pytest.mark.parametrize(
    ("command", "content"), [("serve", None), ("serve", "{oops"), ("generate", '{"min_p": "high"}')]
)
def test_the_cli_stops_before_loading_with_exit_code_2(tmp_path, command, content):
    path = tmp_path / "gc.json"
    if content is not None:
        path.write_text(content)
    args = ["--port", "0"] if command == "serve" else ["hello"]
    result = subprocess.run(
        [sys.executable, "-m", "trioserve.web.cli", command, "--generation-config", str(path), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert str(path) in result.stderr and "Traceback" not in result.stderr
    if content is not None and "min_p" in content:
        assert "min_p" in result.stderr


# -- a real server ---------------------------------------------------------------


def tiny_app(model_path: Path, generation_config: str = "auto"):
    """The tiny model served as "tiny", its files (what sampling defaults
    "auto" reads) at ``model_path``."""
    config = ServerConfig(
        engine=testing.engine_config(generation_config=generation_config),
        models=(ModelSpec("tiny", str(model_path)),),
        shutdown_timeout=5.0,
    )
    return create_app(config, loaded=testing.tiny_loaded())


async def complete(http: httpx.AsyncClient, **fields) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "logprobs": 0, **fields}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


async def sampling_defaults(http: httpx.AsyncClient) -> dict:
    response = await http.get("/v1/models")
    assert response.status_code == 200
    (model,) = response.json()["data"]
    return model["sampling_defaults"]


async def test_a_served_model_s_generation_config_fills_what_requests_leave_out(tmp_path):
    path = write_json(tmp_path / "generation_config.json", {"temperature": 0.0, "top_p": 0.5})
    async with serving(tiny_app(tmp_path)) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        assert await sampling_defaults(http) == {
            **NEUTRAL_SAMPLING, "temperature": 0.0, "top_p": 0.5, "source": "model", "path": str(path)
        }
        greedy = await complete(http, temperature=0)
        # Temperature left out (or null): the model's 0, greedy, whatever the seed.
        assert await complete(http, seed=1) == greedy
        assert await complete(http, temperature=None, seed=2) == greedy
        # An explicit temperature wins; top_p, left out, is still the model's 0.5.
        sampled = await complete(http, temperature=1.5, seed=3)
        assert sampled != greedy
        assert await complete(http, temperature=1.5, top_p=0.5, seed=3) == sampled
        assert await complete(http, temperature=1.5, top_p=1.0, seed=3) != sampled


async def test_none_ignores_the_model_s_file_for_the_built_in_defaults(tmp_path):
    write_json(tmp_path / "generation_config.json", {"temperature": 0.0})
    async with serving(tiny_app(tmp_path, "none")) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        assert await sampling_defaults(http) == {**BUILT_IN_SAMPLING, "source": "built-in", "path": None}
        left_out = await complete(http, seed=4)
        assert left_out == await complete(http, **BUILT_IN_SAMPLING, seed=4)
        assert left_out != await complete(http, temperature=0)


async def test_a_flag_path_wins_over_the_model_s_file_and_a_gguf_is_read(tmp_path):
    model = write_gguf(tmp_path / "tiny.gguf", temp=1.5, top_k=7)
    flag = write_json(tmp_path / "mine.json", {"top_k": 1})
    async with serving(tiny_app(model, str(flag))) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        assert await sampling_defaults(http) == {**NEUTRAL_SAMPLING, "top_k": 1, "source": "flag", "path": str(flag)}
        # top_k 1 keeps only the likeliest token: greedy at any temperature.
        assert await complete(http, temperature=1.5, seed=5) == await complete(http, temperature=0)
    async with serving(tiny_app(model)) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        assert await sampling_defaults(http) == {
            **NEUTRAL_SAMPLING, "temperature": 1.5, "top_k": 7, "source": "model", "path": str(model)
        }


# -- the Python API ----------------------------------------------------------------


async def test_open_engine_fills_what_sampling_params_leave_out(tmp_path):
    write_json(tmp_path / "generation_config.json", {"temperature": 0.0})
    config = testing.engine_config(model=str(tmp_path))

    async def tokens(engine, params: SamplingParams) -> list[int]:
        out = []
        async for output in engine.generate(PROMPT, params):
            out += output.new_token_ids
        return out

    async with open_engine(config, loaded=testing.tiny_loaded()) as engine:
        assert engine.sampling_defaults.values["temperature"] == 0.0
        greedy = await tokens(engine, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        assert await tokens(engine, SamplingParams(seed=6, max_tokens=24, ignore_eos=True)) == greedy
        assert await tokens(engine, SamplingParams(temperature=1.5, seed=6, max_tokens=24, ignore_eos=True)) != greedy
