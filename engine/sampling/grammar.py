"""Grammars for structured output, on xgrammar.

``GrammarCompiler`` turns a ``StructuredOutput`` into a compiled grammar for
the model's vocabulary, once per (kind, spec): compiling a mid-size JSON
schema takes tens of milliseconds, so callers in the event loop run it in a
worker thread (``Engine.prepare``) and later lookups are a dict hit.
``GrammarMatchers`` keeps one matcher per constrained sequence (its position
in the grammar, advanced with each token the sequence accepts) and prepares
the fill of a step's allowed-token bitmask for every constrained row at once
(``MaskFill``). A constraint with ``starts_after`` (a reasoning model's
answer) waits: its row allows every token until the output has generated
that sequence, and its matcher starts with the token after it: a value that runs on any thread, so the actors fill it while
the step's forward computes (docs/architecture.md).

The cache holds at most ``cache_size`` compiled grammars, least recently
used first out (``EngineConfig.grammar_cache_size``); xgrammar's own cache
is off, so that bound is the only one.

Why xgrammar rather than llguidance: measured on this machine with the
default model's tokenizer (``scripts/grammar_backends.py``, in git history), a mask for 32
rows took 0.15 ms with xgrammar against 1.8 ms with llguidance; see
docs/api.md.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy
import torch

from trioserve.engine.config import DEFAULT_GRAMMAR_CACHE_SIZE
from trioserve.engine.errors import InvalidRequestError, TrioserveError
from trioserve.engine.sampling.rows import TokenMask
from trioserve.engine.sampling.structured_output import (
    CHOICE,
    GRAMMAR,
    JSON_OBJECT,
    JSON_SCHEMA,
    REGEX,
    STRUCTURAL_TAG,
    StructuredOutput,
)
from trioserve.engine.validators import integer_at_least

# Any JSON object, whatever its properties (xgrammar's strict mode would
# otherwise read an object schema without "properties" as "{}" only).
_ANY_OBJECT = json.dumps({"type": "object", "additionalProperties": True})


class GrammarError(TrioserveError):
    """A constrained sequence reached a point where its grammar allows no
    token (or refused the sampled one). The request ends with this error."""


# xgrammar's messages start "[time] /path/file.cc:line: "; the rest says what is wrong.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return _LOCATION.sub("", text[0]) if text else type(exc).__name__


def _tokenizer_info(xgrammar: Any, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of ``tokenizer``'s vocabulary. A ``FastTokenizer``
    gets what ``TokenizerInfo.from_huggingface`` derives for a transformers
    fast tokenizer (the same vocabulary, from the same ``tokenizers``
    backend; tests/test_fast_tokenizer.py compares the two), so no second
    tokenizer is loaded. xgrammar itself imports transformers: only a
    structured-output request pays for that."""
    from trioserve.engine.text.fast_tokenizer import FastTokenizer

    if not isinstance(tokenizer, FastTokenizer):
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
    if not stop_token_ids:
        raise ValueError("stop_token_ids cannot be empty")
    info = xgrammar.TokenizerInfo
    vocab = tokenizer.get_vocab()
    encoded = [""] * vocab_size
    for token, index in vocab.items():
        if index < vocab_size:
            encoded[index] = token
    metadata = info._detect_metadata_from_hf(tokenizer.backend_tokenizer.to_str())
    # As xgrammar does: where the serialized backend and the vocabulary
    # disagree on the vocabulary's encoding, the vocabulary wins.
    from_vocab = info._detect_vocab_type_from_vocab(vocab)
    if from_vocab is not None and from_vocab != metadata["vocab_type"]:
        prefix_space = info._detect_add_prefix_space_by_encoding(tokenizer, from_vocab)
        metadata = {"vocab_type": from_vocab, "add_prefix_space": prefix_space}
    return info(
        encoded,
        metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids),
        add_prefix_space=metadata["add_prefix_space"],
    )


