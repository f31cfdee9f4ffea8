"""Tool calls written as JSON objects: Hermes' ``<tool_call>`` blocks
(Qwen2.5, Qwen3, NousResearch Hermes, the default ChatML template), and
the bare JSON that ``tool_choice`` ``required`` and a named function
constrain the output to when no model format is at hand (web/tools.py's
``ToolChoice.constraint``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from . import tool_format
from .tool_format import JSON_OPENING, CallScan, Mark, ToolScan, arguments, const, held_end, json_arguments, json_name, sequence

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


def _whole_call(text: str, names: Mapping[str, Any]) -> CallScan | None:
    """A complete ``{"name", "arguments"}`` object written in any key order."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return CallScan(value["name"], json.dumps(arguments, ensure_ascii=False))


def json_call(text: str, start: int, end: int, names: Mapping[str, Any], complete: bool) -> CallScan | None:
    """The call in ``text[start:end]``: its name and its arguments as they
    are written once the opening is (``{"name": ..., "arguments": ``); a
    call written another way only once ``complete``."""
    body = text[:end]
    match = JSON_OPENING.match(body, start)
    if match is not None:
        name = json_name(match.group(1))
        if name in names:
            arguments, _ = json_arguments(body, match.end(), complete)
            return CallScan(name, arguments)
        return None
    return _whole_call(body[start:], names) if complete else None


@attrs.frozen
class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks,
    after any content; text between and after the calls is not content."""

    name: str = "hermes"
    open_tag: str = OPEN_TAG
    close_tag: str = CLOSE_TAG

    def scan(self, text: str, names: Mapping[str, Any], final: bool) -> ToolScan:
        first = text.find(self.open_tag)
        if first < 0:
            # Trailing whitespace waits too: before a call it is not content.
            return ToolScan(text if final else text[: held_end(text, [self.open_tag])].rstrip())
        calls = []
        pos = first
        while pos >= 0:
            start = pos + len(self.open_tag)
            close = text.find(self.close_tag, start)
            complete = close >= 0 or final
            call = json_call(text, start, len(text) if close < 0 else close, names, complete)
            if call is not None:
                calls.append(call)
            if close < 0:
                break
            pos = text.find(self.open_tag, close + len(self.close_tag))
        if final and not calls:
            return ToolScan(text)
        return ToolScan(text[:first].rstrip(), tuple(calls))

    def forced(self, functions: Sequence[Mapping[str, Any]], *, one: bool, mark: Mark, after_reasoning: bool) -> dict[str, Any]:
        """``<tool_call>`` blocks of ``functions``' calls, a newline apart."""
        each = [
            sequence(
                mark(self.open_tag),
                const(f'\n{{"name": {json.dumps(f["name"])}, "arguments": '),
                arguments(f),
                const("}\n"),
                mark(self.close_tag),
            )
            for f in functions
        ]
        return tool_format.calls(each, separator="\n", one=one)


@attrs.frozen
class RequiredFormat:
    """``tool_choice: required``: the output is one ``{"name", "arguments"}`` object."""

    name: str = "required"

    def scan(self, text: str, names: Mapping[str, Any], final: bool) -> ToolScan:
        call = json_call(text, 0, len(text), names, final)
        if call is None:
            return ToolScan(text if final else "")
        return ToolScan("", (call,))


@attrs.frozen
class NamedFormat:
    """A named ``tool_choice``: the output is that function's arguments."""

    function: str
    name: str = "named"

    def scan(self, text: str, names: Mapping[str, Any], final: bool) -> ToolScan:
        arguments, _ = json_arguments(text, 0, final)
        return ToolScan("", (CallScan(self.function, arguments),))
