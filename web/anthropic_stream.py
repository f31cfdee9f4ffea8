"""A streamed ``POST /v1/messages``: the chat stream's chunks
(web/completion_bodies.py's ``ChatCompletionStream``, which reads
reasoning and tool calls as they are generated) told again as Anthropic's
events.

The events, in order: ``message_start`` (with the prompt's token count,
so it waits for the engine's first output) and a ``ping``; per content
block ``content_block_start``, its ``content_block_delta`` events
(``thinking_delta``, ``text_delta``, or a ``tool_use`` block's
``input_json_delta``) and ``content_block_stop``; then ``message_delta``
with the ``stop_reason`` and the output's ``usage``, and
``message_stop``. Each goes as ``event: NAME`` and ``data: JSON``, the
framing Anthropic's clients read. Blocks do not interleave: a new kind
of text (or a new call) closes the open block.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .anthropic_reply import message_id, stop_reason, usage
from .completion_bodies import ChatCompletionStream
from .output_reader import ChatReading

if TYPE_CHECKING:
    from trioserve.engine.core.outputs import RequestOutput

    from .slo import SloReport

Event = tuple[str, dict[str, Any]]


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One event in Anthropic's framing: ``event: NAME``, ``data: JSON``, a blank line."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"


def sse_events(events: Sequence[Event]) -> bytes:
    """``events`` as one write."""
    return b"".join(sse_event(name, data) for name, data in events)


@attrs.define
class MessageStream:
    """Events of one streamed message: ``events`` per engine output,
    ``final_events`` once the request is done."""

    model: str
    reading: ChatReading
    stop_sequences: Sequence[str] = ()
    id: str = attrs.field(factory=message_id)
    _chat: ChatCompletionStream = attrs.field(init=False)
    _started: bool = attrs.field(init=False, default=False)
    _index: int = attrs.field(init=False, default=-1)  # the open block's index
    _kind: str | None = attrs.field(init=False, default=None)  # the open block's kind (a call: "tool_use:N")
    _finish: tuple[str | None, Any] = attrs.field(init=False, default=(None, None))
    _output_tokens: int = attrs.field(init=False, default=0)
    _slo: dict[str, Any] | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._chat = ChatCompletionStream(self.model, include_usage=True)
        self._chat.reading = self.reading

    def report_slo(self, report: SloReport | None) -> None:
        """Put ``report`` (web/slo.py) in the final ``message_delta``'s usage."""
        self._chat.report_slo(report)

    def events(self, output: RequestOutput) -> list[Event]:
        """What the engine's ``output`` adds to the stream."""
        events = self._start(output.num_prompt_tokens)
        for chunk in self._chat.chunks(output):
            for choice in chunk["choices"]:
                events += self._delta(choice["delta"])
                if choice["finish_reason"] is not None:
                    self._finish = (choice["finish_reason"], choice.get("stop_reason"))
        return events

    def final_events(self) -> list[Event]:
        """The open block's end, ``message_delta`` and ``message_stop``."""
        events = self._start(0)
        for chunk in self._chat.final_chunks():
            if chunk.get("usage"):
                self._output_tokens = chunk["usage"]["completion_tokens"]
                self._slo = chunk["usage"].get("slo")
        events += self._close()
        reason, sequence = stop_reason(*self._finish, self.stop_sequences)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        delta["usage"] = {"output_tokens": self._output_tokens}
        if self._slo is not None:
            delta["usage"]["slo"] = self._slo
        return [*events, ("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def _start(self, input_tokens: int) -> list[Event]:
        if self._started:
            return []
        self._started = True
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(input_tokens, 0),
        }
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def _delta(self, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._block_delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            events += self._open("text", {"type": "text", "text": ""})
            events.append(self._block_delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a call's first delta: its id and name
                block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                events += self._open(f"tool_use:{call['index']}", block)
            if call["function"].get("arguments"):
                events.append(self._block_delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        return events

    def _open(self, kind: str, block: dict[str, Any]) -> list[Event]:
        if self._kind == kind:
            return []
        events = self._close()
        self._index += 1
        self._kind = kind
        return [*events, ("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})]

    def _close(self) -> list[Event]:
        if self._kind is None:
            return []
        self._kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _block_delta(self, delta: dict[str, Any]) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
