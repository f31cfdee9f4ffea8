"""Logprobs in OpenAI's two shapes, and the text of the tokens they show.

``completion_logprobs`` builds the legacy ``logprobs`` object of
``/v1/completions`` (parallel lists, with each token's text offset), and
``echo_logprobs`` its prompt part when ``echo`` is set;
``vllm_prompt_logprobs`` vLLM's ``prompt_logprobs`` list;
``chat_logprobs`` the ``logprobs.content`` list of ``/v1/chat/completions``
(one entry per token, with its UTF-8 bytes). Both name tokens through
``TokenTexts``, which shows a token that holds part of a UTF-8 character as
its bytes, as OpenAI does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from trioserve.engine.sampling.prompt_logprobs import PromptLogprob
    from trioserve.engine.sampling.sampler import TokenLogprobs

# JSON has no -Infinity; OpenAI reports impossible tokens as -9999.0.
MIN_LOGPROB = -9999.0


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in table.values())
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return table


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece_bytes(piece: str) -> bytes | None:
    """The raw bytes a vocabulary piece stands for, when it encodes bytes."""
    if match := _BYTE_FALLBACK.fullmatch(piece):  # SentencePiece byte fallback
        return bytes([int(match.group(1), 16)])
    if piece and all(ch in _BYTE_LEVEL for ch in piece):
        return bytes(_BYTE_LEVEL[ch] for ch in piece)
    return None


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@attrs.define
class TokenTexts:
    """The text and UTF-8 bytes of single tokens, for logprobs.

    ``tokenizer`` needs ``decode(ids, skip_special_tokens=...)``, and
    ``convert_ids_to_tokens`` (transformers) or ``id_to_token`` (tokenizers)
    to recover the bytes of a token that is part of a UTF-8 character; such a
    token is shown as ``"bytes:\\xe2\\x80"`` as OpenAI does, since its text
    alone would be a replacement character.
    """

    tokenizer: Any
    _cache: dict[int, tuple[str, list[int]]] = attrs.field(factory=dict, init=False)

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _piece(self, token_id: int) -> str | None:
        if hasattr(self.tokenizer, "convert_ids_to_tokens"):
            return self.tokenizer.convert_ids_to_tokens(token_id)
        if hasattr(self.tokenizer, "id_to_token"):
            return self.tokenizer.id_to_token(token_id)
        return None

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is not None:
            return found
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self._piece(token_id)
        # SentencePiece decoders strip the leading space of a lone token;
        # its piece still shows it as "▁".
        if piece and piece.startswith("\u2581") and not text.startswith(" "):
            text = " " + text
        raw = text.encode("utf-8")
        piece_raw = _piece_bytes(piece) if "\ufffd" in text and piece else None
        if piece_raw is not None and not _is_utf8(piece_raw):
            raw = piece_raw
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        found = self._cache[token_id] = (text, list(raw))
        return found


def _logprob(value: float) -> float:
    return float(value) if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB


def completion_logprobs(entries: Iterable[TokenLogprobs], texts: TokenTexts, offset: int) -> tuple[dict[str, Any], int]:
    """The legacy ``logprobs`` object, and the text offset after its last
    token; ``offset`` is where the first token's text starts."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in entries:
        text = texts.text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(_logprob(entry.logprob))
        # OpenAI always includes the sampled token among the top ones.
        top = {texts.text(tid): _logprob(lp) for tid, lp in entry.top}
        top.setdefault(text, _logprob(entry.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}
    return body, offset


def chat_logprobs(entries: Iterable[TokenLogprobs], texts: TokenTexts) -> list[dict[str, Any]]:
    """The chat API's ``logprobs.content``: one entry per token."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.text(token_id), "logprob": _logprob(logprob), "bytes": texts.bytes(token_id)}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(tid, lp) for tid, lp in e.top]} for e in entries]


def echo_logprobs(
    prompt_ids: Sequence[int], entries: Sequence[PromptLogprob], texts: TokenTexts
) -> tuple[dict[str, Any], int]:
    """The legacy ``logprobs`` object of an echoed prompt (as OpenAI gives
    it: the first token has no logprob, ``null``), and the text offset after
    it. ``entries`` score ``prompt_ids[1:]``."""
    first = texts.text(prompt_ids[0])
    body = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    rest, offset = completion_logprobs(entries, texts, len(first))  # type: ignore[arg-type]
    return concat_logprobs(body, rest), offset


def concat_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two legacy ``logprobs`` objects, one after the other."""
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(
    prompt_ids: Sequence[int], entries: Sequence[PromptLogprob], texts: TokenTexts
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then
    per token ``{token id: {logprob, rank, decoded_token}}`` for the token
    itself and the top ones of its position."""

    def one(logprob: float, rank: int, token_id: int) -> dict[str, Any]:
        return {"logprob": _logprob(logprob), "rank": rank, "decoded_token": texts.text(token_id)}

    result: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries:
        position = {str(tid): one(lp, rank, tid) for rank, (tid, lp) in enumerate(entry.top, start=1)}
        position.setdefault(str(entry.token_id), one(entry.logprob, entry.rank, entry.token_id))
        result.append(position)
    assert len(result) == len(prompt_ids), "prompt logprobs must score every prompt token after the first"
    return result
