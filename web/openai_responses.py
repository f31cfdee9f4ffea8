"""OpenAI's ``POST /v1/responses`` body, checked and translated into the
chat completions body that web/protocol.py parses.

As for Anthropic's Messages API (web/anthropic_messages.py), the
translation is the point: the request then takes the chat path unchanged
(the chat template, tools shown to the model, forced calls, the tool-call
and reasoning parsers). Each Responses shape is checked here first, so an
error names the field as the client sent it (``input[2].type``).

The input is a string (one user message) or a list of items, first read
into canonical items (``message`` with its text, ``function_call``,
``function_call_output``), which a stored response keeps
(web/responses_store.py) and a request with ``previous_response_id``
starts from. Then the chat messages: ``instructions`` is the first
system message (never carried over from a previous response, as
OpenAI's is not); a ``developer`` message is a system one; a
``function_call`` joins the assistant message before it as one of its
``tool_calls``; a ``function_call_output`` is a ``tool`` message, and
must answer a call made earlier in the conversation. ``reasoning`` items
are accepted and left out of the prompt, as the chat path leaves out past
reasoning.

Other fields: ``tools`` (functions: ``name``, ``description``,
``parameters``, ``strict``) and ``tool_choice``; ``text.format`` is the
chat ``response_format``; ``max_output_tokens`` is ``max_tokens``;
``temperature`` and ``top_p`` as in chat; vLLM's sampling extras
(``top_k``, ``seed``, ``stop``, ``logits_processors``, ...),
``structured_outputs``, ``chat_template_kwargs`` and the latency
objectives' extension fields (web/slo.py) pass through.
``metadata``, ``user`` and ``reasoning`` are echoed (the model's
template decides whether it reasons), ``include`` is accepted and not
read (the reasoning is always in the output). What cannot be honoured is
refused: ``background``, ``conversation``, ``prompt``, ``truncation``
``auto``, ``top_logprobs``, tools that are not functions, and input that
is not text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import attrs

from .errors import InvalidRequest
from .fields import boolean, metadata, string
from .json_body import require_object
from .protocol import SAMPLING_FIELDS
from .responses_store import StoredResponse
from .slo import EXTENSION_FIELDS

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
# Known items and parts that only a hosted model's tools produce or read:
# refused as unsupported rather than as unknown.
_UNSUPPORTED_ITEMS = (
    "item_reference", "file_search_call", "web_search_call", "computer_call", "computer_call_output",
    "image_generation_call", "code_interpreter_call", "local_shell_call", "local_shell_call_output",
    "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "mcp_call", "custom_tool_call",
    "custom_tool_call_output", "shell_call", "shell_call_output", "compaction",
)  # fmt: skip
_UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")
# Fields of OpenAI's body this server cannot honour, and why.
_REFUSED = {
    "background": "background responses are not supported: send background false and wait for the answer",
    "conversation": "conversations are not supported: continue a response with previous_response_id",
    "prompt": "prompt templates are not supported: send the input itself",
    "top_logprobs": "logprobs are not supported on /v1/responses: use /v1/chat/completions",
}
# vLLM's extra sampling fields that pass through to the chat body as
# they are (``n`` is not one: a response has one output).
_PASSED = tuple(name for name in SAMPLING_FIELDS if name not in ("n", "temperature", "top_p", "max_tokens"))
# The chat parser's names, as the Responses body names those fields.
_CHAT_NAMES = (
    (re.compile(r"tools\[(\d+)\]\.function\.(name|description|parameters)"), r"tools[\1].\2"),
    (re.compile(r"response_format\.json_schema\.(schema|name|strict)"), r"text.format.\1"),
    (re.compile(r"response_format(\.type)?"), r"text.format\1"),
    (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bmessages(\[\d+\])?(\.\w+)*"), "input"),
    (re.compile(r"\bprompt\b"), "input"),
)


@attrs.frozen
class ResponsesBody:
    """A checked ``/v1/responses`` body. ``chat`` is the equivalent chat
    completions body; ``items`` the input's canonical items after those of
    the previous response's conversation (``conversation``); ``echo`` the
    request's fields the response object repeats."""

    chat: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    echo: dict[str, Any]
    stream: bool = False
    store: bool = True

    @classmethod
    def from_json(cls, body: Any, previous: StoredResponse | None = None) -> ResponsesBody:
        """Check ``body`` and translate it; ``previous``: the stored
        response its ``previous_response_id`` names."""
        body = require_object(body)
        for name, why in _REFUSED.items():
            if body.get(name) not in (None, False):
                raise InvalidRequest(f"{name}: {why}", param=name)
        if body.get("truncation") not in (None, "disabled"):
            why = "only 'disabled' is supported (an input too long is refused)"
            raise InvalidRequest(f"truncation: {why}", param="truncation")
        instructions = string(body, "instructions", None)
        earlier = previous.conversation if previous is not None else ()
        items = input_items(body.get("input"), earlier)
        conversation = (*earlier, *items)
        chat: dict[str, Any] = {"messages": chat_messages(conversation, instructions)}
        passed = ("model", "temperature", "top_p", "priority", "chat_template_kwargs", "structured_outputs", *_PASSED)
        for name in (*passed, *EXTENSION_FIELDS):
            if body.get(name) is not None:
                chat[name] = body[name]
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        tools = _tools(body.get("tools"))
        if tools:
            chat["tools"] = [_chat_tool(tool) for tool in tools]
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        parallel = boolean(body, "parallel_tool_calls", True)
        if not parallel:
            chat["parallel_tool_calls"] = False
        text = _text(body.get("text"))
        if text["format"]["type"] != "text":
            chat["response_format"] = _response_format(text["format"])
        echo = {
            "instructions": instructions,
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata(body.get("metadata")) or {},
            "parallel_tool_calls": parallel,
            "previous_response_id": previous.id if previous is not None else None,
            "reasoning": _reasoning(body.get("reasoning")),
            "text": text,
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": tools,
            "truncation": "disabled",
            "user": string(body, "user", None),
        }
        return cls(chat, conversation, echo, boolean(body, "stream", False), boolean(body, "store", True))


