"""Streamed tool calls: a choice's text, as it is generated, read into
OpenAI's ``delta.content`` and ``delta.tool_calls`` pieces, in any of the
tool-call formats (web/tool_format.py).

A call's first delta carries its ``index``, ``id``, ``type`` and
``function.name`` (with empty ``arguments``); the next ones carry pieces of
``function.arguments`` as the model writes them, so the official client's
accumulation (and its stream helpers) assemble the call. The format's scan
of the text so far says what is known; each delta sends what the scan adds
to what was sent. So what is held back is what the format cannot tell yet:
text that may be the start of a call's marker split over tokens, a call's
opening up to its name (its first delta needs the name, and the name must
be one of the tools), and a call written in an order the format only reads
whole (then sent whole once it ends). ``finish`` sends what the scan of
the whole text adds: what ``parse_tool_calls`` reads, but that a call
already sent cannot be taken back.

The arguments are sent as generated: in ``auto`` mode the model is not
constrained, so a call whose arguments turn out not to be JSON has already
been sent (vLLM streams its tool calls the same way); the whole-body
response, parsed at the end, drops such a call instead.
"""

from __future__ import annotations

import uuid
from typing import Any

import attrs

from .tool_format import ToolFormat, ToolScan
from .tools import ToolChoice, call_format


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@attrs.frozen
class StreamPiece:
    """What a choice's new text adds to the stream: ``content`` to send as
    is, and ``tool_calls`` deltas (OpenAI's shape, each with its ``index``)."""

    content: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()

    def __add__(self, other: StreamPiece) -> StreamPiece:
        return StreamPiece(self.content + other.content, self.tool_calls + other.tool_calls)


@attrs.define
class StreamedCalls:
    """One streamed choice's text, read into content and tool-call deltas.

    ``feed`` each text delta as it comes; ``finish`` when the choice ends.
    ``num_calls`` says how many calls were started (the finish reason is
    then ``tool_calls``). ``model_format`` is how the model writes calls
    (Hermes when left out); ``required`` and named choices read it too, or,
    with no model format, the bare JSON they are then forced to.
    """

    tools: ToolChoice
    model_format: ToolFormat | None = None
    _format: ToolFormat = attrs.field(init=False)
    _text: str = attrs.field(init=False, default="")
    _content: str = attrs.field(init=False, default="")  # content sent
    _arguments: list[str] = attrs.field(init=False, factory=list)  # each call's arguments sent

    def __attrs_post_init__(self) -> None:
        self._format = call_format(self.tools, self.model_format)

    @property
    def num_calls(self) -> int:
        return len(self._arguments)

    def feed(self, delta: str) -> StreamPiece:
        """What can be sent now that ``delta`` was generated."""
        self._text += delta
        return self._diff(self._format.scan(self._text, self.tools.schemas, False))

    def finish(self) -> StreamPiece:
        """The choice ended: what is still held back goes out now."""
        return self._diff(self._format.scan(self._text, self.tools.schemas, True))

    def _diff(self, scan: ToolScan) -> StreamPiece:
        content = scan.content[len(self._content) :] if scan.content.startswith(self._content) else ""
        self._content += content
        deltas = []
        for index, call in enumerate(scan.calls):
            if index == len(self._arguments):
                self._arguments.append("")
                function = {"name": call.name, "arguments": ""}
                deltas.append({"index": index, "id": _call_id(), "type": "function", "function": function})
            sent = self._arguments[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self._arguments[index] = call.arguments
                deltas.append({"index": index, "function": {"arguments": call.arguments[len(sent) :]}})
        return StreamPiece(content, tuple(deltas))
