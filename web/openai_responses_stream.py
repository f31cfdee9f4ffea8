"""A streamed ``POST /v1/responses``: the chat stream's chunks
(web/completion_bodies.py's ``ChatCompletionStream``, which reads
reasoning and tool calls as they are generated) told again as OpenAI's
typed events.

The events, in OpenAI's order, each with its ``sequence_number`` (0, 1,
...): ``response.created`` and ``response.in_progress``; per output item
``response.output_item.added``, then a message's
``response.content_part.added``, ``response.output_text.delta`` events,
``response.output_text.done`` and ``response.content_part.done`` (a
reasoning item's the same with ``reasoning_text``), or a call's
``response.function_call_arguments.delta`` events and
``response.function_call_arguments.done``, and ``response.output_item.done``;
then the whole response in ``response.completed`` (or
``response.incomplete``, ``response.failed``, as its status says; OpenAI
ends an incomplete stream so too). Each goes as ``event: TYPE`` and
``data: JSON``. Items do not interleave: a new kind of text (or a new
call) closes the open item. The last event's response is the one
``create`` gives for the same greedy request, but for ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .completion_bodies import ChatCompletionStream
from .errors import ApiError
from .openai_responses_output import (
    CountTokens,
    ResponseShape,
    call_item,
    last_item_status,
    message_item,
    reasoning_item,
    status_of,
    text_part,
    usage,
)
from .output_reader import ChatReading

if TYPE_CHECKING:
    from trioserve.engine.core.outputs import RequestOutput

    from .slo import SloReport

Event = dict[str, Any]
# The event that ends a stream, by the response's status.
_LAST_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


def sse_events(events: Sequence[Event]) -> bytes:
    """``events`` as one write, each ``event: TYPE``, ``data: JSON`` and a blank line."""
    out = []
    for event in events:
        payload = json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")
        out.append(b"event: " + event["type"].encode() + b"\ndata: " + payload + b"\n\n")
    return b"".join(out)


@attrs.define
class _OpenItem:
    kind: str  # "reasoning", "message", or "call:INDEX"
    item: dict[str, Any]
    index: int
    text: str = ""


@attrs.define
class ResponseEvents:
    """Events of one streamed response: ``events`` per engine output,
    ``final_events`` once the request is done (``response`` is then the
    whole response, for the store)."""

    shape: ResponseShape
    reading: ChatReading
    count_tokens: CountTokens
    response: dict[str, Any] | None = attrs.field(init=False, default=None)
    _chat: ChatCompletionStream = attrs.field(init=False)
    _sequence: int = attrs.field(init=False, default=0)
    _started: bool = attrs.field(init=False, default=False)
    _output: list[dict[str, Any]] = attrs.field(init=False, factory=list)
    _open: _OpenItem | None = attrs.field(init=False, default=None)
    _reasoning: str = attrs.field(init=False, default="")
    _finish: str | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._chat = ChatCompletionStream(self.shape.model, include_usage=True)
        self._chat.reading = self.reading

    def report_slo(self, report: SloReport | None) -> None:
        """Put ``report`` (web/slo.py) in the final response's usage."""
        self._chat.report_slo(report)

    def events(self, output: RequestOutput) -> list[Event]:
        """What the engine's ``output`` adds to the stream."""
        events = self._start()
        for chunk in self._chat.chunks(output):
            for choice in chunk["choices"]:
                events += self._delta(choice["delta"])
                if choice["finish_reason"] is not None:
                    self._finish = choice["finish_reason"]
        return events

    def final_events(self) -> list[Event]:
        """The open item's end and the event with the whole response."""
        events = self._start()
        counts = None
        for chunk in self._chat.final_chunks():
            counts = chunk.get("usage") or counts
        status, incomplete, error = status_of(self._finish)
        if self._open is None and not self._output:
            events += self._begin("message", message_item("", "in_progress"))
        events += self._close(last_item_status(status))
        used = None
        if counts is not None:
            used = usage(counts, self.count_tokens(self._reasoning) if self._reasoning else 0)
        self.response = self.shape.response(status, list(self._output), used, incomplete, error)
        return [*events, self._event(_LAST_EVENTS[status], response=self.response)]

    def error_event(self, error: ApiError) -> Event:
        """An ``error`` event: the request failed after the status went out."""
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        response = self.shape.response("in_progress", [])
        return [self._event("response.created", response=response), self._event("response.in_progress", response=response)]

    def _delta(self, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a call's first delta: its id and name
                events += self._close("completed")
                item = call_item(call["id"], call["function"]["name"], "", "in_progress")
                events += self._begin(f"call:{call['index']}", item)
            arguments = call["function"].get("arguments")
            if arguments and self._open is not None and self._open.kind == f"call:{call['index']}":
                self._open.text += arguments
                events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != kind:
            events += self._close("completed")
            item = reasoning_item("", "in_progress") if kind == "reasoning" else message_item("", "in_progress")
            if kind == "reasoning":
                item["content"] = []
            events += self._begin(kind, item)
        assert self._open is not None
        self._open.text += text
        if kind == "reasoning":
            self._reasoning += text
            return [*events, self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)]
        delta = self._event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])
        return [*events, delta]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.item["id"], "output_index": self._open.index}

    def _begin(self, kind: str, item: dict[str, Any]) -> list[Event]:
        self._open = _OpenItem(kind, item, len(self._output))
        events = [self._event("response.output_item.added", output_index=self._open.index, item=item)]
        if kind in ("reasoning", "message"):
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else text_part("")
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def _close(self, status: str) -> list[Event]:
        open_item = self._open
        if open_item is None:
            return []
        where = self._where()
        events = []
        item = open_item.item
        if open_item.kind == "reasoning":
            done = reasoning_item(open_item.text, status, item["id"])
            events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=open_item.text))
            part = {"type": "reasoning_text", "text": open_item.text}
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        elif open_item.kind == "message":
            done = message_item(open_item.text, status, item["id"])
            text, part = open_item.text, text_part(open_item.text)
            events.append(self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        else:
            done = call_item(item["call_id"], item["name"], open_item.text, status, item["id"])
            events.append(self._event("response.function_call_arguments.done", **where, arguments=open_item.text))
        events.append(self._event("response.output_item.done", output_index=open_item.index, item=done))
        self._output.append(done)
        self._open = None
        return events

