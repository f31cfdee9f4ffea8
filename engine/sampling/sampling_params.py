"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.sampling.structured_output import StructuredOutput


def _check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise InvalidRequestError(f"{field} {message}", field=field)


def _as_tuple_of_str(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _as_tuple_of_int(value: Any) -> tuple[int, ...]:
    return () if value is None else tuple(value)


def _as_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    items = value.items() if isinstance(value, dict) else value
    try:
        # JSON object keys are strings: {"50256": -100}.
        return tuple(sorted((int(k), float(v)) for k, v in items))
    except (TypeError, ValueError):
        raise InvalidRequestError("logit_bias must map token ids to numbers", field="logit_bias") from None


@attrs.frozen
class LogitsProcessorSpec:
    """A logits processor a request asks for: a loaded plugin's name and
    the arguments its factory gets (a picklable value, as the step plan
    carries it; ``engine/plugins.py``)."""

    name: str
    args: tuple[tuple[str, Any], ...] = ()


def _as_processor_specs(value: Any) -> tuple[LogitsProcessorSpec, ...]:
    """``["name", {"name": ..., "args": {...}}, ...]`` (or specs) as specs."""
    if value is None:
        return ()
    if isinstance(value, str | dict) or not isinstance(value, list | tuple):
        raise InvalidRequestError(
            "logits_processors must be a list of names or {\"name\", \"args\"} objects", field="logits_processors"
        )
    specs = []
    for item in value:
        if isinstance(item, LogitsProcessorSpec):
            specs.append(item)
        elif isinstance(item, str) and item:
            specs.append(LogitsProcessorSpec(item))
        elif isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("args", {}), dict):
            if set(item) - {"name", "args"}:
                raise InvalidRequestError(
                    f"logits_processors items take only name and args, got {sorted(item)}", field="logits_processors"
                )
            args = item.get("args", {})
            if not all(isinstance(k, str) for k in args):
                raise InvalidRequestError("logits_processors args must have string keys", field="logits_processors")
            specs.append(LogitsProcessorSpec(item["name"], tuple(sorted((k, _frozen(v)) for k, v in args.items()))))
        else:
            raise InvalidRequestError(
                f"logits_processors items must be names or {{\"name\", \"args\"}} objects, got {item!r}",
                field="logits_processors",
            )
    return tuple(specs)


def _frozen(value: Any) -> Any:
    # JSON arrays as tuples, so the params stay hashable values.
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value


_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")

