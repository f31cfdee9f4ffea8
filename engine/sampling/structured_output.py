"""``StructuredOutput``: a request's constraint on the shape of its output.

A value, part of ``SamplingParams``: the kind of constraint and its
specification as text (a JSON schema serialised, a regular expression, an
EBNF grammar, an xgrammar structural tag) or a tuple of strings
(``choice``). It is checked here for its shape only; whether the schema, regex or grammar is usable is known when
``GrammarCompiler`` compiles it (``EngineCore.validate``), which raises
``InvalidRequestError`` naming ``field``.

``starts_after`` holds back the constraint until the output has generated
that token sequence: a reasoning model's answer is constrained, its
reasoning (up to and including the end marker, ``</think>`` say) is not.
The web layer sets it from the reasoning parser (web/structured.py); the
output before it is bounded by ``max_tokens`` only.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from trioserve.engine.errors import InvalidRequestError

JSON_SCHEMA = "json"
JSON_OBJECT = "json_object"
REGEX = "regex"
CHOICE = "choice"
GRAMMAR = "grammar"
STRUCTURAL_TAG = "structural_tag"
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, CHOICE, GRAMMAR, STRUCTURAL_TAG)


def _check_spec(instance: StructuredOutput, _attribute: object, spec: object) -> None:
    field = instance.field
    kind = instance.kind
    if kind not in KINDS:
        raise InvalidRequestError(f"{field} must be one of {', '.join(KINDS)}, got {kind!r}", field=field)
    if kind == CHOICE:
        if not isinstance(spec, tuple) or not spec or not all(isinstance(s, str) and s for s in spec):
            raise InvalidRequestError(f"{field} must be a non-empty list of non-empty strings", field=field)
    elif kind == JSON_OBJECT:
        if spec != "":
            raise InvalidRequestError(f"{field} takes no specification", field=field)
    elif not isinstance(spec, str) or not spec:
        raise InvalidRequestError(f"{field} must be a non-empty string", field=field)


def _check_starts_after(instance: StructuredOutput, _attribute: object, ids: object) -> None:
    if not isinstance(ids, tuple) or not all(type(i) is int and i >= 0 for i in ids):
        raise InvalidRequestError(f"{instance.field} must start after a tuple of token ids", field=instance.field)


@attrs.frozen
class StructuredOutput:
    """Constrain a request's output to ``kind``:

    - ``json``: JSON valid against the schema ``spec`` (serialised JSON);
    - ``json_object``: any JSON object (``spec`` is empty);
    - ``regex``: text matching the regular expression ``spec`` in full;
    - ``choice``: exactly one of the strings in ``spec``;
    - ``grammar``: text of the EBNF grammar ``spec`` (root rule ``root``);
    - ``structural_tag``: xgrammar's structural tag ``spec`` (its JSON
      text): text and special tokens around JSON schemas, as a model
      family writes its tool calls (web/tool_format*.py).

    ``starts_after``: the token ids the output must generate before the
    constraint applies (empty: from the first token); see the module
    docstring.

    ``field`` is the request field an error about it names (the HTTP layer
    sets ``response_format`` or ``structured_outputs.<kind>``); it is not
    part of the value's identity. Build it with the ``from_*`` constructors.
    """

    kind: str
    spec: str | tuple[str, ...] = attrs.field(validator=_check_spec)
    field: str = attrs.field(default="structured_output", eq=False, kw_only=True)
    starts_after: tuple[int, ...] = attrs.field(default=(), kw_only=True, validator=_check_starts_after)

    @classmethod
    def json_schema(cls, schema: Any, *, field: str = "structured_output.json") -> StructuredOutput:
        """Output valid against ``schema``: a dict (a JSON schema) or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{field} is not valid JSON: {exc}", field=field) from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError(f"{field} must be a JSON schema (an object), got {type(schema).__name__}", field=field)
        # Property order is kept: it is the order the output is generated in.
        return cls(JSON_SCHEMA, json.dumps(schema, ensure_ascii=False), field=field)

    @classmethod
    def json_object(cls, *, field: str = "structured_output.json_object") -> StructuredOutput:
        """Any JSON object."""
        return cls(JSON_OBJECT, "", field=field)

    @classmethod
    def regex(cls, pattern: str, *, field: str = "structured_output.regex") -> StructuredOutput:
        """Text that matches ``pattern`` in full."""
        return cls(REGEX, pattern, field=field)

    @classmethod
    def choice(cls, choices: Any, *, field: str = "structured_output.choice") -> StructuredOutput:
        """Exactly one of ``choices`` (a list of non-empty strings)."""
        if isinstance(choices, str) or not isinstance(choices, list | tuple):
            raise InvalidRequestError(f"{field} must be a non-empty list of non-empty strings", field=field)
        return cls(CHOICE, tuple(choices), field=field)

    @classmethod
    def grammar(cls, text: str, *, field: str = "structured_output.grammar") -> StructuredOutput:
        """Text of the EBNF grammar ``text`` (GBNF-style, root rule ``root``)."""
        return cls(GRAMMAR, text, field=field)

    @classmethod
    def structural_tag(cls, tag: Any, *, field: str = "structured_output.structural_tag") -> StructuredOutput:
        """Output in the shape of xgrammar's structural tag ``tag`` (a dict
        ``{"type": "structural_tag", "format": ...}`` or its JSON text)."""
        if not isinstance(tag, str):
            tag = json.dumps(tag, ensure_ascii=False)
        return cls(STRUCTURAL_TAG, tag, field=field)

    def after(self, token_ids: Any) -> StructuredOutput:
        """This constraint, held back until the output has generated
        ``token_ids`` (a sequence of ints; empty: from the first token)."""
        return attrs.evolve(self, starts_after=tuple(token_ids))

    @property
    def key(self) -> tuple[str, str | tuple[str, ...]]:
        """What a compiled grammar is cached by."""
        return (self.kind, self.spec)
