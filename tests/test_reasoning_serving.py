"""Reasoning and a non-Hermes tool format end to end: a real loopback
server on the tiny model, told to read Qwen3 reasoning and Mistral calls,
its output forced by a regex to what such a model writes; the official
openai client sees ``reasoning_content`` and ``tool_calls``, whole and
streamed. And ``chat_template_kwargs`` is checked at the edge."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from server_fixtures import MODEL, serving
from trioserve import testing
from trioserve.web.app import create_app
from trioserve.web.settings import ServerConfig

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
OUTPUT = '<think>Oslo, then.</think>\n\nSure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'


def _app():
    config = ServerConfig(
        engine=testing.engine_config(), shutdown_timeout=5.0, reasoning_parser="qwen3", tool_call_parser="mistral"
    )
    return create_app(config, loaded=testing.tiny_loaded())


def test_bad_parser_names_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="qwen")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="hermes2")


async def test_reasoning_and_mistral_calls_through_the_official_client():
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        max_tokens=80,
        temperature=0,
        extra_body={"structured_outputs": {"regex": re.escape(OUTPUT)}, "chat_template_kwargs": {"enable_thinking": True}},
    )
    async with serving(_app()) as server:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            completion = await client.chat.completions.create(**request)
            (choice,) = completion.choices
            assert choice.message.reasoning_content == "Oslo, then."
            assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}

            stream = await client.chat.completions.create(**request, stream=True)
            reasoning, content, calls, finish = "", "", [], None
            async for chunk in stream:
                for c in chunk.choices:
                    reasoning += getattr(c.delta, "reasoning_content", None) or ""
                    content += c.delta.content or ""
                    calls += c.delta.tool_calls or []
                    finish = c.finish_reason or finish
            assert reasoning == "Oslo, then." and content == "Sure." and finish == "tool_calls"
            assert calls[0].function.name == "get_weather"
            assert json.loads("".join(d.function.arguments or "" for d in calls)) == {"city": "Oslo"}

        async with httpx.AsyncClient(base_url=server.url) as http:
            for value, param in ((["x"], "chat_template_kwargs"), ({"messages": []}, "chat_template_kwargs.messages")):
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": value}
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 400 and response.json()["error"]["param"] == param