# The fields a model's sampling defaults fill where a request leaves them
# out (engine/loading/generation_config.py), and what each reads as until then:
# the API's neutral values (no scaling, no truncation, no penalty).
NEUTRAL_SAMPLING: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
DEFAULTABLE_FIELDS = tuple(NEUTRAL_SAMPLING)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to choose tokens for one request, and when to stop.

    Field meanings follow OpenAI's and vLLM's. Invalid values raise
    ``InvalidRequestError`` whose ``field`` names the parameter.
    ``temperature == 0`` is greedy. Token ids in ``logit_bias`` and
    ``stop_token_ids`` are checked against the vocabulary by
    ``validate_for_vocab`` once the model is known.

    The model's sampling defaults: ``temperature``, ``top_p``, ``top_k``,
    ``min_p`` and ``repetition_penalty`` left out (or given as None) are
    *unset*, and ``unset_fields`` names them. The engine's edge
    (``Engine.generate`` of ``trioserve.actors``, the HTTP and gRPC APIs,
    ``trioserve generate``) fills them from the model's defaults
    (``with_defaults``; engine/loading/generation_config.py), so an explicit value
    always wins, and ``temperature=0`` stays greedy whatever the model
    says. Until filled, an unset field reads as its neutral value
    (``NEUTRAL_SAMPLING``: temperature 1, no top-k/top-p/min-p, no
    penalty), which is what an ``EngineCore`` driven directly samples with.
    """

    n: int = 1
    # Stored as None when unset; read through the properties below.
    _temperature: float | None = None
    _top_p: float | None = None
    _top_k: int | None = None  # 0 or -1: no top-k
    _min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    _repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple_of_str)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple_of_int)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_as_bias)
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob plus the top k
    skip_special_tokens: bool = True
    # Structured output: the output follows this schema, regex, choice or
    # grammar (a token mask each step; see engine/sampling/grammar.py).
    structured_output: StructuredOutput | None = None
    # Plugins (engine/plugins.py) run in the sampler, by name.
    logits_processors: tuple[LogitsProcessorSpec, ...] = attrs.field(default=(), converter=_as_processor_specs)

    def __attrs_post_init__(self) -> None:
        # Types first, so a wrong one is named rather than a TypeError below.
        for name in _NUMBER_FIELDS:
            value = getattr(self, name)
            _check(isinstance(value, int | float) and not isinstance(value, bool), name, f"must be a number, got {value!r}")
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be >= 1, got {self.n!r}")
        _check(
            self.temperature >= 0.0 and math.isfinite(self.temperature),
            "temperature",
            f"must be a finite number >= 0, got {self.temperature!r}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        _check(
            -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}"
        )
        _check(
            self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty),
            "repetition_penalty",
            f"must be a finite number > 0, got {self.repetition_penalty!r}",
        )
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"must be >= 1, got {self.max_tokens!r}",
        )
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(all(isinstance(s, str) for s in self.stop), "stop", f"must be strings, got {self.stop!r}")
        _check(all(s for s in self.stop), "stop", "must not contain an empty string")
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"must be between 0 and 20, got {self.logprobs!r}",
        )
        _check(
            all(-100.0 <= bias <= 100.0 for _, bias in self.logit_bias),
            "logit_bias",
            "values must be in [-100, 100]",
        )
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _check(
            all(isinstance(t, int) for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be integers, got {self.stop_token_ids!r}",
        )
        _check(
            self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
            "structured_output",
            f"must be a StructuredOutput, got {type(self.structured_output).__name__}",
        )
        _check(
            self.structured_output is None or not self.ignore_eos,
            "ignore_eos",
            "cannot be used with structured output (the grammar ends the output with EOS)",
        )

    @property
    def temperature(self) -> float:
        return NEUTRAL_SAMPLING["temperature"] if self._temperature is None else self._temperature

    @property
    def top_p(self) -> float:
        return NEUTRAL_SAMPLING["top_p"] if self._top_p is None else self._top_p

    @property
    def top_k(self) -> int:
        return NEUTRAL_SAMPLING["top_k"] if self._top_k is None else self._top_k  # type: ignore[return-value]

    @property
    def min_p(self) -> float:
        return NEUTRAL_SAMPLING["min_p"] if self._min_p is None else self._min_p

    @property
    def repetition_penalty(self) -> float:
        return NEUTRAL_SAMPLING["repetition_penalty"] if self._repetition_penalty is None else self._repetition_penalty

    @property
    def unset_fields(self) -> tuple[str, ...]:
        """The defaultable fields this request left out, in ``DEFAULTABLE_FIELDS`` order."""
        return tuple(name for name in DEFAULTABLE_FIELDS if getattr(self, "_" + name) is None)

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """These params with their unset fields taken from ``defaults`` (a
        mapping from field names to values; names it lacks stay unset).
        Set fields are kept as they are: the request's value wins."""
        fill = {name: defaults[name] for name in self.unset_fields if name in defaults}
        return attrs.evolve(self, **fill) if fill else self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty reads the output so far (and, for
        ``repetition_penalty``, the prompt)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Reject token ids outside the model's vocabulary."""
        for token_id, _ in self.logit_bias:
            _check(0 <= token_id < vocab_size, "logit_bias", f"has token id {token_id} outside the vocabulary [0, {vocab_size})")
        for token_id in self.stop_token_ids:
            _check(
                0 <= token_id < vocab_size, "stop_token_ids", f"has token id {token_id} outside the vocabulary [0, {vocab_size})"
            )
