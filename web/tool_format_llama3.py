"""Llama 3.1+ JSON tool calls (``--tool-call-parser llama3_json``): the
output is a call when it begins with ``<|python_tag|>`` or ``{``: one or
more ``{"name": ..., "parameters": {...}}`` objects separated by ``;``.
Any other output is content. ``<|python_tag|>`` is a special token: the
request keeps it in its text (web/parsers.py)."""

from __future__ import annotations

import re
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from . import tool_format
from .tool_format import CallScan, Mark, ToolScan, arguments, const, json_value_end, sequence
from .tool_format_json import json_call

PYTHON_TAG = "<|python_tag|>"
ENDS = ("<|eom_id|>", "<|eot_id|>")
_BETWEEN = re.compile(r"\s*[;,]?\s*")


def json_objects(text: str, pos: int, names: Mapping[str, Any], final: bool, between: re.Pattern[str]) -> list[CallScan]:
    """The call objects from ``pos`` on, each followed by ``between``."""
    calls = []
    while pos < len(text) and text[pos] == "{":
        end = json_value_end(text, pos)
        call = json_call(text, pos, len(text) if end is None else end, names, end is not None or final)
        if call is not None:
            calls.append(call)
        if end is None:
            break
        pos = between.match(text, end).end()
    return calls


@attrs.frozen
class Llama3JsonFormat:
    name: str = "llama3_json"
    special_tokens: bool = True

    def scan(self, text: str, names: Mapping[str, Any], final: bool) -> ToolScan:
        for marker in ENDS:
            text = text.replace(marker, "")
        stripped = text.lstrip()
        start = len(text) - len(stripped)
        if stripped.startswith(PYTHON_TAG):
            start += len(PYTHON_TAG)
            start += len(text[start:]) - len(text[start:].lstrip())
        elif not stripped.startswith("{"):
            if not final and PYTHON_TAG.startswith(stripped):
                return ToolScan("")  # may be the tag, split over tokens
            return ToolScan(text)
        calls = json_objects(text, start, names, final, _BETWEEN)
        return ToolScan(text if final and not calls else "", tuple(calls))

    def forced(self, functions: Sequence[Mapping[str, Any]], *, one: bool, mark: Mark, after_reasoning: bool) -> dict[str, Any]:
        """``{"name": ..., "parameters": {...}}`` objects, ``; `` apart."""
        each = [sequence(const(f'{{"name": {json.dumps(f["name"])}, "parameters": '), arguments(f), const("}")) for f in functions]
        return tool_format.calls(each, separator="; ", one=one)
