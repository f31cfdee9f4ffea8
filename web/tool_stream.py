"""Streamed tool calls: a choice's text, as it is generated, read into
OpenAI's ``delta.content`` and ``delta.tool_calls`` pieces.

A call's first delta carries its ``index``, ``id``, ``type`` and
``function.name`` (with empty ``arguments``); the next ones carry pieces of
``function.arguments`` as the model writes them, so the official client's
accumulation (and its stream helpers) assemble the call. What is held back,
and why:

- ``auto``: text that may be the start of ``<tool_call>`` (a tag split over
  tokens), then the call's opening up to its arguments
  (``{"name": "...", "arguments": ``): the name must be known, and be one of
  the tools, before the call's first delta can go. A call written another
  way (arguments first, say) is held until its ``</tool_call>`` and then
  sent whole, or dropped as the whole-body parser would drop it. Text after
  the first call is not content (as in ``parse_tool_calls``).
- ``required``: the output's opening up to its arguments, as above; the
  output is constrained, so it always comes in that order.
- named function: nothing: the output is the arguments.

The arguments are sent as generated: in ``auto`` mode the model is not
constrained, so a call whose arguments turn out not to be JSON has already
been sent (vLLM streams its tool calls the same way); the whole-body
response, parsed at the end, drops such a call instead.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import attrs

from .tools import CLOSE_TAG, OPEN_TAG, ToolChoice, parse_tool_calls

# A call's opening, up to where its arguments' value starts.
_OPENING = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@attrs.define
class _ValueEnd:
    """Finds where one JSON value ends in text fed a piece at a time
    (strings and nesting followed; the value is not checked)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    scalar: bool = False  # a number or literal at the top: it ends at a delimiter
    started: bool = False

    def feed(self, text: str) -> int | None:
        """The index in ``text`` just past the value's end, or None if it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif self.scalar:
                if ch in ",}] \t\r\n<":
                    return i
            elif ch == '"':
                self.in_string = self.started = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
            elif not self.started and not ch.isspace():
                self.scalar = self.started = True
        return None


@attrs.frozen
class StreamPiece:
    """What a choice's new text adds to the stream: ``content`` to send as
    is, and ``tool_calls`` deltas (OpenAI's shape, each with its ``index``)."""

    content: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()

    def __add__(self, other: StreamPiece) -> StreamPiece:
        return StreamPiece(self.content + other.content, self.tool_calls + other.tool_calls)


# Where the reader is in the text.
_CONTENT = "content"  # auto: text before any call (sent as content)
_BETWEEN = "between"  # auto: after a call, before the next tag (dropped)
_OPENING_STATE = "opening"  # the call's opening, up to its arguments
_ARGUMENTS = "arguments"  # the arguments' value, streamed
_CLOSING = "closing"  # auto: after the arguments, until </tool_call>
_DONE = "done"  # required / named: the one call is over


@attrs.define
class StreamedCalls:
    """One streamed choice's text, read into content and tool-call deltas.

    ``feed`` each text delta as it comes; ``finish`` when the choice ends.
    ``num_calls`` says how many calls were started (the finish reason is
    then ``tool_calls``).
    """

    tools: ToolChoice
    _text: str = attrs.field(init=False, default="")
    _pos: int = attrs.field(init=False, default=0)  # text before this is dealt with
    _state: str = attrs.field(init=False)
    _scanner: _ValueEnd = attrs.field(init=False, factory=_ValueEnd)
    _call_start: int = attrs.field(init=False, default=0)  # where the call being read begins (after its tag, in auto)
    _content_end: int = attrs.field(init=False, default=0)  # text before this went out as content
    num_calls: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._state = {"auto": _CONTENT, "required": _OPENING_STATE, "named": _ARGUMENTS}[self.tools.mode]

    def _begin(self, name: str) -> dict[str, Any]:
        self.num_calls += 1
        self._scanner = _ValueEnd()
        function = {"name": name, "arguments": ""}
        return {"index": self.num_calls - 1, "id": _call_id(), "type": "function", "function": function}

    def _arguments(self, piece: str) -> dict[str, Any]:
        return {"index": self.num_calls - 1, "function": {"arguments": piece}}

    def feed(self, delta: str) -> StreamPiece:
        """What can be sent now that ``delta`` was generated."""
        self._text += delta
        out = StreamPiece()
        if self.tools.mode == "named" and self.num_calls == 0:
            out += StreamPiece(tool_calls=(self._begin(self.tools.name or ""),))
        while True:
            piece, progressed = self._step()
            out += piece
            if not progressed:
                return out

    def _step(self) -> tuple[StreamPiece, bool]:
        """Read what the current state can; whether it moved on."""
        text, pos = self._text, self._pos
        if self._state in (_CONTENT, _BETWEEN):
            start = text.find(OPEN_TAG, pos)
            end = start if start >= 0 else self._before_partial_tag(pos)
            content = ""
            if self._state == _CONTENT:
                # Trailing whitespace waits: the whole-body parser strips it
                # before a call, so it is content only if more text follows.
                stop = max(pos, len(text[:end].rstrip()))
                content, self._pos, self._content_end = text[pos:stop], stop, stop
            else:
                self._pos = end
            if start < 0:
                return StreamPiece(content=content), False
            self._pos = self._call_start = start + len(OPEN_TAG)
            self._state = _OPENING_STATE
            return StreamPiece(content=content), True
        if self._state == _OPENING_STATE:
            match = _OPENING.match(text, pos)
            if match is not None:
                name = self._name(match.group(1))
                if name is not None:
                    self._pos = match.end()
                    self._state = _ARGUMENTS
                    return StreamPiece(tool_calls=(self._begin(name),)), True
            if self.tools.mode == "auto" and (close := text.find(CLOSE_TAG, pos)) >= 0:
                # Not an opening this reader follows: the block, whole.
                block = text[self._call_start - len(OPEN_TAG) : close + len(CLOSE_TAG)]
                self._pos = close + len(CLOSE_TAG)
                self._state = _BETWEEN
                return StreamPiece(tool_calls=self._whole(block)), True
            return StreamPiece(), False
        if self._state == _ARGUMENTS:
            started = self._scanner.started
            end = self._scanner.feed(text[pos:])
            stop = len(text) if end is None else pos + end
            piece = text[pos:stop] if started else text[pos:stop].lstrip()  # not the whitespace before the value
            self._pos = stop
            calls = (self._arguments(piece),) if piece else ()
            if end is None:
                return StreamPiece(tool_calls=calls), False
            self._state = _CLOSING if self.tools.mode == "auto" else _DONE
            return StreamPiece(tool_calls=calls), True
        if self._state == _CLOSING:
            close = text.find(CLOSE_TAG, pos)
            if close < 0:
                return StreamPiece(), False
            self._pos = close + len(CLOSE_TAG)
            self._state = _BETWEEN
            return StreamPiece(), True
        self._pos = len(text)  # _DONE: what follows the one call is not sent
        return StreamPiece(), False

    def _before_partial_tag(self, pos: int) -> int:
        """The end of the text, less a tail that could be the start of the tag."""
        text = self._text
        for size in range(min(len(OPEN_TAG) - 1, len(text) - pos), 0, -1):
            if OPEN_TAG.startswith(text[-size:]):
                return len(text) - size
        return len(text)

    def _name(self, escaped: str) -> str | None:
        try:
            name = json.loads(f'"{escaped}"')
        except json.JSONDecodeError:
            return None
        return name if name in {f["name"] for f in self.tools.functions} else None

    def _whole(self, text: str) -> tuple[dict[str, Any], ...]:
        """The calls the whole-body parser reads in ``text``, each in one delta."""
        _, calls = parse_tool_calls(text, self.tools)
        out = []
        for call in calls:
            self.num_calls += 1
            out.append({"index": self.num_calls - 1, **call})
        return tuple(out)

    def finish(self) -> StreamPiece:
        """The choice ended: what is still held back goes out now. A call
        left open at the end is parsed whole, as the whole-body parser
        would; with no call at all, the text held back is content."""
        text = self._text
        out = StreamPiece()
        if self._state == _OPENING_STATE:
            start = self._call_start - len(OPEN_TAG) if self.tools.mode == "auto" else 0
            out += StreamPiece(tool_calls=self._whole(text[start:]))
        if self.num_calls == 0 and self.tools.mode != "named":
            out += StreamPiece(content=text[self._content_end :])
        self._pos = self._content_end = len(text)
        self._state = _DONE
        return out
