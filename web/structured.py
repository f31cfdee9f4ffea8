"""Structured output in request bodies: OpenAI's ``response_format`` and
vLLM's ``structured_outputs``, read into the engine's ``StructuredOutput``.

Each wrong shape raises ``InvalidRequest`` (400) naming the field; whether a
schema, regex or grammar compiles is checked by the engine, whose error
names the same field (``StructuredOutput.field``).

``chat_constraint`` fits a chat request's constraint to the served model
once it is known: ``tool_choice`` ``required`` or a named function
becomes calls in the model's own tool-call format (web/tools.py), and
with a reasoning parser the constraint applies only after the reasoning
(``StructuredOutput.starts_after``: its end marker's token ids), as vLLM
does. A prompt that already closed the reasoning (Qwen3's
``enable_thinking: false`` renders an empty ``<think></think>``) leaves
the constraint applying from the first token. Until the marker, sampling
is free, bounded by ``max_tokens``: a model that never ends its
reasoning is never constrained.
"""

from __future__ import annotations

from typing import Any

import attrs

from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.sampling.structured_output import StructuredOutput

from .errors import InvalidRequest
from .fields import invalid
from .reasoning import ReasoningParser
from .tool_format import ToolFormat, const
from .tools import ToolChoice

# vLLM's structured_outputs keys, each a kind of constraint.
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict):
        raise InvalidRequest("response_format must be an object with a type", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object(field="response_format")
    if kind != "json_schema":
        raise InvalidRequest(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}", param="response_format.type"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(
            "response_format.json_schema must be an object with name and schema", param="response_format.json_schema"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("response_format.json_schema.name must be a non-empty string", param="response_format.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("response_format.json_schema.strict must be true or false", param="response_format.json_schema.strict")
    if "schema" not in spec:
        raise InvalidRequest("response_format.json_schema.schema is required", param="response_format.json_schema.schema")
    return StructuredOutput.json_schema(spec["schema"], field="response_format.json_schema.schema")


def _structured_outputs(value: Any) -> StructuredOutput:
    if not isinstance(value, dict):
        raise InvalidRequest("structured_outputs must be an object", param="structured_outputs")
    given = [kind for kind in _KINDS if value.get(kind) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(
            f"structured_outputs must hold exactly one of {', '.join(_KINDS)}; got {len(given)}", param="structured_outputs"
        )
    kind = given[0]
    spec, field = value[kind], f"structured_outputs.{kind}"
    if kind == "json":
        return StructuredOutput.json_schema(spec, field=field)
    if kind == "json_object":
        if spec is not True:
            raise InvalidRequest(f"{field} must be true", param=field)
        return StructuredOutput.json_object(field=field)
    if kind == "choice":
        return StructuredOutput.choice(spec, field=field)
    if kind == "regex":
        return StructuredOutput.regex(spec, field=field)
    return StructuredOutput.grammar(spec, field=field)


def structured_output(body: dict[str, Any]) -> StructuredOutput | None:
    """The constraint ``body`` asks for with ``response_format`` or
    ``structured_outputs`` (at most one of them), or None."""
    fmt, outputs = body.get("response_format"), body.get("structured_outputs")
    try:
        constraint = None if fmt is None else _response_format(fmt)
        if outputs is None:
            return constraint
        if constraint is not None:
            raise InvalidRequest(
                "give response_format or structured_outputs, not both", param="structured_outputs"
            )
        return _structured_outputs(outputs)
    except InvalidRequestError as exc:
        raise invalid(exc) from None


@attrs.frozen
class ModelTokens:
    """What the constraint needs of the served model's tokenizer: marker
    texts as token ids."""

    tokenizer: Any

    def ids(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def mark(self, text: str) -> dict[str, Any]:
        """``text`` as one token where the vocabulary has it as one (so the
        model writes its own marker token), else as text."""
        ids = self.ids(text)
        return {"type": "token", "token": ids[0]} if len(ids) == 1 else const(text)


def chat_constraint(
    constraint: StructuredOutput | None,
    *,
    tools: ToolChoice | None,
    tool_format: ToolFormat | None,
    reasoning: ReasoningParser | None,
    prompt: str,
    tokens: ModelTokens,
) -> StructuredOutput | None:
    """A chat request's constraint (``constraint``: the body's) for the
    served model: see the module docstring. ``prompt`` is the rendered
    prompt's text (only its end is read, and only with ``reasoning``)."""
    forces_calls = tools is not None and tools.forces_calls and hasattr(tool_format, "forced")
    marker = None
    if reasoning is not None:
        marker = reasoning.calls_after if forces_calls else reasoning.answer_after
        if prompt.rstrip().endswith(marker.strip()):
            marker = None  # the prompt closed the reasoning: the answer comes first
    if forces_calls:
        assert tools is not None and tool_format is not None
        constraint = tools.forced(tool_format, tokens.mark, after_reasoning=marker is not None)
    if constraint is None or marker is None:
        return constraint
    return constraint.after(tokens.ids(marker))
