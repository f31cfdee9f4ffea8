"""Structured output and tool calling on the default model, end to end: a
real server driven by the official openai client. Requests of one test go
out together from threads, so the engine batches them."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pydantic
import pytest

from conftest import make_core
from server_fixtures import MODEL, server_config, server_in_thread
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.sampling.structured_output import StructuredOutput
from trioserve.web.app import create_app

pytestmark = pytest.mark.slow

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}


def obj(required=True, **properties):
    schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(properties)
    return schema


# Of increasing difficulty: scalars, enums, objects, bounded arrays, string
# patterns, numbers with ranges, optional fields, unions, references, nesting.
SCHEMAS = [
    {"type": "boolean"},
    {"type": "integer", "minimum": 1, "maximum": 9},
    {"type": "string", "maxLength": 10},
    {"enum": ["red", "green", "blue"]},
    obj(name=NAME),
    obj(name=NAME, age=AGE),
    obj(active={"type": "boolean"}, role={"enum": ["admin", "user", "guest"]}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 3},
    obj(city=NAME, zip={"type": "string", "pattern": "^[0-9]{5}$"}),
    obj(score={"type": "number", "minimum": 0, "maximum": 1}, count={"type": "integer", "minimum": -5, "maximum": 5}),
    obj(person=obj(name=NAME, age=AGE)),
    {**obj(required=False, name=NAME, nickname=NAME, age=AGE), "required": ["name"]},
    obj(items={"type": "array", "maxItems": 2, "items": obj(id=AGE, tag={"enum": ["a", "b"]})}),
    obj(value={"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, {"type": "string", "maxLength": 6}]}),
    obj(email={"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}),
    obj(grid={"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    {"$defs": {"point": obj(x=AGE, y=AGE)}, **obj(start={"$ref": "#/$defs/point"}, end={"$ref": "#/$defs/point"})},
    obj(a=obj(b=obj(c={"enum": [1, 2, 3]}, d=NAME), e={"type": "boolean"}), f={"type": "array", "maxItems": 2, "items": NAME}),
    obj(
        name=NAME,
        age=AGE,
        email={"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        tags={"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        address=obj(street=NAME, city=NAME, zip={"type": "string", "pattern": "^[0-9]{5}$"}),
        role={"enum": ["admin", "user", "guest"]},
        active={"type": "boolean"},
    ),
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": obj(city=NAME, unit={"enum": ["celsius", "fahrenheit"]}),
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city", "parameters": obj(city=NAME)}}


@pytest.fixture(scope="module")
def server(default_loaded):
    engine = dict(kv_cache_memory=1 << 30, max_model_len=512, max_num_seqs=128)
    with server_in_thread(create_app(server_config(engine=engine), loaded=default_loaded)) as running:
        yield running


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600) as sync_client:
        yield sync_client


def _together(calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_twenty_schemas_always_parse_and_validate(client):
    def ask(schema, **sampling):
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        messages = [{"role": "user", "content": "Reply with a JSON value."}]
        return lambda: client.chat.completions.create(
            model=MODEL, messages=messages, response_format=fmt, max_tokens=160, **sampling
        )

    calls = []
    for schema in SCHEMAS:
        calls.append(ask(schema, temperature=0))
        calls.append(ask(schema, temperature=1.0, n=5, seed=7))  # seeds 7..11, one per completion
    responses = _together(calls)
    for i, response in enumerate(responses):
        schema = SCHEMAS[i // 2]
        assert len(response.choices) == (1 if i % 2 == 0 else 5)
        for choice in response.choices:
            assert choice.finish_reason == "stop", (schema, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_choice_and_regex_always_match(server):
    choices = ["positive", "negative", "neutral"]
    pattern = r"\d{3}-\d{3}-\d{4}"

    def ask(outputs, seed):
        body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 24, "temperature": 1.0, "seed": seed, "structured_outputs": outputs}
        return lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=600).json()

    calls = [ask({"choice": choices}, seed) for seed in range(5)] + [ask({"regex": pattern}, seed) for seed in range(5)]
    bodies = _together(calls)
    for body in bodies[:5]:
        assert body["choices"][0]["text"] in choices and body["choices"][0]["finish_reason"] == "stop"
    for body in bodies[5:]:
        assert re.fullmatch(pattern, body["choices"][0]["text"]) and body["choices"][0]["finish_reason"] == "stop"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=100_000_000)


def test_openai_parse_returns_a_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name


def test_streamed_tool_calls_are_assembled_by_the_client(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    def stream(tool_choice):
        def call():
            with client.chat.completions.stream(
                model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=60, temperature=0
            ) as events:
                return events.get_final_completion()

        return call

    named = {"type": "function", "function": {"name": "get_time"}}
    required, chosen = _together([stream("required"), stream(named)])
    for completion, names in ((required, {"get_weather", "get_time"}), (chosen, {"get_time"})):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_results_in_the_history_are_answered(client):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    completion = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8, temperature=0)
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_bad_constraints_get_400_naming_the_field(server, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_free_half_of_a_batch_of_32_keeps_its_tokens(default_loaded):
    core = make_core(default_loaded, max_num_seqs=32)

    def run(requests):
        for request_id, params in requests.items():
            core.add_request(request_id, [{"role": "user", "content": f"Tell me about the number {request_id}."}], params)
        tokens = {rid: [] for rid in requests}
        while core.has_unfinished():
            for out in core.step():
                tokens[out.request_id].extend(out.new_token_ids)
        return tokens

    free = {f"{i}": SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=8) for i in range(16)}
    schema = StructuredOutput.json_schema(SCHEMAS[-1])
    constrained = {f"{i}x": SamplingParams(temperature=0.8, seed=i, max_tokens=8, structured_output=schema) for i in range(16)}
    alone = run(free)
    mixed = run({**free, **constrained})
    assert {rid: mixed[rid] for rid in free} == alone