@attrs.define(eq=False)
class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching the last
    ``cache_size`` used by (kind, spec).

    Thread-safe: ``compile`` may run in several worker threads at once.
    ``tokenizer`` is a ``FastTokenizer`` or a transformers tokenizer; ``vocab_size`` is the model's
    (its logits' width), ``stop_token_ids`` the model's EOS ids. A grammar
    evicted from the cache stays alive in the matchers that use it; the
    next request with it compiles it again.
    """

    tokenizer: Any
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    cache_size: int = attrs.field(default=DEFAULT_GRAMMAR_CACHE_SIZE, kw_only=True, validator=integer_at_least(1))
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _compiler: Any = attrs.field(init=False, default=None)
    _cache: collections.OrderedDict[tuple[str, Any], Any] = attrs.field(init=False, factory=collections.OrderedDict)

    def _backend(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = _tokenizer_info(xgrammar, self.tokenizer, self.vocab_size, self.stop_token_ids)
                # Compilation runs in the caller's thread (a worker thread of
                # the event loop's): two threads at most on a small machine.
                # Its own cache is off: this one, bounded, is the cache.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def cached(self, constraint: StructuredOutput) -> Any | None:
        """The compiled grammar of ``constraint`` if it is in the cache
        (which counts as a use)."""
        with self._lock:
            compiled = self._cache.get(constraint.key)
            if compiled is not None:
                self._cache.move_to_end(constraint.key)
            return compiled

    def _store(self, key: tuple[str, Any], compiled: Any) -> None:
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar of ``constraint``; raises ``InvalidRequestError``
        naming ``constraint.field`` if its schema, regex or grammar is unusable."""
        compiled = self.cached(constraint)
        if compiled is not None:
            return compiled
        compiler = self._backend()
        kind, spec = constraint.kind, constraint.spec
        try:
            if kind == JSON_SCHEMA:
                compiled = compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
            elif kind == JSON_OBJECT:
                compiled = compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
            elif kind == REGEX:
                compiled = compiler.compile_regex(spec)
            elif kind == CHOICE:
                # JSON's string escapes are the EBNF literal's too.
                alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec)
                compiled = compiler.compile_grammar(f"root ::= {alternatives}")
            elif kind == STRUCTURAL_TAG:
                compiled = compiler.compile_structural_tag(spec)
            else:
                assert kind == GRAMMAR, kind
                compiled = compiler.compile_grammar(spec)
        except Exception as exc:
            what = {JSON_SCHEMA: "JSON schema", REGEX: "regular expression", GRAMMAR: "grammar", STRUCTURAL_TAG: "structural tag"}
            what = what.get(kind, kind)
            raise InvalidRequestError(
                f"{constraint.field} is not a usable {what}: {_first_line(exc)}", field=constraint.field
            ) from None
        self._store(constraint.key, compiled)
        return compiled

    @property
    def num_cached(self) -> int:
        """Compiled grammars in the cache (at most ``cache_size``)."""
        return len(self._cache)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The allowed tokens of an int32 bitmask [R, ceil(V / 32)] as bool [R, V]
    (bit j of word w is token 32 * w + j)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


@attrs.frozen
class MaskRequest:
    """One constrained row of a step: its sequence, and the tokens it may
    not end on yet (EOS while it has fewer than ``min_tokens``)."""

    request_id: str
    banned: tuple[int, ...] = ()


@attrs.frozen
class FilledMask:
    """A step's filled bitmask, and its rows that end there: ``dead`` holds
    (sequence id, why) for each row whose grammar allows no token (its row
    allows every token: the caller ends it before its token counts)."""

    mask: TokenMask
    dead: tuple[tuple[str, str], ...] = ()


_NO_TOKEN = "its grammar allows no token at this point of the output"


