"""Reasoning and a non-Hermes tool format end to end: a real loopback
server on the tiny model, told to read Qwen3 reasoning and Mistral calls,
its output forced to what such a model writes: the reasoning by a scripted
token path (tests/scripted_tokens.py), the rest by the request's own
structured output, which applies only after ``</think>``. The official
openai client sees ``reasoning_content``, an answer valid against its
schema, and ``tool_calls``, whole and streamed. And
``chat_template_kwargs`` is checked at the edge."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from jsonschema import validate
from scripted_tokens import script, scripted_plugin
from server_fixtures import MODEL, serving
from trioserve import testing
from trioserve.web.app import create_app
from trioserve.web.settings import ServerConfig

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
# The reasoning is scripted; the answer comes from the structured output.
THINKING = ("<think>Oslo, then.", "</think>")
ANSWER = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
SCHEMA = {"type": "object", "properties": {"rain": {"type": "boolean"}, "city": {"enum": ["Oslo", "Rome"]}},
          "required": ["rain", "city"], "additionalProperties": False}  # fmt: skip


@pytest.fixture
def app(monkeypatch):
    scripted_plugin(monkeypatch)
    config = ServerConfig(
        engine=testing.engine_config(plugins=("scripted",)),
        shutdown_timeout=5.0,
        reasoning_parser="qwen3",
        tool_call_parser="mistral",
    )
    return create_app(config, loaded=testing.tiny_loaded())


def _thinking():
    return script(testing.tiny_loaded().tokenizer, *THINKING)


async def _streamed(client, request):
    stream = await client.chat.completions.create(**request, stream=True)
    reasoning, content, calls, finish = "", "", [], None
    async for chunk in stream:
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    return reasoning, content, calls, finish


def test_bad_parser_names_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="qwen")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="hermes2")


async def test_reasoning_and_mistral_calls_through_the_official_client(app):
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        max_tokens=80,
        temperature=0,
        extra_body={
            "structured_outputs": {"regex": re.escape(ANSWER)},
            "chat_template_kwargs": {"enable_thinking": True},
            "logits_processors": [_thinking()],
        },
    )
    async with serving(app) as server:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            completion = await client.chat.completions.create(**request)
            (choice,) = completion.choices
            assert choice.message.reasoning_content == "Oslo, then."
            assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}

            reasoning, content, calls, finish = await _streamed(client, request)
            assert reasoning == "Oslo, then." and content == "Sure." and finish == "tool_calls"
            assert calls[0].function.name == "get_weather"
            assert json.loads("".join(d.function.arguments or "" for d in calls)) == {"city": "Oslo"}

        async with httpx.AsyncClient(base_url=server.url) as http:
            for value, param in ((["x"], "chat_template_kwargs"), ({"messages": []}, "chat_template_kwargs.messages")):
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": value}
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 400 and response.json()["error"]["param"] == param


async def test_the_schema_applies_to_the_answer_after_the_reasoning(app):
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Will it rain in Oslo?"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "rain", "schema": SCHEMA}},
        extra_body={"logits_processors": [_thinking()]},
    )
    async with serving(app) as server:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            completion = await client.chat.completions.create(**request)
            (choice,) = completion.choices
            assert choice.finish_reason == "stop"
            assert choice.message.reasoning_content == "Oslo, then."
            validate(json.loads(choice.message.content), SCHEMA)

            reasoning, content, _, finish = await _streamed(client, request)
            assert (reasoning, content, finish) == ("Oslo, then.", choice.message.content, "stop")



async def test_a_required_call_comes_after_the_reasoning_in_the_models_format(app):
    rain = {"type": "function", "function": {"name": "will_it_rain", "parameters": SCHEMA}}
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Will it rain in Oslo?"}],
        tools=[rain],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
        extra_body={"logits_processors": [_thinking()]},
    )
    async with serving(app) as server:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            completion = await client.chat.completions.create(**request)
            (choice,) = completion.choices
            assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Oslo, then."
            (call,) = choice.message.tool_calls
            assert call.function.name == "will_it_rain"
            validate(json.loads(call.function.arguments), SCHEMA)

            reasoning, _, calls, finish = await _streamed(client, request)
            assert (reasoning, finish) == ("Oslo, then.", "tool_calls")
            assert json.loads("".join(d.function.arguments or "" for d in calls)) == json.loads(call.function.arguments)
