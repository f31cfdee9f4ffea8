"""Request bodies for structured output and tools, the prompt that shows
tools to the model, and tool calls read out of its text (no model needed:
the default model's tokenizer only)."""

from __future__ import annotations

import json
import types

import pytest

from trioserve.engine.sampling.structured_output import StructuredOutput
from trioserve.testing.tiny_model import tokenizer
from trioserve.web.errors import ApiError
from trioserve.web.protocol import ChatCompletionRequest, CompletionRequest
from trioserve.web.tools import ToolChoice, parse_tool_calls, render_prompt, tool_choice

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields):
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def bad(parse, body):
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    assert info.value.to_json()["error"]["type"] == "invalid_request_error"
    return info.value.param


def test_response_format_and_structured_outputs_become_the_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    params = ChatCompletionRequest.from_json(chat(response_format=fmt)).params
    assert params.structured_output == StructuredOutput.json_schema(schema)
    assert params.structured_output.field == "response_format.json_schema.schema"
    assert ChatCompletionRequest.from_json(chat(response_format={"type": "json_object"})).params.structured_output.kind == "json_object"
    assert ChatCompletionRequest.from_json(chat(response_format={"type": "text"})).params.structured_output is None
    body = {"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}
    assert CompletionRequest.from_json(body).params.structured_output == StructuredOutput.choice(["a", "b"])
    body = {"prompt": "x", "structured_outputs": {"regex": "[0-9]+"}}
    assert CompletionRequest.from_json(body).params.structured_output == StructuredOutput.regex("[0-9]+")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}}}, "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
        ({"structured_outputs": {"grammar": "root ::= \"a\""}, "response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"messages": [{"role": "tool", "content": "12C"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
    ],
)
def test_bad_fields_are_named(fields, param):
    assert bad(ChatCompletionRequest.from_json, chat(**fields)) == param


def test_required_and_named_tool_choices_constrain_the_output():
    required = ChatCompletionRequest.from_json(chat(tools=[WEATHER, TIME], tool_choice="required"))
    schema = json.loads(required.params.structured_output.spec)
    assert [option["properties"]["name"] for option in schema["anyOf"]] == [{"enum": ["get_weather"]}, {"enum": ["get_time"]}]
    named = ChatCompletionRequest.from_json(
        chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert json.loads(named.params.structured_output.spec) == WEATHER["function"]["parameters"]
    auto = ChatCompletionRequest.from_json(chat(tools=[WEATHER]))
    assert auto.tools.mode == "auto" and auto.params.structured_output is None
    assert ChatCompletionRequest.from_json(chat(tools=[WEATHER], tool_choice="none")).tools is None


def test_tools_and_tool_history_reach_the_default_models_prompt():
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12C and rain"},
    ]
    request = ChatCompletionRequest.from_json({"messages": history, "tools": [WEATHER]})
    assert request.renders_tools
    ids, text = render_prompt(tokenizer(), request.engine_prompt, request.tools)
    assert tokenizer().decode(ids) == text
    assert '"name": "get_weather"' in text and "The weather in a city" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n12C and rain\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_without_tool_support_is_refused_naming_tools():
    plain = types.SimpleNamespace(chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    tools = tool_choice(chat(tools=[WEATHER]))
    with pytest.raises(ApiError) as info:
        render_prompt(plain, [{"role": "user", "content": "hi"}], tools)
    assert info.value.status == 400 and info.value.param == "tools"


def _tools(mode="auto", name=None):
    return tool_choice(chat(tools=[WEATHER, TIME], tool_choice=mode if name is None else {"type": "function", "function": {"name": name}}))


def test_hermes_tool_calls_are_parsed_with_ids_and_json_arguments():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, _tools())
    assert content == "Let me look."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Oslo"}),
        ("function", "get_time", {}),
    ]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    # Unknown names and broken JSON are text, not calls.
    assert parse_tool_calls('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', _tools())[1] == []
    assert parse_tool_calls("<tool_call>{oops</tool_call>", _tools()) == ("<tool_call>{oops</tool_call>", [])
    assert parse_tool_calls("just text", _tools()) == ("just text", [])
    # A call the model did not close before EOS still counts.
    assert parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {}}', _tools())[1][0]["function"]["name"] == "get_time"


def test_required_and_named_outputs_parse_as_one_call():
    _, calls = parse_tool_calls('{"name": "get_time", "arguments": {}}', _tools("required"))
    assert calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    _, calls = parse_tool_calls('{"city": "Rome"}', _tools(name="get_weather"))
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_tool_choice_none_offers_no_tools():
    assert tool_choice(chat(tools=[WEATHER], tool_choice="none")) is None
    assert isinstance(tool_choice(chat(tools=[WEATHER])), ToolChoice)
