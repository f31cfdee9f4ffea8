"""Grammars for structured output, on xgrammar.

``GrammarCompiler`` turns a ``StructuredOutput`` into a compiled grammar for
the model's vocabulary, once per (kind, spec): compiling a mid-size JSON
schema takes tens of milliseconds, so callers in the event loop run it in a
worker thread (``Engine.prepare``) and later lookups are a dict hit.
``GrammarMatchers`` keeps one matcher per constrained sequence (its position
in the grammar, advanced with each token the sequence accepts) and fills the
allowed-token bitmask of every constrained row of a step in one batch.

Why xgrammar rather than llguidance: measured on this machine with the
default model's tokenizer (``scripts/grammar_backends.py``), a mask for 32
rows took 0.15 ms with xgrammar against 1.8 ms with llguidance; see
docs/api.md.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy
import torch

from .errors import InvalidRequestError, TrioserveError
from .step_plan import TokenMask
from .structured_output import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, StructuredOutput

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


@attrs.define(eq=False)
class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching them by (kind, spec).

    Thread-safe: ``compile`` may run in several worker threads at once.
    ``tokenizer`` is a Hugging Face tokenizer; ``vocab_size`` is the model's
    (its logits' width), ``stop_token_ids`` the model's EOS ids.
    """

    tokenizer: Any
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _compiler: Any = attrs.field(init=False, default=None)
    _cache: dict[tuple[str, Any], Any] = attrs.field(init=False, factory=dict)

    def _backend(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids)
                )
                # Compilation runs in the caller's thread (a worker thread of
                # the event loop's): two threads at most on a small machine.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def cached(self, constraint: StructuredOutput) -> Any | None:
        """The compiled grammar of ``constraint`` if it was compiled before."""
        return self._cache.get(constraint.key)

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar of ``constraint``; raises ``InvalidRequestError``
        naming ``constraint.field`` if its schema, regex or grammar is unusable."""
        compiled = self._cache.get(constraint.key)
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
            else:
                assert kind == GRAMMAR, kind
                compiled = compiler.compile_grammar(spec)
        except Exception as exc:
            what = {JSON_SCHEMA: "JSON schema", REGEX: "regular expression", GRAMMAR: "grammar"}.get(kind, kind)
            raise InvalidRequestError(
                f"{constraint.field} is not a usable {what}: {_first_line(exc)}", field=constraint.field
            ) from None
        self._cache[constraint.key] = compiled
        return compiled

    @property
    def num_cached(self) -> int:
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


@attrs.define(eq=False)
class GrammarMatchers:
    """Each constrained sequence's position in its grammar, by sequence id.

    Lives with the scheduler's side of the engine (``EngineCore``); the
    runner only ever sees the bitmasks, inside the step plan.
    """

    compiler: GrammarCompiler
    _matchers: dict[str, Any] = attrs.field(init=False, factory=dict)

    def add(self, request_id: str, constraint: StructuredOutput) -> None:
        """Start ``request_id`` at the beginning of its grammar."""
        import xgrammar

        self._matchers[request_id] = xgrammar.GrammarMatcher(self.compiler.compile(constraint))

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def fill(self, rows: Sequence[MaskRequest]) -> tuple[TokenMask, list[str]]:
        """The bitmask of every row, in one [len(rows), words] tensor, and
        the ids of the rows whose grammar allows no token at all (their row
        allows every token: the caller ends them before their token counts)."""
        # Whole-tensor work here is numpy's, not torch's: this runs beside the
        # step thread, and a torch op over a [32, 1536] mask is big enough
        # for torch to open a second OpenMP team in this thread, whose
        # spinning threads then take the cores from the step's team (+35%
        # TPOT at 32 constrained rows, docs/benchmarks.md).
        words = (self.compiler.vocab_size + 31) // 32
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)
        view = bitmask.numpy()
        view.fill(-1)
        for index, row in enumerate(rows):
            self._matchers[row.request_id].fill_next_token_bitmask(bitmask, index)
            for token_id in row.banned:
                # bit 31 is int32's sign bit: clear it through the unsigned view
                view.view(numpy.uint32)[index, token_id // 32] &= ~numpy.uint32(1 << (token_id % 32))
        empty = numpy.flatnonzero(~view.any(axis=1)).tolist()  # one check for the batch
        for index in empty:
            view[index] = -1
        mask = TokenMask(request_ids=tuple(row.request_id for row in rows), bitmask=bitmask)
        return mask, [rows[index].request_id for index in empty]

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance ``request_id`` by its sampled token; False if its grammar
        refuses it (the mask allowed it, so only a bug or a race could)."""
        matcher = self._matchers.get(request_id)
        return matcher is None or matcher.accept_token(token_id)

    def ids(self) -> Iterable[str]:
        return self._matchers.keys()
