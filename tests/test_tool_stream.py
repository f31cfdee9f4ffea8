"""Streamed tool calls (web/tool_stream.py): a call's first delta carries
its index, id, type and name, the next ones pieces of its arguments as they
are generated; however the text is cut into deltas, what the deltas
assemble to is what the whole-body parser reads. Then the official openai
client, over a real loopback server on the tiny model, assembles them."""

from __future__ import annotations

import json

import jsonschema
import openai
from hypothesis import given, settings
from hypothesis import strategies as st

from server_fixtures import MODEL, serving
from trioserve import testing
from trioserve.web.app import create_app
from trioserve.web.settings import ServerConfig
from trioserve.web.tool_stream import StreamedCalls
from trioserve.web.tools import parse_tool_calls, tool_choice

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _tools(mode):
    return tool_choice({"messages": [], "tools": [WEATHER, TIME], "tool_choice": mode})


def _assemble(pieces):
    """Content and calls as the openai client accumulates deltas: the first
    delta of an index sets id, type and name; arguments are concatenated."""
    content, calls = "", {}
    for piece in pieces:
        content += piece.content
        for delta in piece.tool_calls:
            call = calls.setdefault(delta["index"], {"arguments": ""})
            if "id" in delta:
                assert "id" not in call, "a call's id came twice"
                call.update(id=delta["id"], type=delta["type"], name=delta["function"]["name"])
            call["arguments"] += delta["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def _stream(text, mode, cuts):
    stream = StreamedCalls(_tools(mode))
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    pieces.append(stream.finish())
    return pieces, stream.num_calls


TEXTS = [
    ("auto", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os\\"lo}"}}\n</tool_call>\n'
             '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'),
    ("auto", "No call here, only <b>text</b> and a < sign."),
    ("auto", 'Hm <tool_call>{"arguments": {"zone": "cet"}, "name": "get_time"}</tool_call>'),  # held, then whole
    ("auto", 'x <tool_call>{"name": "rm", "arguments": {}}</tool_call>'),  # unknown name: text
    ("auto", '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}'),  # left open at the end
    ("auto", "<tool_call>{oops</tool_call>"),
    ("required", '{"name": "get_weather", "arguments": {"city": "Lima"}}'),
    ("required", '{"name": "get_time", "arguments": {"zone": "cet"}}'),
    ("named", '{"city": "Rome"}'),
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(1, 200), max_size=12))
def test_streamed_deltas_assemble_to_what_the_whole_body_parser_reads(case, cuts):
    mode, text = case
    if mode == "named":
        mode = NAMED
    pieces, num_calls = _stream(text, mode, [c for c in cuts if c < len(text)])
    content, calls = _assemble(pieces)
    expected_content, expected = parse_tool_calls(text, _tools(mode))
    assert content.strip() == (expected_content or "").strip()
    assert num_calls == len(calls) == len(expected)
    for call, want in zip(calls, expected):
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["name"] == want["function"]["name"]
        assert json.loads(call["arguments"]) == json.loads(want["function"]["arguments"])


def test_the_name_goes_first_and_the_arguments_as_they_are_generated():
    text = '{"name": "get_weather", "arguments": {"city": "Lima"}}'
    pieces, _ = _stream(text, "required", range(1, len(text)))  # one character a delta
    deltas = [d for p in pieces for d in p.tool_calls]
    first, rest = deltas[0], deltas[1:]
    assert first["index"] == 0 and first["type"] == "function" and first["function"] == {"name": "get_weather", "arguments": ""}
    assert len(rest) == len('{"city": "Lima"}') and all(set(d) == {"index", "function"} for d in rest)
    # Held back: only the opening up to the arguments; the object's own "}" never goes.
    sent_by = next(i for i, p in enumerate(pieces) if p.tool_calls)
    assert sent_by == text.index('"arguments":') + len('"arguments":') - 1
    auto = StreamedCalls(_tools("auto"))
    assert auto.feed("Sure. <tool").content == "Sure."
    assert auto.feed('_call>{"name": "get_ti') == auto.feed("")  # nothing yet
    opening, arguments = auto.feed('me", "arguments": {"zo').tool_calls
    assert opening["function"] == {"name": "get_time", "arguments": ""} and arguments["function"] == {"arguments": '{"zo'}
    rest = auto.feed('ne": "utc"}}</tool_call> and then')
    assert [d["function"] for d in rest.tool_calls] == [{"arguments": 'ne": "utc"}'}] and rest.content == ""
    assert auto.finish().content == "" and auto.num_calls == 1


def _app():
    # The model's whole context: the tools' prompt and a Hermes call in it.
    engine = testing.engine_config(max_model_len=512, max_num_batched_tokens=512)
    return create_app(ServerConfig(engine=engine, shutdown_timeout=5.0), loaded=testing.tiny_loaded())


async def test_the_official_client_assembles_streamed_calls():
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    async with serving(_app()) as server:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            for choice in ("required", NAMED):
                # The stream helper's final completion.
                # One call: a tiny model would otherwise go on calling to max_tokens.
                async with client.chat.completions.stream(
                    model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=80, temperature=0,
                    parallel_tool_calls=False,
                ) as events:
                    completion = await events.get_final_completion()
                (call,) = completion.choices[0].message.tool_calls
                assert completion.choices[0].finish_reason == "tool_calls"
                schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
                jsonschema.validate(json.loads(call.function.arguments), schema)
                # Accumulated by hand from the raw chunks, as the client's docs show.
                stream = await client.chat.completions.create(
                    model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=80,
                    temperature=0, stream=True, parallel_tool_calls=False,
                )  # fmt: skip
                deltas = [d async for chunk in stream for c in chunk.choices for d in (c.delta.tool_calls or ())]
                assert deltas[0].id.startswith("call_") and deltas[0].function.name == call.function.name
                assert all(d.id is None and d.function.name is None for d in deltas[1:])
                assert len(deltas) > 2  # the arguments came in pieces
                arguments = "".join(d.function.arguments or "" for d in deltas)
                assert json.loads(arguments) == json.loads(call.function.arguments)
