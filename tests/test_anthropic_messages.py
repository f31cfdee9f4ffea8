"""Anthropic's Messages API (web/anthropic_api.py) end to end: a real
server on the default model, behind an API key, driven by the official
``anthropic`` client, sync and streaming, and compared with the answers
the chat completions path gives the same conversation (greedy)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from trioserve import testing
from trioserve.web.app import create_app

from server_fixtures import MODEL, server_config, server_in_thread

pytestmark = pytest.mark.slow

KEY = "sesame"
SYSTEM = "You are a terse assistant."
QUESTION = "Name three colors."
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# The client no longer sends sampling fields itself; the server reads them.
GREEDY = {"temperature": 0}
FORCED = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(default_loaded):
    with server_in_thread(create_app(server_config(api_key=KEY), loaded=default_loaded)) as running:
        yield running


@pytest.fixture
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as sync_client:
        yield sync_client


@pytest.fixture
def chat(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as sync_client:
        yield sync_client


def _create(client, **body):
    body = {"model": MODEL, "max_tokens": 16, "extra_body": GREEDY, "messages": [{"role": "user", "content": QUESTION}], **body}
    return client.messages.create(**body)


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_equals_chat_completion(client, chat):
    message = _create(client, system=SYSTEM, metadata={"user_id": "u1"})
    answer = chat.chat.completions.create(
        model=MODEL,
        max_tokens=16,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )

    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert _text(message) == answer.choices[0].message.content
    assert message.usage.input_tokens == answer.usage.prompt_tokens
    assert message.usage.output_tokens == answer.usage.completion_tokens
    expected = {"stop": "end_turn", "length": "max_tokens"}[answer.choices[0].finish_reason]
    assert message.stop_reason == expected


def test_system_as_text_blocks_equals_system_string(client):
    as_string = _create(client, system=SYSTEM)
    as_blocks = _create(client, system=[{"type": "text", "text": SYSTEM}])
    assert _text(as_blocks) == _text(as_string)
    assert as_blocks.usage.input_tokens == as_string.usage.input_tokens


def test_stream_gives_the_same_text_and_a_final_message_with_usage(client):
    whole = _create(client, system=SYSTEM)
    body = {"model": MODEL, "max_tokens": 16, "extra_body": GREEDY, "system": SYSTEM}
    with client.messages.stream(messages=[{"role": "user", "content": QUESTION}], **body) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()

    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens > 0


def test_stop_sequence_and_max_tokens(client):
    text = _text(_create(client))
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3, text

    stopped = _create(client, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert _text(stopped) == text[: text.index(stop)]
    body = {"model": MODEL, "max_tokens": 16, "extra_body": GREEDY, "stop_sequences": [stop]}
    with client.messages.stream(messages=[{"role": "user", "content": QUESTION}], **body) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, _text(streamed)) == ("stop_sequence", stop, _text(stopped))

    short = _create(client, max_tokens=3)
    assert (short.stop_reason, short.stop_sequence) == ("max_tokens", None)
    assert short.usage.output_tokens == 3


def test_forced_tool_use_whole_and_streamed_and_its_result_renders(client, chat):
    message = _create(client, max_tokens=40, tools=[WEATHER], tool_choice=FORCED)
    calls = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use"
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].input["city"] in ("Paris", "Oslo")

    body = {"model": MODEL, "max_tokens": 40, "extra_body": GREEDY, "tools": [WEATHER], "tool_choice": FORCED}
    with client.messages.stream(messages=[{"role": "user", "content": QUESTION}], **body) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        ("tool_use", "get_weather", calls[0].input)
    ]
    assert streamed.stop_reason == "tool_use"

    # The result goes back: the prompt is the chat path's for the same turns.
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [c.model_dump(include={"type", "id", "name", "input"}) for c in calls]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"}]},
    ]
    answer = _create(client, tools=[WEATHER], messages=history)
    call = {"id": calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(calls[0].input)}}
    expected = chat.chat.completions.create(
        model=MODEL,
        max_tokens=16,
        temperature=0,
        tools=[{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}],  # fmt: skip
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 C"},
        ],
    )
    assert answer.usage.input_tokens == expected.usage.prompt_tokens
    assert _text(answer) == (expected.choices[0].message.content or "")
    counted = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=history)
    assert counted.input_tokens == answer.usage.input_tokens


def test_reasoning_is_a_thinking_block_whole_and_streamed():
    # deepseek_r1 reads all text before a </think> as reasoning: with the
    # tiny model, which never writes one, the whole output is reasoning.
    config = server_config(reasoning_parser="deepseek_r1", api_key=KEY)
    with server_in_thread(create_app(config, loaded=testing.tiny_loaded())) as server:
        with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as client:
            message = _create(client, max_tokens=8)
            body = {"model": MODEL, "max_tokens": 8, "extra_body": GREEDY}
            with client.messages.stream(messages=[{"role": "user", "content": QUESTION}], **body) as stream:
                kinds = {event.delta.type for event in stream if event.type == "content_block_delta"}
                streamed = stream.get_final_message()
        with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as chat:
            answer = chat.chat.completions.create(
                model=MODEL, max_tokens=8, temperature=0, messages=[{"role": "user", "content": QUESTION}]
            )

    reasoning = answer.choices[0].message.model_extra["reasoning_content"]
    assert reasoning
    assert [(b.type, b.thinking) for b in message.content] == [("thinking", reasoning)]
    assert [(b.type, b.thinking) for b in streamed.content] == [("thinking", reasoning)]
    assert kinds == {"thinking_delta"}


def test_count_tokens_equals_the_prompt_token_count(client):
    message = _create(client, system=SYSTEM, max_tokens=2)
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == message.usage.input_tokens


def test_x_api_key_is_accepted_like_a_bearer_key(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}]}
    refused = httpx.post(server.url + "/v1/messages", json=body)
    assert refused.status_code == 401
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "authentication_error"

    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    assert httpx.post(server.url + "/v1/messages", json=body, headers=headers).status_code == 200
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError):
            _create(wrong)


def test_errors_before_the_body_is_read_take_anthropics_shape_too(server):
    too_large = httpx.post(server.url + "/v1/messages", content=b" " * (2 << 20), headers={"x-api-key": KEY})
    assert too_large.status_code == 413
    assert too_large.json()["error"]["type"] == "request_too_large"
    not_json = httpx.post(server.url + "/v1/messages/count_tokens", content=b"{nope", headers={"x-api-key": KEY})
    assert not_json.status_code == 400
    assert not_json.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        # A timeout given: the client derives none from max_tokens.
        ({"max_tokens": anthropic.omit, "timeout": 60}, "max_tokens"),
        ({"messages": [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": QUESTION}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "messages[0].content[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        ({"tools": [{"name": "has space", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"extra_body": {"temperature": -1}}, "temperature"),
    ],
)
def test_bad_input_gets_anthropics_error_naming_the_field(client, body, field):
    with pytest.raises(anthropic.BadRequestError) as caught:
        _create(client, **body)
    error = caught.value
    assert error.status_code == 400
    assert error.body["type"] == "error" and error.body["error"]["type"] == "invalid_request_error"
    assert field in error.body["error"]["message"]


def test_unknown_model_is_anthropics_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        _create(client, model="no-such-model")
    assert caught.value.body["error"]["type"] == "not_found_error"
