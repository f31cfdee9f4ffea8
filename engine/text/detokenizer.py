"""Streaming detokenization with stop strings.

Text is decoded incrementally by the prefix/read-offset method that TGI and
vLLM use: each step decodes only a short window of recent tokens, once with
and once without the new ones, and emits the difference. The window only
moves past tokens whose text is complete, so a multi-byte character split
across tokens (an emoji, CJK) is never emitted in halves.

We call ``tokenizer.decode`` rather than ``tokenizers.decoders.DecodeStream``
because the deltas must join to exactly what ``tokenizer.decode`` gives for
the whole output (with its ``skip_special_tokens`` and clean-up options), and
``finish`` must flush tokens whose bytes never completed a character, which
``DecodeStream`` keeps to itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

# Prompt tokens decoded ahead of the output, so the first output token is
# read in context (a SentencePiece word keeps its leading space, as in vLLM).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


@attrs.frozen
class DetokenizerDelta:
    """The text one ``add_tokens`` call makes final, and the stop string that
    ended generation in it, if one did."""

    text: str
    stop_str: str | None = None


class IncrementalDetokenizer:
    """Turns a request's output tokens into text deltas as they arrive.

    ``tokenizer`` needs only ``decode(ids, skip_special_tokens=...)``. Joined,
    the deltas of ``add_tokens`` and the text of ``finish`` equal
    ``tokenizer.decode(output_ids, skip_special_tokens=...)`` for byte-level
    tokenizers (GPT-2 style, like the default model's), cut at the first stop
    string: before it, or after it with ``include_stop_str_in_output``.

    Text is held back while it could be the start of a stop string (at most
    ``len(longest stop) - 1`` characters) or ends in an incomplete UTF-8
    sequence. Once a stop string is found no more tokens are accepted.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._ids = self._prompt_context(list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]))
        # ids[prefix_offset:read_offset] is text already decoded; the window
        # starts at a character boundary, so decoding it alone is exact.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._held = ""  # decoded but not emitted: it may start a stop string
        self._emitted: list[str] = []
        self._done = False
        self.stop_str: str | None = None

    @property
    def text(self) -> str:
        """All the text emitted so far."""
        return "".join(self._emitted)

    @property
    def finished(self) -> bool:
        """True once a stop string was found or ``finish`` was called."""
        return self._done

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Take newly sampled tokens; return the text they make final.

        Raise ``RuntimeError`` once a stop string was found or ``finish``
        was called.
        """
        if self._done:
            raise RuntimeError("add_tokens called on a detokenizer that has finished")
        new_text = []
        for token_id in token_ids:
            self._ids.append(token_id)
            new_text.append(self._decode_step())
        return self._emit("".join(new_text))

    def finish(self) -> str:
        """End the output: return the text still held back, including any
        incomplete character (decoded as ``tokenizer.decode`` would).

        Returns "" when a stop string already ended the output.
        """
        if self._done:
            return ""
        tail = ""
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            tail = self._decode(self._ids[self._prefix_offset :])[len(prefix) :]
        delta = self._emit(tail)
        if self._done:
            return delta.text
        self._done = True
        rest, self._held = self._held, ""
        self._emitted.append(rest)
        return delta.text + rest

    def _prompt_context(self, context: list[int]) -> list[int]:
        # A context that ends inside a character would glue its bytes to the
        # first output token's; decode the output alone then.
        return context if not self._decode(context).endswith(_REPLACEMENT) else []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_step(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            # Nothing new (a skipped special token) or a character still
            # incomplete: wait for more tokens.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _emit(self, new_text: str) -> DetokenizerDelta:
        if not self._stop:
            self._emitted.append(new_text)
            return DetokenizerDelta(new_text)
        buffer = self._held + new_text
        found = self._find_stop(buffer)
        if found is not None:
            start, stop = found
            out = buffer[: start + len(stop)] if self._include_stop else buffer[:start]
            self._held = ""
            self._done = True
            self.stop_str = stop
            self._emitted.append(out)
            return DetokenizerDelta(out, stop)
        keep = self._partial_stop_len(buffer)
        out, self._held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        self._emitted.append(out)
        return DetokenizerDelta(out)

    def _find_stop(self, buffer: str) -> tuple[int, str] | None:
        # The stop string that ends first wins; of two ending together, the
        # one that starts first (it cuts more). Earlier text held no stop, so
        # any occurrence lies within ``buffer``.
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = buffer.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, buffer: str) -> int:
        # The longest suffix of ``buffer`` that a stop string starts with.
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
