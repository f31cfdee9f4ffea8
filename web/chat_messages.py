"""Chat messages in request bodies (``messages`` of ``POST
/v1/chat/completions`` and ``POST /tokenize``), read into ``ChatMessage``
values: each message's role, its content flattened to text, an assistant's
tool calls and a tool result's call id. Each wrong shape is a 400 naming
the message's field; whether the list may be empty is the engine's rule
(``as_prompt``)."""

from __future__ import annotations

import json
from typing import Any

import attrs

from .errors import InvalidRequest

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@attrs.frozen
class ChatMessage:
    """One chat message with its content flattened to text; an assistant's
    ``tool_calls`` (arguments decoded to objects, as chat templates take
    them) and a tool result's ``tool_call_id``."""

    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def chat_messages(body: dict[str, Any], name: str = "messages") -> tuple[ChatMessage, ...]:
    """The body's ``name`` field: a list of chat messages."""
    value = body.get(name)
    if value is None:
        raise InvalidRequest(f"{name} is required", param=name)
    if not isinstance(value, list):
        raise InvalidRequest(f"{name} must be a list of messages", param=name)
    messages = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object with role and content", param=where)
        role = item.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}", param=f"{where}.role")
        content = item.get("content")
        if content is None and role == "assistant":
            content = ""
        tool_calls = _tool_calls(item.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else ()
        tool_call_id = item.get("tool_call_id")
        if role == "tool" and not isinstance(tool_call_id, str):
            raise InvalidRequest(f"{where}.tool_call_id is required for a tool message", param=f"{where}.tool_call_id")
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        role = "system" if role == "developer" else role
        messages.append(ChatMessage(role, _content(content, f"{where}.content"), tool_calls, tool_call_id if role == "tool" else None))
    return tuple(messages)


def _tool_calls(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest(f"{where} must be a list", param=where)
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{where}[{i}] must be {{'type': 'function', 'function': {{name, arguments}}}}", param=f"{where}[{i}]")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise InvalidRequest(f"{where}[{i}].function.arguments must be JSON", param=f"{where}[{i}].function.arguments") from None
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return tuple(calls)


def _content(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"{param} parts must be {{'type': 'text', 'text': str}}; got a {kind!r} part", param=param)
            texts.append(part["text"])
        # vLLM joins text parts with newlines too, so templates see the same text.
        return "\n".join(texts)
    raise InvalidRequest(f"{param} must be a string or a list of text parts", param=param)
