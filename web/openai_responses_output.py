"""The answer of ``POST /v1/responses``: OpenAI's ``response`` object, its
output items and usage, from what the chat path read out of the model's
text (web/completion_bodies.py's chat message: reasoning, content, tool
calls), whole or as web/openai_responses_stream.py streams it.

The output items, in order: a ``reasoning`` item (its text as one
``reasoning_text`` part) when the reasoning parser read any, a
``message`` with one ``output_text`` part when there is content, and a
``function_call`` per call; a response with none of these has one empty
message. The last item is ``incomplete`` unless the response completed.
The status is ``completed``, or ``incomplete`` with
``incomplete_details.reason`` ``max_output_tokens`` when the output ran
out of tokens; a request ended any other way (an abort, a failed step,
its deadline in a stream) is ``failed``, its ``error`` naming the chat
API's finish reason. ``usage.output_tokens_details.reasoning_tokens`` is
the reasoning text's length in tokens, re-encoded with the model's
tokenizer (the engine does not tell which tokens were reasoning).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import attrs

from .openai_responses import ResponsesBody

CountTokens = Callable[[str], int]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str, id: str | None = None) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": id or new_id("rs"), "type": "reasoning", "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str, id: str | None = None) -> dict[str, Any]:
    content = [text_part(text)] if status != "in_progress" else []
    return {"id": id or new_id("msg"), "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(call_id: str, name: str, arguments: str, status: str, id: str | None = None) -> dict[str, Any]:
    return {
        "id": id or new_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """The response's ``status``, ``incomplete_details`` and ``error`` for
    the chat API's finish reason."""
    if finish_reason in ("stop", "tool_calls"):
        return "completed", None, None
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    return "failed", None, {"code": "server_error", "message": f"the response ended early: {finish_reason}"}


def last_item_status(status: str) -> str:
    """The status of a response's last output item (the earlier ones are
    completed: the next began after them), as a stream closes it."""
    return "completed" if status == "completed" else "incomplete"


def usage(counts: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """The Responses API's usage of a chat completion's (``counts``), and
    its latency objectives' report (``slo``, web/slo.py) where it has one."""
    input_tokens, output_tokens = counts["prompt_tokens"], counts["completion_tokens"]
    used = {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)},
        "total_tokens": input_tokens + output_tokens,
    }
    if "slo" in counts:
        used["slo"] = counts["slo"]
    return used


@attrs.frozen
class ResponseShape:
    """What a response object says besides its output: the request's
    echoed fields, the served model and the sampling it used."""

    id: str
    model: str
    body: ResponsesBody
    temperature: float | None
    top_p: float | None
    created_at: int = attrs.field(factory=lambda: int(time.time()))

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The ``response`` object in OpenAI's field order."""
        echo = self.body.echo
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": echo["instructions"],
            "max_output_tokens": echo["max_output_tokens"],
            "metadata": echo["metadata"],
            "model": self.model,
            "output": output,
            "parallel_tool_calls": echo["parallel_tool_calls"],
            "previous_response_id": echo["previous_response_id"],
            "reasoning": echo["reasoning"],
            "store": self.body.store,
            "temperature": self.temperature,
            "text": echo["text"],
            "tool_choice": echo["tool_choice"],
            "tools": echo["tools"],
            "top_p": self.top_p,
            "truncation": echo["truncation"],
            "usage": usage,
            "user": echo["user"],
        }

    def from_chat(self, chat: dict[str, Any], count_tokens: CountTokens) -> dict[str, Any]:
        """The whole response of a ``chat.completion`` body (one choice)."""
        choice = chat["choices"][0]
        message = choice["message"]
        status, incomplete, error = status_of(choice["finish_reason"])
        output = []
        reasoning = message.get("reasoning_content") or ""
        if reasoning:
            output.append(reasoning_item(reasoning, "completed"))
        if message.get("content"):
            output.append(message_item(message["content"], "completed"))
        for call in message.get("tool_calls") or ():
            function = call["function"]
            output.append(call_item(call["id"], function["name"], function["arguments"], "completed"))
        if not output:
            output.append(message_item("", "completed"))
        output[-1]["status"] = last_item_status(status)
        used = usage(chat["usage"], count_tokens(reasoning) if reasoning else 0)
        return self.response(status, output, used, incomplete, error)