@attrs.frozen(eq=False)
class MaskFill:
    """One step's mask work, ready to run on any thread: the matcher of each
    row (only read: filling does not move a matcher; None for a row whose
    constraint has not started, which allows every token) and its banned
    tokens.

    ``run`` releases the GIL while xgrammar fills a row, so it computes
    beside the model's forward (docs/architecture.md). Nothing may advance
    these matchers until it returns: the scheduler accepts a step's tokens
    only after that step, and the step cannot sample before its mask.
    """

    rows: tuple[MaskRequest, ...]
    matchers: tuple[Any | None, ...]
    vocab_size: int

    def run(self) -> FilledMask:
        """The bitmask of every row in one [len(rows), words] tensor. Never
        raises: if xgrammar fails, every row is dead with the error's name."""
        # Whole-tensor work here is numpy's, not torch's: this runs beside the
        # step thread, and a torch op over a [32, 1536] mask is big enough
        # for torch to open a second OpenMP team in this thread, whose
        # spinning threads then take the cores from the step's team (+35%
        # TPOT at 32 constrained rows, docs/benchmarks.md).
        bitmask = torch.empty(len(self.rows), (self.vocab_size + 31) // 32, dtype=torch.int32)
        words = bitmask.numpy()
        words.fill(-1)
        try:
            for index, (row, matcher) in enumerate(zip(self.rows, self.matchers)):
                if matcher is not None:
                    matcher.fill_next_token_bitmask(bitmask, index)
                for token_id in row.banned:
                    # bit 31 is int32's sign bit: clear it through the unsigned view
                    words.view(numpy.uint32)[index, token_id // 32] &= ~numpy.uint32(1 << (token_id % 32))
            empty = numpy.flatnonzero(~words.any(axis=1)).tolist()  # one check for the batch
            for index in empty:
                words[index] = -1
            dead = tuple((self.rows[index].request_id, _NO_TOKEN) for index in empty)
        except Exception as exc:  # a bug in the grammar engine fails its rows, not the engine
            words.fill(-1)
            dead = tuple((row.request_id, f"filling its allowed tokens failed ({type(exc).__name__})") for row in self.rows)
        mask = TokenMask(request_ids=tuple(row.request_id for row in self.rows), bitmask=bitmask)
        return FilledMask(mask, dead)


@attrs.define(eq=False)
class _Wait:
    """A constraint held back until the output generates ``ids``: the
    output's last ``len(ids)`` tokens, compared with each new one."""

    ids: tuple[int, ...]
    _tail: collections.deque[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._tail = collections.deque(maxlen=len(self.ids))

    def over(self, token_id: int) -> bool:
        """Note ``token_id``; True once the output ends with ``ids``."""
        self._tail.append(token_id)
        return len(self._tail) == len(self.ids) and tuple(self._tail) == self.ids


@attrs.define(eq=False)
class GrammarMatchers:
    """Each constrained sequence's position in its grammar, by sequence id,
    and the sequences whose constraint has not started yet (``starts_after``).

    Lives with the scheduler's side of the engine (``EngineCore``); the
    runner only ever sees the bitmasks, inside the step plan.
    """

    compiler: GrammarCompiler
    _matchers: dict[str, Any] = attrs.field(init=False, factory=dict)
    _waiting: dict[str, _Wait] = attrs.field(init=False, factory=dict)

    def add(self, request_id: str, constraint: StructuredOutput) -> None:
        """Start ``request_id`` at the beginning of its grammar, or waiting
        for its ``starts_after`` sequence."""
        import xgrammar

        self._matchers[request_id] = xgrammar.GrammarMatcher(self.compiler.compile(constraint))
        if constraint.starts_after:
            self._waiting[request_id] = _Wait(constraint.starts_after)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._waiting.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def started(self, request_id: str) -> bool:
        """Whether ``request_id``'s constraint applies to its next token."""
        return request_id in self._matchers and request_id not in self._waiting

    def prepare(self, rows: Sequence[MaskRequest]) -> MaskFill:
        """The fill of ``rows``' bitmask, to run now or on another thread."""
        matchers = tuple(None if row.request_id in self._waiting else self._matchers[row.request_id] for row in rows)
        return MaskFill(tuple(rows), matchers, self.compiler.vocab_size)

    def fill(self, rows: Sequence[MaskRequest]) -> FilledMask:
        """``prepare(rows).run()``: the bitmask of every row, here and now."""
        return self.prepare(rows).run()

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance ``request_id`` by its sampled token; False if its grammar
        refuses it (the mask allowed it, so only a bug or a race could). A
        waiting sequence's token counts toward its ``starts_after``: the
        grammar applies from the token after that sequence's last."""
        wait = self._waiting.get(request_id)
        if wait is not None:
            if wait.over(token_id):
                del self._waiting[request_id]
            return True
        matcher = self._matchers.get(request_id)
        return matcher is None or matcher.accept_token(token_id)

    def ids(self) -> Iterable[str]:
        return self._matchers.keys()