def responses_names(text: str) -> str:
    """``text`` (an error's field or message) with the chat body's names
    for fields (``tools[0].function.parameters``, ``max_tokens``) as the
    Responses body names them (``tools[0].parameters``, ``max_output_tokens``)."""
    for pattern, name in _CHAT_NAMES:
        text = pattern.sub(name, text)
    return text


# -- input ---------------------------------------------------------------------


def input_items(value: Any, earlier: tuple[dict[str, Any], ...] = ()) -> list[dict[str, Any]]:
    """The body's ``input`` as canonical items; ``earlier``: the items of
    the conversation it continues (their calls may be answered here)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if value is None and earlier:
        return []
    if not isinstance(value, list) or not (value or earlier):
        raise InvalidRequest("input must be a string or a non-empty list of items", param="input")
    calls = {item["call_id"] for item in earlier if item["type"] == "function_call"}
    items = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an item object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            items.append(_message(item, where))
        elif kind == "function_call":
            items.append(_function_call(item, where))
            calls.add(items[-1]["call_id"])
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in calls:
                raise InvalidRequest(
                    f"{where}.call_id: no function_call with call_id {call_id!r} comes before this output",
                    param=f"{where}.call_id",
                )
            output = _text_parts(item.get("output"), f"{where}.output")
            items.append({"type": "function_call_output", "call_id": call_id, "output": output})
        elif kind == "reasoning":
            _reasoning_item(item, where)  # checked, then left out of the prompt
        elif kind in _UNSUPPORTED_ITEMS:
            raise InvalidRequest(f"{where}.type: {kind!r} items are not supported by this server", param=f"{where}.type")
        else:
            raise InvalidRequest(
                f"{where}.type: {kind!r} is not an item type; expected message, function_call, "
                "function_call_output or reasoning",
                param=f"{where}.type",
            )
    return items


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{where}.role")
    return {"type": "message", "role": role, "content": _text_parts(item.get("content"), f"{where}.content")}


def _text_parts(content: Any, where: str) -> str:
    """A string, or a list of text parts joined as the chat path joins
    them (so templates see the same text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _UNSUPPORTED_PARTS:
            why = "parts are not supported by this server (text only)"
            raise InvalidRequest(f"{at}.type: {kind!r} {why}", param=f"{at}.type")
        if kind not in TEXT_PARTS:
            raise InvalidRequest(f"{at}.type must be input_text or output_text; got {kind!r}", param=f"{at}.type")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{at}.text must be a string", param=f"{at}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str) or (name != "arguments" and not item[name]):
            raise InvalidRequest(f"{where}.{name} must be a non-empty string", param=f"{where}.{name}")
    try:
        arguments = json.loads(item["arguments"] or "{}")
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.arguments must be a JSON object as text", param=f"{where}.arguments")
    return {"type": "function_call", "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}


def _reasoning_item(item: dict[str, Any], where: str) -> None:
    summary = item.get("summary", [])
    if not isinstance(summary, list):
        raise InvalidRequest(f"{where}.summary must be a list", param=f"{where}.summary")
    content = item.get("content")
    if content is not None and not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a list", param=f"{where}.content")


def chat_messages(conversation: Sequence[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of canonical ``conversation`` items, after
    ``instructions`` as a system message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in conversation:
        if item["type"] == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item["content"]})
        elif item["type"] == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            call = {"id": item["call_id"], "type": "function", "function": function}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def output_conversation(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as canonical items (its reasoning left
    out, as in ``input_items``)."""
    items: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            items.append({"type": "message", "role": "assistant", "content": text})
        elif item["type"] == "function_call":
            items.append({key: item[key] for key in ("type", "call_id", "name", "arguments")})
    return items


# -- tools, text format, metadata ----------------------------------------------


def _tools(value: Any) -> list[dict[str, Any]]:
    """The body's function tools, as the response echoes them."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest("tools must be a list of function tools", param="tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"{where} must be a function tool object", param=where)
        if tool.get("type") != "function":
            raise InvalidRequest(
                f"{where}.type: {tool.get('type')!r} tools are not supported by this server (function only)",
                param=f"{where}.type",
            )
        strict = tool.get("strict", True)
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest(f"{where}.strict must be true or false", param=f"{where}.strict")
        tools.append(
            {
                "type": "function",
                "name": tool.get("name"),
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": strict is not False,
            }
        )
    return tools


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool["parameters"]}
    if tool["description"] is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        if not isinstance(value.get("name"), str):
            raise InvalidRequest("tool_choice.name is required with type function", param="tool_choice.name")
        return {"type": "function", "function": {"name": value["name"]}}
    raise InvalidRequest(
        "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}", param="tool_choice"
    )


def _text(value: Any) -> dict[str, Any]:
    """The body's ``text`` as the response echoes it (``format`` defaults to text)."""
    if value is None:
        return {"format": {"type": "text"}}
    if not isinstance(value, dict):
        raise InvalidRequest("text must be an object", param="text")
    fmt = value.get("format", {"type": "text"})
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_schema", "json_object"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise InvalidRequest(
            f"text.format.type must be text, json_schema or json_object, got {kind!r}", param="text.format.type"
        )
    return {**value, "format": fmt}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _reasoning(value: Any) -> dict[str, Any]:
    if value is None:
        return {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise InvalidRequest("reasoning must be an object", param="reasoning")
    return {"effort": value.get("effort"), "summary": value.get("summary")}
