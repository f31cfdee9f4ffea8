"""What every tool-call format shares: the scan a format makes of a
model's text, and the pieces of text reading that formats reuse.

A format (web/tool_format_*.py, web/harmony.py) reads a choice's text with
``scan(text, names, final)`` into a ``ToolScan``: the content (text that is
not a call) and the calls, each its function's name and its arguments'
JSON text as far as it is written. Scans of a growing text only grow:
content and each call's arguments extend what an earlier scan gave, and
calls are only appended. That one rule lets web/tool_stream.py stream any
format by sending what each scan adds, and makes the streamed deltas
assemble to what the whole-body parser (web/tools.py) reads, which is the
scan of the whole text with ``final`` set (then nothing is held back).

A call appears once its name is known and is one of ``names``; its
arguments are the raw text the model wrote (JSON formats) or built from
the format's own syntax (Qwen3-Coder's XML), checked only by the
whole-body parser.

A format that can force calls (``tool_choice`` ``required`` or a named
function) also has ``forced(functions, one=..., mark=..., after_reasoning=...)``:
xgrammar's structural-tag format (a dict) for one or more calls written
in its own syntax, each call's arguments constrained by its function's
schema. ``mark(text)`` is a marker's element: the token itself where the
model's vocabulary has it as one token (``<tool_call>``, harmony's
``<|channel|>``), else its text. The builders below are the pieces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs


@attrs.frozen
class CallScan:
    """A call as far as it is written: the function and its arguments' JSON text."""

    name: str
    arguments: str


@attrs.frozen
class ToolScan:
    """A text read by a format: its content and its calls, in order."""

    content: str
    calls: tuple[CallScan, ...] = ()


class ToolFormat(Protocol):
    """How one model family writes tool calls."""

    name: str

    def scan(self, text: str, names: Mapping[str, Any], final: bool) -> ToolScan:
        """``text`` read into content and calls (see the module docstring);
        ``names``: the offered functions' parameter schemas by name;
        ``final``: the text is complete, hold nothing back. A final scan
        with no calls has all the text's content."""
        ...


# A JSON call object's opening, up to where its arguments' value starts:
# {"name": "...", "arguments": (or "parameters", Llama 3's key).
JSON_OPENING = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that begins at ``start`` (after
    whitespace), or None if it is not complete yet. Strings and nesting are
    followed; the value is not checked."""
    depth, in_string, escaped, scalar, started = 0, False, False, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif scalar:
            if ch in ",}] \t\r\n<;[":
                return i
        elif ch == '"':
            in_string = started = True
        elif ch in "{[":
            depth += 1
            started = True
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1
        elif not started and not ch.isspace():
            scalar = started = True
    return None


def json_arguments(text: str, start: int, final: bool) -> tuple[str, int | None]:
    """The arguments' JSON text starting at ``start`` (leading whitespace
    left out) and the index past its end, None while it goes on."""
    while start < len(text) and text[start].isspace():
        start += 1
    end = json_value_end(text, start)
    return text[start : len(text) if end is None else end], end


def held_end(text: str, markers: Iterable[str], start: int = 0) -> int:
    """The end of ``text``, less a tail (from ``start`` on) that could be
    the beginning of one of ``markers`` split over tokens."""
    best = len(text)
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
            if marker.startswith(text[len(text) - size :]):
                best = min(best, len(text) - size)
                break
    return best


def json_name(escaped: str) -> str | None:
    """A JSON string's text from between its quotes, or None if malformed."""
    try:
        value = json.loads(f'"{escaped}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


# -- forcing calls: pieces of xgrammar's structural-tag format --------------

Mark = Callable[[str], dict[str, Any]]


def const(text: str) -> dict[str, Any]:
    """Exactly ``text``, however it is cut into tokens."""
    return {"type": "const_string", "value": text}


def arguments(function: Mapping[str, Any], style: str = "json") -> dict[str, Any]:
    """The arguments of ``function``, valid against its parameters' schema;
    ``style`` ``json`` or ``qwen_xml`` (``<parameter=NAME>value</parameter>``).
    Runs of whitespace between values are bounded, so that a weak model
    cannot pad its call until ``max_tokens``."""
    return {"type": "json_schema", "json_schema": function["parameters"], "style": style, "max_whitespace_cnt": 2}


def sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    """``elements`` one after the other."""
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": list(elements)}


def one_of(elements: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Any one of ``elements``."""
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": list(elements)}


def calls(each: Sequence[dict[str, Any]], *, separator: str, one: bool) -> dict[str, Any]:
    """One call (any of ``each``, one per function), or with ``one`` false,
    one or more, ``separator`` between them."""
    call = one_of(each)
    if one:
        return call
    return sequence(call, {"type": "star", "content": sequence(const(separator), call) if separator else call})


def structural_tag(element: dict[str, Any]) -> dict[str, Any]:
    """``element`` as a whole structural tag (what the engine compiles)."""
    return {"type": "structural_tag", "format": element}
