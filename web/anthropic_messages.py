"""Anthropic's ``POST /v1/messages`` body, checked and translated into the
chat completions body that web/protocol.py parses.

The translation is the whole point: the request then takes the chat path
unchanged (the chat template, tools shown to the model, forced calls, the
tool-call and reasoning parsers), so the two APIs cannot drift apart.
Every Anthropic shape is checked here first, so an error names the field
as the client sent it (``messages[1].content[0].type``), never the chat
body's index it became.

What maps to what: ``system`` (a string or text blocks) is the first
message; a user's ``tool_result`` blocks become ``tool`` messages, each
after the ``tool_use`` it answers; an assistant's ``tool_use`` blocks its
``tool_calls``; ``thinking`` blocks in the history are dropped (as the
chat path drops past reasoning); ``tools`` are functions whose
``input_schema`` is their parameters; ``tool_choice`` ``auto``, ``any``,
``tool`` and ``none`` are ``auto``, ``required``, the named function and
``none``; ``stop_sequences`` is ``stop``; the latency objectives' extension fields
(``ttft_ms``, ``tpot_ms``, ``slo_mode``, ``slo_allow_shorter``: web/slo.py)
pass through. ``metadata`` and the other fields an inference server has
no use for are ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from .errors import InvalidRequest
from .fields import boolean
from .slo import EXTENSION_FIELDS

ROLES = ("user", "assistant")
# Blocks that only a hosted model reads: refused rather than silently dropped.
_UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "server_tool_use", "web_search_tool_result", "container_upload")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# The chat parser's names for a tool's fields, as Anthropic names them.
_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function\.(name|description|parameters)")
_ANTHROPIC_TOOL_FIELDS = {"name": "name", "description": "description", "parameters": "input_schema"}


@attrs.frozen
class MessagesBody:
    """A checked ``/v1/messages`` body: ``chat`` is the equivalent chat
    completions body, ``stop_sequences`` the stop strings (a match ends
    with ``stop_reason`` ``stop_sequence``)."""

    chat: dict[str, Any]
    stream: bool = False
    stop_sequences: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, body: dict[str, Any], *, counting: bool = False) -> MessagesBody:
        """Check ``body`` and translate it; ``counting``: a
        ``count_tokens`` body, which has no ``max_tokens``."""
        chat: dict[str, Any] = {"messages": [*_system(body.get("system")), *_messages(body.get("messages"))]}
        if body.get("model") is not None:
            chat["model"] = body["model"]
        if not counting:
            if body.get("max_tokens") is None:
                raise InvalidRequest("max_tokens: field required", param="max_tokens")
            chat["max_tokens"] = body["max_tokens"]
            for name in ("temperature", "top_p", "top_k", *EXTENSION_FIELDS):
                if body.get(name) is not None:
                    chat[name] = body[name]
        stop = _stop_sequences(body.get("stop_sequences"))
        if stop:
            chat["stop"] = list(stop)
        chat.update(_tools(body.get("tools"), body.get("tool_choice")))
        return cls(chat, boolean(body, "stream", False) if not counting else False, stop)


def anthropic_names(text: str) -> str:
    """``text`` (an error's field or message) with the chat parser's names
    of a tool's fields (``tools[0].function.parameters``) as Anthropic
    names them (``tools[0].input_schema``)."""
    return _TOOL_FIELD.sub(lambda m: f"tools[{m[1]}].{_ANTHROPIC_TOOL_FIELDS[m[2]]}", text)


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}] if value else []
    if not isinstance(value, list):
        raise InvalidRequest("system must be a string or a list of text blocks", param="system")
    texts = [_text_block(block, f"system[{i}]") for i, block in enumerate(value)]
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise InvalidRequest(f"{where}.type: expected a text block, got {kind!r}", param=f"{where}.type")
    if not isinstance(block.get("text"), str):
        raise InvalidRequest(f"{where}.text must be a string", param=f"{where}.text")
    return block["text"]


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise InvalidRequest("messages: field required", param="messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty list of messages", param="messages")
    out: list[dict[str, Any]] = []
    open_calls: set[str] = set()  # the previous assistant turn's tool_use ids not yet answered
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object with role and content", param=where)
        role = message.get("role")
        if role not in ROLES:
            hint = "; a system prompt goes in the top-level system field" if role == "system" else ""
            raise InvalidRequest(f"{where}.role must be user or assistant, got {role!r}{hint}", param=f"{where}.role")
        if i == 0 and role != "user":
            raise InvalidRequest(f"{where}.role: the first message must be a user message", param=f"{where}.role")
        if i == len(value) - 1 and role != "user":
            raise InvalidRequest(
                f"{where}.role: the last message must be a user message (prefilling an assistant reply is not supported)",
                param=f"{where}.role",
            )
        blocks = _blocks(message.get("content"), f"{where}.content")
        if role == "assistant":
            out.append(_assistant(blocks, f"{where}.content"))
            open_calls = {call["id"] for call in out[-1].get("tool_calls", ())}
        else:
            out.extend(_user(blocks, f"{where}.content", open_calls))
            open_calls = set()
    return out


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of content blocks", param=where)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise InvalidRequest(f"{where}[{j}] must be a content block with a type", param=f"{where}[{j}]")
    return content


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind, at = block["type"], f"{where}[{j}]"
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not block["id"]:
                raise InvalidRequest(f"{at}.id must be a non-empty string", param=f"{at}.id")
            if not isinstance(block.get("name"), str):
                raise InvalidRequest(f"{at}.name must be a string", param=f"{at}.name")
            if not isinstance(block.get("input"), dict):
                raise InvalidRequest(f"{at}.input must be an object", param=f"{at}.input")
            function = {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind not in ("thinking", "redacted_thinking"):
            raise _block_type(kind, f"{at}.type", "an assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[dict[str, Any]], where: str, open_calls: set[str]) -> list[dict[str, Any]]:
    """A user turn as chat messages: each ``tool_result`` a ``tool``
    message (for the ``tool_use`` it answers), text runs user messages."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind, at = block["type"], f"{where}[{j}]"
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if call_id not in open_calls:
                raise InvalidRequest(
                    f"{at}.tool_use_id: {call_id!r} answers no tool_use block of the previous assistant message",
                    param=f"{at}.tool_use_id",
                )
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": call_id, "content": _result(block, at)})
        else:
            raise _block_type(kind, f"{at}.type", "a user message")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _result(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_block(part, f"{where}.content[{k}]") for k, part in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidRequest(f"{where}.content must be a string or a list of text blocks", param=f"{where}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise InvalidRequest(f"{where}.is_error must be true or false", param=f"{where}.is_error")
    # The template has no field for it: the model reads the failure in the text.
    return f"Error: {content}" if is_error else content


def _block_type(kind: str, param: str, where: str) -> InvalidRequest:
    if kind in _UNSUPPORTED_BLOCKS:
        return InvalidRequest(f"{param}: {kind!r} blocks are not supported by this server", param=param)
    return InvalidRequest(f"{param}: {kind!r} is not a block type {where} may hold", param=param)


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise InvalidRequest("stop_sequences must be a list of non-empty strings", param="stop_sequences")
    return tuple(value)


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    """The chat body's ``tools``, ``tool_choice`` and ``parallel_tool_calls``."""
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest("tools must be a list of tools", param="tools")
        out["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    if choice is None:
        return out
    if not isinstance(choice, dict) or choice.get("type") not in (*_TOOL_CHOICES, "tool"):
        raise InvalidRequest("tool_choice.type must be auto, any, tool or none", param="tool_choice.type")
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str):
            raise InvalidRequest("tool_choice.name is required with type tool", param="tool_choice.name")
        if not any(tool["function"]["name"] == choice["name"] for tool in out.get("tools", ())):
            raise InvalidRequest(f"tool_choice.name: {choice['name']!r} is not in tools", param="tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        out["tool_choice"] = _TOOL_CHOICES[choice["type"]]
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise InvalidRequest("tool_choice.disable_parallel_tool_use must be true or false", param="tool_choice.disable_parallel_tool_use")
    if disable:
        out["parallel_tool_calls"] = False
    return out


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise InvalidRequest(f"{where} must be an object with name and input_schema", param=where)
    if tool.get("type") not in (None, "custom"):
        raise InvalidRequest(f"{where}.type: {tool['type']!r} is a server tool, not supported here", param=f"{where}.type")
    if "input_schema" not in tool:
        raise InvalidRequest(f"{where}.input_schema: field required", param=f"{where}.input_schema")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}
