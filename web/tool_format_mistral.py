"""Mistral tool calls (``--tool-call-parser mistral``): after any content,
``[TOOL_CALLS]`` then either a JSON list of ``{"name", "arguments"}``
objects (Mistral 7B v0.3, Nemo, Small 3) or, from the v11 tokenizer on,
``NAME[ARGS]{...}`` for each call, each after its own ``[TOOL_CALLS]``.
The markers are special tokens: the request keeps them (web/parsers.py)."""

from __future__ import annotations

import re
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from . import tool_format
from .tool_format import CallScan, Mark, ToolScan, arguments, const, held_end, json_arguments, sequence
from .tool_format_llama3 import json_objects

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_BETWEEN = re.compile(r"\s*,?\s*")


@attrs.frozen
class MistralFormat:
    name: str = "mistral"
    special_tokens: bool = True

    def scan(self, text: str, names: Mapping[str, Any], final: bool) -> ToolScan:
        text = text.replace("</s>", "")
        first = text.find(TOOL_CALLS)
        if first < 0:
            return ToolScan(text if final else text[: held_end(text, [TOOL_CALLS])].rstrip())
        pos = first + len(TOOL_CALLS)
        rest = text[pos:].lstrip()
        if rest.startswith("["):
            calls = json_objects(text, len(text) - len(rest) + 1, names, final, _BETWEEN)
        else:
            calls = self._named_calls(text, pos, names, final)
        if final and not calls:
            return ToolScan(text)
        return ToolScan(text[:first].rstrip(), tuple(calls))

    def forced(self, functions: Sequence[Mapping[str, Any]], *, one: bool, mark: Mark, after_reasoning: bool) -> dict[str, Any]:
        """The v11 tokenizer's ``[TOOL_CALLS]NAME[ARGS]{...}`` calls where the
        vocabulary has ``[ARGS]`` as a token, else ``[TOOL_CALLS]`` and a
        JSON list of ``{"name", "arguments"}`` objects."""
        args = mark(ARGS)
        if args.get("type") == "token":
            each = [sequence(mark(TOOL_CALLS), const(f["name"]), args, arguments(f)) for f in functions]
            return tool_format.calls(each, separator="", one=one)
        each = [sequence(const(f'{{"name": {json.dumps(f["name"])}, "arguments": '), arguments(f), const("}")) for f in functions]
        return sequence(mark(TOOL_CALLS), const("["), tool_format.calls(each, separator=", ", one=one), const("]"))

    @staticmethod
    def _named_calls(text: str, pos: int, names: Mapping[str, Any], final: bool) -> list[CallScan]:
        calls = []
        while True:
            args = text.find(ARGS, pos)
            if args < 0:
                return calls
            name = text[pos:args].split(CALL_ID)[0].strip()
            arguments, end = json_arguments(text, args + len(ARGS), final)
            if name in names:
                calls.append(CallScan(name, arguments))
            if end is None:
                return calls
            pos = end + len(text[end:]) - len(text[end:].lstrip())
            if not text.startswith(TOOL_CALLS, pos):
                return calls
            pos += len(TOOL_CALLS)
