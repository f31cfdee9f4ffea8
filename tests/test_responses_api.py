"""OpenAI's Responses API (web/openai_responses_api.py) end to end: a real
server on the default model driven by the official ``openai`` client's
``responses.create`` and ``responses.stream``, compared with the answers
the chat completions path gives the same conversation (greedy); the
store behind ``previous_response_id``; and, without a server, the
property that a conversation continued from stored responses is the one
sent whole."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve import testing
from trioserve.web.app import create_app
from trioserve.web.openai_responses import ResponsesBody, output_conversation
from trioserve.web.openai_responses_output import ResponseShape
from trioserve.web.responses_store import ResponsesStore, StoredResponse
from trioserve.web.serve_options import build_serve_parser, server_config_from_args

from scripted_tokens import script, scripted_plugin
from server_fixtures import MODEL, server_config, server_in_thread

KEY = "sesame"
SYSTEM = "You are a terse assistant."
QUESTION = "Name three colors."
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": PARAMETERS}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}


@pytest.fixture(scope="module")
def server(default_loaded):
    with server_in_thread(create_app(server_config(api_key=KEY), loaded=default_loaded)) as running:
        yield running


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as sync_client:
        yield sync_client


def _create(client, **body):
    return client.responses.create(**{"model": MODEL, "input": QUESTION, "max_output_tokens": 16, "temperature": 0, **body})


def _stream_body(**body):
    return {"model": MODEL, "input": QUESTION, "max_output_tokens": 16, "temperature": 0, **body}


# -- the server ----------------------------------------------------------------


@pytest.mark.slow
def test_create_equals_chat_completion_and_echoes_the_request(client):
    response = _create(client, instructions=SYSTEM, metadata={"run": "1"}, user="u1", max_output_tokens=4)
    answer = client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )

    assert response.object == "response" and response.model == MODEL and response.id.startswith("resp_")
    assert response.output_text == answer.choices[0].message.content
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.input_tokens == answer.usage.prompt_tokens
    assert response.usage.output_tokens == answer.usage.completion_tokens == 4
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert answer.choices[0].finish_reason == "length"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.instructions, response.metadata, response.user) == (SYSTEM, {"run": "1"}, "u1")
    assert (response.max_output_tokens, response.temperature, response.store) == (4, 0, True)


@pytest.mark.slow
def test_stream_events_in_order_and_final_response_equals_create(client):
    whole = _create(client, instructions=SYSTEM, max_output_tokens=64)
    with client.responses.stream(**_stream_body(instructions=SYSTEM, max_output_tokens=64)) as stream:
        events = list(stream)
        final = stream.get_final_response()

    assert whole.status == "completed"  # the answer ends before 64 tokens
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text
    assert final.status == whole.status
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    stored = client.responses.retrieve(final.id)  # a streamed response is stored too
    assert stored.output_text == whole.output_text and stored.status == "completed"


@pytest.mark.slow
def test_stream_cut_by_max_output_tokens_ends_with_response_incomplete(client):
    whole = _create(client, max_output_tokens=3)
    stream = client.responses.create(**_stream_body(max_output_tokens=3), stream=True)
    events = list(stream)

    assert events[-1].type == "response.incomplete"
    last = events[-1].response
    assert (last.status, last.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert last.output_text == whole.output_text and last.usage.output_tokens == 3
    assert [item.status for item in last.output] == [item.status for item in whole.output] == ["incomplete"]


@pytest.mark.slow
def test_store_get_delete_and_previous_response_id(client, server):
    first = _create(client, instructions=SYSTEM, max_output_tokens=6)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()

    follow = "And three animals?"
    continued = _create(client, previous_response_id=first.id, input=follow, max_output_tokens=6)
    # The same conversation sent whole: the first input, its output items as they came, the new input.
    whole = _create(
        client,
        input=[
            {"role": "user", "content": QUESTION},
            *[item.model_dump() for item in first.output],
            {"role": "user", "content": follow},
        ],
        max_output_tokens=6,
    )
    assert continued.previous_response_id == first.id
    assert continued.usage.input_tokens == whole.usage.input_tokens
    assert continued.output_text == whole.output_text
    # instructions are not carried over (as OpenAI's are not).
    assert continued.instructions is None

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(first.id)
    assert caught.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, previous_response_id=first.id, input=follow)
    assert caught.value.body["param"] == "previous_response_id"

    unstored = _create(client, store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, previous_response_id=unstored.id, input=follow)
    assert caught.value.body["code"] == "previous_response_not_found"
    assert server.host.responses.get(unstored.id) is None


@pytest.mark.slow
def test_forced_function_call_whole_and_streamed_and_its_output_continues(client):
    response = _create(client, tools=[WEATHER], tool_choice="required", max_output_tokens=40)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed"
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("fc_")
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")

    # The same forced choice: its grammar, compiled once, is cached.
    with client.responses.stream(**_stream_body(tools=[WEATHER], tool_choice="required", max_output_tokens=40)) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(kinds)
    streamed_calls = [(c.name, c.arguments) for c in streamed.output if c.type == "function_call"]
    assert streamed_calls == [("get_weather", calls[0].arguments)]

    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}
    continued = _create(client, previous_response_id=response.id, input=[result], tools=[WEATHER], max_output_tokens=4)
    expected = client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        temperature=0,
        tools=[CHAT_WEATHER],
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].call_id, "type": "function",
                "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 21 C"},
        ],
    )  # fmt: skip
    assert continued.usage.input_tokens == expected.usage.prompt_tokens
    assert continued.output_text == (expected.choices[0].message.content or "")


@pytest.mark.slow
def test_json_schema_text_format_constrains_the_output(client):
    fmt = {"type": "json_schema", "name": "city", "schema": PARAMETERS, "strict": True}
    response = _create(client, text={"format": fmt}, max_output_tokens=30)
    assert json.loads(response.output_text)["city"] in ("Paris", "Oslo")
    assert response.text.format.type == "json_schema"


@pytest.mark.slow
def test_reasoning_text_and_a_call_are_one_response_whole_and_streamed(monkeypatch):
    # The tiny model writes what a reasoning model with tools writes: its
    # reasoning scripted token by token, then its answer held to a regex.
    scripted_plugin(monkeypatch)
    config = server_config(reasoning_parser="qwen3", engine={"plugins": ("scripted",)})
    thinking = script(testing.tiny_loaded().tokenizer, "<think>Oslo, then.", "</think>")
    answer = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    extra = {"logits_processors": [thinking], "structured_outputs": {"regex": re.escape(answer)}}
    body = _stream_body(tools=[WEATHER], max_output_tokens=80, extra_body=extra)
    with server_in_thread(create_app(config, loaded=testing.tiny_loaded())) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
            whole = client.responses.create(**body)
            with client.responses.stream(**body) as stream:
                kinds = {event.type for event in stream}
                streamed = stream.get_final_response()

    def items(response):
        return [
            (item.type, item.status, [part.text for part in item.content] if item.type != "function_call" else None,
             getattr(item, "name", None), getattr(item, "arguments", None))
            for item in response.output
        ]  # fmt: skip

    assert whole.status == "completed"
    assert items(whole) == [
        ("reasoning", "completed", ["Oslo, then."], None, None),
        ("message", "completed", ["Sure."], None, None),
        ("function_call", "completed", None, "get_weather", '{"city": "Oslo"}'),
    ]
    assert items(streamed) == items(whole)
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    assert streamed.usage.model_dump(exclude={"input_tokens_details"}) == whole.usage.model_dump(exclude={"input_tokens_details"})
    assert {
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_text.delta",
        "response.function_call_arguments.delta",
    } <= kinds


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"type": "web_search_call"}]},
         "input[2].type"),
        ({"input": [{"type": "nonsense"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**WEATHER, "name": "has space"}]}, "tools[0].name"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"truncation": "auto"}, "truncation"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ],
)
def test_bad_input_gets_openais_error_naming_the_field(client, body, field):
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, **body)
    error = caught.value
    assert error.status_code == 400
    assert error.body["type"] == "invalid_request_error"
    assert error.body["param"] == field, error.body


@pytest.mark.slow
def test_an_unknown_route_under_responses_and_a_missing_key_answer_in_openais_shape(server):
    refused = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": QUESTION})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    missing = httpx.get(server.url + "/v1/responses/resp_x/input_tokens", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


# -- without a server ----------------------------------------------------------


def test_store_drops_the_least_recently_used_beyond_its_capacity():
    store = ResponsesStore(2)
    for name in ("a", "b"):
        store.put(StoredResponse({"id": name}, ()))
    assert store.get("a") is not None  # a use: b is now the oldest
    store.put(StoredResponse({"id": "c"}, ()))
    assert [store.get(name) is not None for name in ("a", "b", "c")] == [True, False, True]
    assert store.delete("a") and not store.delete("a")
    assert store.statistics().size == 1


def test_the_store_size_flag():
    args = build_serve_parser().parse_args(["--responses-store-size", "3"])
    assert server_config_from_args(args).responses_store_size == 3
    with pytest.raises(SystemExit):
        build_serve_parser().parse_args(["--responses-store-size", "0"])


_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_ARGUMENTS = st.dictionaries(st.sampled_from(["city", "days"]), st.integers(0, 9) | _TEXT, max_size=2)
# A model's turn: its reasoning, text, calls (name, arguments), any of them.
_CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "get_time"]), _ARGUMENTS), max_size=2)
_TURN = st.tuples(_TEXT, _TEXT, _CALLS)
_INSTRUCTIONS = st.none() | _TEXT


def _chat_body(reasoning: str, text: str, calls: list[tuple[str, dict]], turn: int) -> dict:
    """A ``chat.completion`` body as the chat path gives it for a model's turn."""
    tool_calls = [
        {"id": f"call_{turn}_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        for i, (name, arguments) in enumerate(calls)
    ]
    message = {"role": "assistant", "content": text or None, "reasoning_content": reasoning or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
    return {"choices": [{"message": message, "finish_reason": "tool_calls" if calls else "stop"}], "usage": usage}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_TEXT, _INSTRUCTIONS, _TURN), min_size=1, max_size=4))
