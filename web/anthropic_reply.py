"""The answer of ``POST /v1/messages``: a chat completion (web/completion_bodies.py)
read back as Anthropic's ``message`` object.

The chat body's message has its reasoning (``reasoning_content``), text
and ``tool_calls`` already read out by the model's parsers; here they
become ``thinking``, ``text`` and ``tool_use`` blocks, in that order, and
the finish reason becomes Anthropic's ``stop_reason``: ``end_turn``,
``stop_sequence`` (with the sequence matched), ``max_tokens`` or
``tool_use``. The finish reasons Anthropic has no word for (an abort, a
failed step) keep the chat API's name.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

# The chat API's finish reasons in Anthropic's words; ``stop`` is
# end_turn or stop_sequence, as the stop reason says.
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str | None, matched: Any, stop_sequences: Sequence[str]) -> tuple[str | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a chat
    choice's ``finish_reason`` and ``stop_reason`` (the stop string or
    token that matched, None for the end-of-sequence token)."""
    if finish_reason == "stop":
        if isinstance(matched, str) and matched in stop_sequences:
            return "stop_sequence", matched
        return "end_turn", None
    if finish_reason is None:
        return None, None
    return _STOP_REASONS.get(finish_reason, finish_reason), None


def usage(input_tokens: int, output_tokens: int, slo: dict[str, Any] | None = None) -> dict[str, Any]:
    """Anthropic's ``usage``: ``input_tokens`` counts the whole prompt,
    as ``count_tokens`` does (cached tokens included); ``slo``: the
    latency objectives' report (web/slo.py), where the request has one."""
    used: dict[str, Any] = {"input_tokens": input_tokens, "output_tokens": output_tokens}
    if slo is not None:
        used["slo"] = slo
    return used


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's ``arguments`` (JSON text; the parser kept only objects) as ``input``."""
    value = json.loads(arguments) if arguments else {}
    return value if isinstance(value, dict) else {}


def message_body(chat: dict[str, Any], model: str, stop_sequences: Sequence[str]) -> dict[str, Any]:
    """The ``message`` object of a whole ``chat.completion`` body (one choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": tool_input(function["arguments"])})
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), stop_sequences)
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"], chat["usage"].get("slo")),
    }
