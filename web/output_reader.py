"""A chat choice's text read into its message: reasoning first (a
reasoning parser, web/reasoning.py), then tool calls in the content
(web/tools.py, web/tool_stream.py), whole or as it streams."""

from __future__ import annotations

from typing import Any

import attrs

from .reasoning import ReasoningParser, StreamedReasoning
from .tool_format import ToolFormat
from .tool_stream import StreamedCalls, StreamPiece
from .tools import ToolChoice, parse_tool_calls


@attrs.frozen
class ChatReading:
    """How one request's output is read: its reasoning parser (None: none;
    ``starts_inside`` when the prompt opened the reasoning), its tools and
    the model's tool-call format."""

    reasoning: ReasoningParser | None = None
    starts_inside: bool = False
    tools: ToolChoice | None = None
    tool_format: ToolFormat | None = None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def message(self, text: str) -> dict[str, Any]:
        """The whole-body ``message`` of ``text``: ``content``,
        ``reasoning_content`` with a reasoning parser, ``tool_calls``."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            reasoning, message["content"] = self.reasoning.scan(text, True, self.starts_inside)
            message["reasoning_content"] = reasoning
        if self.tools is not None:
            message["content"], calls = parse_tool_calls(message["content"], self.tools, self.tool_format)
            if calls:
                message["tool_calls"] = calls
        elif self.reasoning is not None:
            message["content"] = message["content"] or None
        return message


@attrs.frozen
class ReadPiece:
    """What new text adds to a streamed choice."""

    reasoning: str = ""
    piece: StreamPiece = StreamPiece()


@attrs.define
class StreamedChoice:
    """One streamed choice read as ``ChatReading`` says: ``feed`` each
    delta (``final`` with the last one)."""

    reading: ChatReading
    _reasoning: StreamedReasoning | None = attrs.field(init=False, default=None)
    _calls: StreamedCalls | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.reading.reasoning is not None:
            self._reasoning = StreamedReasoning(self.reading.reasoning, self.reading.starts_inside)
        if self.reading.tools is not None:
            self._calls = StreamedCalls(self.reading.tools, self.reading.tool_format)

    @property
    def num_calls(self) -> int:
        return 0 if self._calls is None else self._calls.num_calls

    def feed(self, delta: str, final: bool = False) -> ReadPiece:
        reasoning, content = "", delta
        if self._reasoning is not None:
            part = self._reasoning.feed(delta)
            if final:
                last = self._reasoning.finish()
                part = attrs.evolve(part, reasoning=part.reasoning + last.reasoning, content=part.content + last.content)
            reasoning, content = part.reasoning, part.content
        if self._calls is None:
            return ReadPiece(reasoning, StreamPiece(content))
        piece = self._calls.feed(content)
        if final:
            piece += self._calls.finish()
        return ReadPiece(reasoning, piece)
