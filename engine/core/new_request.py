"""A request's frozen values, from its edge to the core.

- ``RequestInput``: the request as its caller gives it, before the model
  is consulted: the prompt (text, token ids or chat messages), the
  ``SamplingParams`` and the priority. Its validators are the rules of
  those fields that need no model; each edge builds one (the HTTP and gRPC
  APIs from their bodies, ``Engine.generate`` from its arguments) and maps
  the ``InvalidRequestError`` to its own error shape.
- ``NewRequest``: the request as ``EngineCore.validate`` accepted it, where
  the model is known: the id, the prompt tokenized (every id in the
  vocabulary, short enough to fit with one generated token), the sampling
  parameters checked against the vocabulary. The core, the scheduler and
  the actors take it as given and only assert invariants.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from trioserve.engine.latency_objectives import NO_OBJECTIVES, LatencyObjectives
from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.lora.registry import LoraRef
from trioserve.engine.sampling.pooling import Pooling, PoolingParams
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.text.tokenizer import check_text

# A request with n > 1 runs one sequence per completion, named
# "<request id>/<index>"; an id with this character could name another
# request's sequence, so ids may not contain it.
SEQUENCE_SEPARATOR = "/"

# A prompt: text, token ids, or chat messages ({"role", "content", ...}).
Prompt = str | tuple[int, ...] | tuple[Mapping[str, Any], ...]


def check_request_id(request_id: object) -> str:
    """``request_id`` if it is a usable id, else ``InvalidRequestError``."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id must be a non-empty string", field="request_id")
    if SEQUENCE_SEPARATOR in request_id:
        raise InvalidRequestError(
            f"request_id must not contain {SEQUENCE_SEPARATOR!r} (it names a completion's sequence)",
            field="request_id",
        )
    return request_id


def check_priority(priority: object) -> int:
    """``priority`` if it is an int (lower runs first), else ``InvalidRequestError``."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}", field="priority")
    return priority


def as_prompt(value: object) -> Prompt:
    """``value`` as a ``Prompt``: non-empty text that is Unicode (no lone
    surrogate), or a non-empty list of token ids (integers >= 0; the
    vocabulary's bound waits for the model), or a non-empty list of chat
    messages (objects; their roles and contents are the chat template's to
    judge). Else ``InvalidRequestError`` naming ``prompt``."""
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError("prompt must not be empty", field="prompt")
        check_text(value, "prompt")
        return value
    if not isinstance(value, list | tuple):
        raise InvalidRequestError(
            f"prompt must be a string, a list of token ids or a list of messages, got {type(value).__name__}",
            field="prompt",
        )
    if not value:
        raise InvalidRequestError("prompt must not be empty", field="prompt")
    if all(isinstance(item, Mapping) for item in value):
        return tuple(value)
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        negative = next((token_id for token_id in value if token_id < 0), None)
        if negative is not None:
            raise InvalidRequestError(f"prompt has token id {negative}: token ids are >= 0", field="prompt")
        return tuple(value)
    raise InvalidRequestError("prompt must be a string, a list of token ids or a list of messages", field="prompt")


def _priority(_instance: object, _attribute: object, value: object) -> None:
    check_priority(value)


def _sampling_params(_instance: object, _attribute: object, value: object) -> None:
    if not isinstance(value, SamplingParams):
        raise InvalidRequestError(f"params must be SamplingParams, got {type(value).__name__}", field="params")


@attrs.frozen
class RequestInput:
    """A request as its caller gives it: ``prompt`` (``as_prompt``),
    ``params`` and ``priority`` (an integer; lower runs first).

    Build it once, at the edge; ``Engine.submit`` / ``submit_nowait`` take
    it as it is (``Engine.generate`` builds it from its arguments).
    """

    prompt: Prompt = attrs.field(converter=as_prompt)
    params: SamplingParams = attrs.field(factory=SamplingParams, validator=_sampling_params)
    priority: int = attrs.field(default=0, validator=_priority)
    # An embedding request (``Engine.embed``): its prompt's pooled hidden
    # states instead of generated tokens; None generates.
    pooling: PoolingParams | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(PoolingParams))
    )
    # Its latency targets (issue #44): what admission predicts against and
    # the ``slo`` scheduling policy orders by; NO_OBJECTIVES: none.
    objectives: LatencyObjectives = attrs.field(
        default=NO_OBJECTIVES, validator=attrs.validators.instance_of(LatencyObjectives), kw_only=True
    )
    # The name of a loaded LoRA adapter to run with (engine/lora); None: the base model.
    lora: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )

    @property
    def is_chat(self) -> bool:
        """Whether the prompt is chat messages (templated by the engine)."""
        return not isinstance(self.prompt, str) and isinstance(self.prompt[0], Mapping)


@attrs.frozen
class NewRequest:
    """A validated request: what ``EngineCore.admit`` takes.

    Built by ``EngineCore.validate``. Its validators hold what the core
    relies on whoever built it (a direct ``EngineCore.add_request`` takes
    no ``RequestInput``): a usable id, an integer priority, and at least
    one prompt token (a non-empty text can still tokenize to none).
    """

    request_id: str = attrs.field(validator=lambda _, __, value: check_request_id(value))
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    params: SamplingParams = attrs.field(validator=attrs.validators.instance_of(SamplingParams))
    priority: int = attrs.field(default=0, validator=_priority)
    # An embedding request's pooling, resolved against the model
    # (``EngineCore.validate``); None generates.
    pooling: Pooling | None = None
    # Its latency targets, as the edge gave them (``RequestInput.objectives``).
    objectives: LatencyObjectives = attrs.field(default=NO_OBJECTIVES, kw_only=True)
    # The LoRA adapter, resolved by ``EngineCore.validate``; None: the base model.
    lora: LoraRef | None = None

    @prompt_token_ids.validator
    def _check_prompt(self, _attribute: object, value: tuple[int, ...]) -> None:
        if not value:
            raise InvalidRequestError("prompt must not be empty: it has no tokens", field="prompt")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def sequence_ids(self) -> tuple[str, ...]:
        """The ids of its sequences: the request's own for ``n == 1``, one
        per completion otherwise."""
        if self.params.n == 1:
            return (self.request_id,)
        return tuple(f"{self.request_id}{SEQUENCE_SEPARATOR}{index}" for index in range(self.params.n))