def test_a_conversation_continued_from_stored_responses_is_the_one_sent_whole(turns):
    """Each turn sent with ``previous_response_id`` (the server's store and
    translation) gives the chat messages of the whole conversation sent
    at once, the outputs appended as a client appends ``response.output``
    (their reasoning items included, which the prompt leaves out)."""
    previous: StoredResponse | None = None
    whole: list[dict] = []
    for turn, (user, instructions, (reasoning, text, calls)) in enumerate(turns):
        new = [{"type": "function_call_output", "call_id": item["call_id"], "output": "done"}
               for item in (previous.body["output"] if previous else []) if item["type"] == "function_call"]  # fmt: skip
        new.append({"role": "user", "content": [{"type": "input_text", "text": user}]})
        body = {"input": new, "instructions": instructions}
        chained = ResponsesBody.from_json(body, previous)
        whole += new
        sent_whole = ResponsesBody.from_json({"input": list(whole), "instructions": instructions})
        assert chained.chat["messages"] == sent_whole.chat["messages"]
        shape = ResponseShape("resp_" + str(turn), MODEL, chained, 0.0, 1.0)
        response = shape.from_chat(_chat_body(reasoning, text, calls, turn), len)
        previous = StoredResponse(response, (*chained.conversation, *output_conversation(response["output"])))
        whole += json.loads(json.dumps(response["output"]))  # as the client sends the items back
