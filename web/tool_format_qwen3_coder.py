"""Qwen3-Coder's XML tool calls (``--tool-call-parser qwen3_coder``):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each parameter's text becomes a JSON value by the type the tool's schema
gives it (an enum's member, spaced any way, is that member; a string stays text; integer, number, boolean, object and array
are read as such, and a value that does not read stays text). The
arguments are streamed a parameter at a time, as each one closes."""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from . import tool_format
from .tool_format import CallScan, Mark, ToolScan, arguments, const, held_end, sequence

OPEN_TAG, CLOSE_TAG, FUNCTION, PARAMETER = "<tool_call>", "</tool_call>", "<function=", "<parameter="
END_FUNCTION, END_PARAMETER = "</function>", "</parameter>"


def _type(schema: Any) -> str | None:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def convert(value: str, schema: Any) -> Any:
    """``value`` as the JSON type ``schema`` says, else as text."""
    kind = _type(schema)
    text = value.strip()
    choices = schema.get("enum") if isinstance(schema, Mapping) else None
    if isinstance(choices, list):
        # An enum's member, however the XML spaced it (a forced grammar
        # allows whitespace around a value).
        for choice in choices:
            if text == (choice if isinstance(choice, str) else json.dumps(choice)):
                return choice
    if kind == "string":
        return value
    if text == "null" and kind != "string":
        return None
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind in ("integer", "number"):
        for read in (int, float):
            try:
                return read(text)
            except ValueError:
                pass
        return value
    if kind in ("object", "array", None):
        try:
            return json.loads(text)
        except ValueError:
            pass
        if kind is not None:
            try:
                return ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                pass
    return value


@attrs.frozen
class Qwen3CoderFormat:
    name: str = "qwen3_coder"

    def scan(self, text: str, names: Mapping[str, Any], final: bool) -> ToolScan:
        found = [i for i in (text.find(OPEN_TAG), text.find(FUNCTION)) if i >= 0]
        if not found:
            return ToolScan(text if final else text[: held_end(text, [OPEN_TAG, FUNCTION])].rstrip())
        first = min(found)
        calls = []
        pos = first
        while (start := text.find(FUNCTION, pos)) >= 0:
            name_end = text.find(">", start)
            if name_end < 0:
                break
            name = text[start + len(FUNCTION) : name_end].strip()
            close = text.find(END_FUNCTION, name_end)
            body_end = len(text) if close < 0 else close
            if name in names:
                schema = names[name] if isinstance(names, Mapping) else {}
                properties = schema.get("properties", {}) if isinstance(schema, Mapping) else {}
                pairs = self._parameters(text, name_end + 1, body_end, properties, close >= 0 or final)
                arguments = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in pairs)
                calls.append(CallScan(name, arguments + ("}" if close >= 0 or final else "")))
            if close < 0:
                break
            pos = close + len(END_FUNCTION)
        if final and not calls:
            return ToolScan(text)
        return ToolScan(text[:first].rstrip(), tuple(calls))

    def forced(self, functions: Sequence[Mapping[str, Any]], *, one: bool, mark: Mark, after_reasoning: bool) -> dict[str, Any]:
        """``<tool_call>`` blocks of ``<function=NAME>`` and its
        ``<parameter=...>`` values (xgrammar's ``qwen_xml`` style), a newline apart."""
        each = [
            sequence(
                mark(OPEN_TAG),
                const(f"\n{FUNCTION}{f['name']}>\n"),
                arguments(f, "qwen_xml"),
                const(END_FUNCTION + "\n"),
                mark(CLOSE_TAG),
            )
            for f in functions
        ]
        return tool_format.calls(each, separator="\n", one=one)

    @staticmethod
    def _parameters(text: str, pos: int, end: int, properties: Any, closed: bool) -> list[tuple[str, Any]]:
        """The parameters in ``text[pos:end]`` that are complete (all when ``closed``)."""
        pairs = []
        while (start := text.find(PARAMETER, pos, end)) >= 0:
            name_end = text.find(">", start, end)
            if name_end < 0:
                break
            stops = [i for i in (text.find(END_PARAMETER, name_end, end), text.find(PARAMETER, name_end, end)) if i >= 0]
            if not stops and not closed:
                break
            stop = min(stops) if stops else end
            value = text[name_end + 1 : stop]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            name = text[start + len(PARAMETER) : name_end].strip()
            pairs.append((name, convert(value, properties.get(name) if isinstance(properties, Mapping) else None)))
            pos = stop + (len(END_PARAMETER) if text.startswith(END_PARAMETER, stop) else 0)
        return pairs
