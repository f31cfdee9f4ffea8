"""Reasoning parsers: a reasoning model's thinking, read out of its text
into ``reasoning_content`` (the field vLLM and DeepSeek's API use), whole
and as it streams.

``ThinkTags`` reads ``<think>...</think>``: ``qwen3`` (Qwen3, QwQ,
SmolLM3) and ``deepseek_r1``. A generation may start inside the block: a
template that opens ``<think>`` in the prompt (DeepSeek-R1's distills,
Qwen3's thinking-only releases) leaves the model to write only its end,
and ``deepseek_r1`` always reads the text before ``</think>`` as
reasoning, as vLLM's parser does. gpt-oss's harmony channels are
web/harmony.py's ``HarmonyReasoning``.

A parser's ``scan(text, final, starts_inside)`` gives the reasoning (None
when the text has none) and the content; scans of a growing text only
grow, so ``StreamedReasoning`` streams a parser by sending what each scan
adds and ends at what the whole-text scan (``final``) reads.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from .tool_format import held_end

THINK, END_THINK = "<think>", "</think>"


class ReasoningParser(Protocol):
    name: str
    special_tokens: bool  # whether its markers are special tokens the text must keep
    # The markers the reasoning ends with: before an answer, before a call.
    # Structured output applies after them (web/structured.py).
    answer_after: str
    calls_after: str

    def scan(self, text: str, final: bool, starts_inside: bool = False) -> tuple[str | None, str]: ...


@attrs.frozen
class ThinkTags:
    """``<think>reasoning</think>content``; the content's leading
    whitespace (the model's blank line after the block) is left out."""

    name: str = "qwen3"
    always_inside: bool = False  # deepseek_r1: the text before </think> is reasoning
    special_tokens: bool = False
    answer_after: str = END_THINK
    calls_after: str = END_THINK

    def scan(self, text: str, final: bool, starts_inside: bool = False) -> tuple[str | None, str]:
        stripped = text.lstrip()
        opened = stripped.startswith(THINK)
        if opened:
            start = len(text) - len(stripped) + len(THINK)
        elif not final and THINK.startswith(stripped):
            return None, ""  # may be <think>, split over tokens
        elif starts_inside or self.always_inside:
            start = 0
        else:
            return None, text
        end = text.find(END_THINK, start)
        if end < 0:
            return text[start : len(text) if final else held_end(text, [END_THINK], start)], ""
        return text[start:end], text[end + len(END_THINK) :].lstrip()


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a ``<think>`` block, so the
    generation starts in the reasoning."""
    return prompt.rfind(THINK) > prompt.rfind(END_THINK)


@attrs.frozen
class StreamPart:
    """What new text adds: reasoning and content to send."""

    reasoning: str = ""
    content: str = ""


@attrs.define
class StreamedReasoning:
    """One streamed choice's text read into reasoning and content pieces:
    ``feed`` each delta, ``finish`` at the end."""

    parser: ReasoningParser
    starts_inside: bool = False
    _text: str = attrs.field(init=False, default="")
    _reasoning: str = attrs.field(init=False, default="")
    _content: str = attrs.field(init=False, default="")

    def feed(self, delta: str) -> StreamPart:
        self._text += delta
        return self._diff(*self.parser.scan(self._text, False, self.starts_inside))

    def finish(self) -> StreamPart:
        return self._diff(*self.parser.scan(self._text, True, self.starts_inside))

    def _diff(self, reasoning: str | None, content: str) -> StreamPart:
        reasoning = reasoning or ""
        part = StreamPart(_extension(self._reasoning, reasoning), _extension(self._content, content))
        self._reasoning += part.reasoning
        self._content += part.content
        return part


def _extension(sent: str, now: str) -> str:
    """What ``now`` adds to ``sent``; nothing if it does not extend it
    (what was sent cannot be taken back)."""
    return now[len(sent) :] if now.startswith(sent) else ""
