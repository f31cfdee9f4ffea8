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
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
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
