"""OpenAI's harmony format (gpt-oss): the model writes messages on
channels, ``<|channel|>analysis<|message|>...<|end|>`` (its reasoning),
``<|start|>assistant<|channel|>final<|message|>...`` (the answer) and
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
(a tool call). The markers are special tokens: a request read in harmony
keeps them in its text (``skip_special_tokens`` false, web/parsers.py).

``split_messages`` cuts a text into its messages; ``HarmonyReasoning``
(``--reasoning-parser gpt_oss``) takes the analysis channel as reasoning
and ``HarmonyFormat`` (``--tool-call-parser openai``) the calls. With
both, the reasoning parser leaves a call message as it was written, so
that the tool format reads it from the content.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .tool_format import CallScan, Mark, ToolScan, arguments, const, held_end, json_arguments, one_of, sequence

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
FUNCTIONS = "functions."


@attrs.frozen
class Message:
    """One message of the text (or plain text between messages: no
    ``header``): its header, body and end marker as written."""

    header: str
    body: str
    end: str = ""

    @property
    def channel(self) -> str | None:
        match = _CHANNEL.search(self.header)
        return match.group(1) if match else None

    @property
    def recipient(self) -> str | None:
        match = _RECIPIENT.search(self.header)
        return match.group(1) if match else None

    @property
    def raw(self) -> str:
        return self.header + (MESSAGE if self.header else "") + self.body + self.end


def _first(text: str, markers: tuple[str, ...], start: int) -> tuple[int, str]:
    found = [(i, m) for m in markers if (i := text.find(m, start)) >= 0]
    return min(found) if found else (-1, "")


def split_messages(text: str, final: bool) -> list[Message]:
    """``text``'s messages in order; unless ``final``, what could be the
    start of a marker at the end is held back, and so is a header not
    finished yet. A message cut short (its end marker is a stop token, so
    the text may lack it) ends where the next begins."""
    out: list[Message] = []
    pos = 0
    while pos < len(text):
        head, _ = _first(text, (START, CHANNEL), pos)
        if head < 0:
            end = len(text) if final else held_end(text, MARKERS, pos)
            plain = text[pos:end]
            for marker in ENDS:
                plain = plain.replace(marker, "")
            if plain:
                out.append(Message("", plain))
            break
        if head > pos:
            out.append(Message("", text[pos:head]))
        body_start = text.find(MESSAGE, head)
        if body_start < 0:
            break  # the header goes on
        header, body_start = text[head:body_start], body_start + len(MESSAGE)
        stop, marker = _first(text, (*ENDS, START, CHANNEL), body_start)
        if stop < 0:
            end = len(text) if final else held_end(text, MARKERS, body_start)
            out.append(Message(header, text[body_start:end]))
            break
        ended = marker if marker in ENDS else ""
        out.append(Message(header, text[body_start:stop], ended))
        pos = stop + len(ended)
    return out


def is_call(message: Message) -> bool:
    return (message.recipient or "").startswith(FUNCTIONS)


@attrs.frozen
class HarmonyReasoning:
    """``--reasoning-parser gpt_oss``: the analysis channel is reasoning;
    the final channel (and plain text) is content; a call message stays as
    it was written, for the tool format to read."""

    name: str = "gpt_oss"
    special_tokens: bool = True
    # The answer is the final channel's message; a call is a new message
    # after the analysis one ends (``HarmonyFormat.forced``).
    answer_after: str = f"{CHANNEL}final{MESSAGE}"
    calls_after: str = "<|end|>"

    def scan(self, text: str, final: bool, starts_inside: bool = False) -> tuple[str | None, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for message in split_messages(text, final):
            if is_call(message):
                content.append(message.raw)
            elif message.channel == "analysis":
                reasoning.append(message.body)
            else:
                content.append(message.body)
        return ("".join(reasoning) if reasoning else None), "".join(content)


@attrs.frozen
class HarmonyFormat:
    """``--tool-call-parser openai``: a message to ``functions.NAME`` is a
    call of NAME, its body the arguments; other messages' bodies are content."""

    name: str = "openai"
    special_tokens: bool = True

    def scan(self, text: str, names: Mapping[str, Any], final: bool) -> ToolScan:
        content, calls = [], []
        for message in split_messages(text, final):
            if not is_call(message):
                content.append(message.body)
                continue
            name = (message.recipient or "")[len(FUNCTIONS) :]
            if name in names:
                arguments, _ = json_arguments(message.body, 0, final)
                calls.append(CallScan(name, arguments))
        return ToolScan("".join(content), tuple(calls))

    def forced(self, functions: Sequence[Mapping[str, Any]], *, one: bool, mark: Mark, after_reasoning: bool) -> dict[str, Any]:
        """One call message, ``<|channel|>commentary to=functions.NAME
        <|constrain|>json<|message|>{...}``; gpt-oss ends it with ``<|call|>``,
        a stop token, so there is one call however many were allowed. After
        the reasoning (its analysis message ended with ``<|end|>``) the call
        opens a new message: ``<|start|>assistant`` first."""
        each = [
            sequence(
                mark(CHANNEL),
                const(f"commentary to={FUNCTIONS}{f['name']} "),
                mark(CONSTRAIN),
                const("json"),
                mark(MESSAGE),
                arguments(f),
            )
            for f in functions
        ]
        call = one_of(each)
        return sequence(mark(START), const("assistant"), call) if after_reasoning else call
