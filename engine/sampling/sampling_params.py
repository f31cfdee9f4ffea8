"""Per-request sampling parameters, validated at construction.

``SamplingParams``' validators are the one statement of each sampling
field's rule: every edge (the HTTP and gRPC APIs, ``Engine.generate``, the
CLI) builds one from what the caller sent, values as JSON has them, and maps
its ``InvalidRequestError`` (whose ``field`` names the field) to its own
error shape. Only the vocabulary's bound waits for the model
(``validate_for_vocab``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NoReturn

import attrs

from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.sampling.structured_output import StructuredOutput


# The bounds of the API's fields (OpenAI's, where it has them).
MAX_N = 128  # completions per request
MAX_LOGPROBS = 20  # top logprobs per token
MAX_LOGIT_BIAS = 100.0  # |bias| added to a token's logit


def _fail(field: str, message: str) -> NoReturn:
    raise InvalidRequestError(f"{field} {message}", field=field)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# -- the fields' rules: attrs validators raising InvalidRequestError ------------
# Each names the field as callers spell it (``attribute.alias``: an unset-able
# field is stored as ``_temperature`` but given as ``temperature``). A value
# of the wrong type fails like one out of range, so JSON's true, "2" or 1.5
# where an integer belongs are named too.


def _integer(low: int | None = None, high: int | None = None, *, optional: bool = False) -> Any:
    """The field must be an integer (not a bool) in [low, high]; with ``optional`` None too."""

    def check(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
        if value is None and optional:
            return
        if not _is_int(value):
            _fail(attribute.alias, f"must be an integer, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            bound = f"between {low} and {high}" if low is not None and high is not None else f">= {low}"
            _fail(attribute.alias, f"must be {bound}, got {value}")

    return check


def _number(low: float, high: float | None = None, *, low_open: bool = False, optional: bool = False) -> Any:
    """The field must be a finite number (not a bool) in [low, high] (``low_open``:
    (low, high]); with ``optional`` None too."""

    def check(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
        if value is None and optional:
            return
        if not _is_number(value):
            _fail(attribute.alias, f"must be a number, got {value!r}")
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an integer past any float
            finite = False
        too_low = value <= low if low_open else value < low
        if not finite or too_low or (high is not None and value > high):
            if high is None:
                bound = f"a finite number {'>' if low_open else '>='} {low:g}"
            else:
                bound = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
            _fail(attribute.alias, f"must be {bound}, got {value!r}")

    return check


def _boolean(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(attribute.alias, f"must be true or false, got {value!r}")


def _check_top_k(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not (_is_int(value) and value >= -1):
        _fail("top_k", f"must be -1, 0 (disabled) or a positive integer, got {value!r}")


def _check_stop(_instance: object, attribute: attrs.Attribute, value: tuple[Any, ...]) -> None:
    if not all(isinstance(s, str) for s in value):
        _fail("stop", f"must be a string or a list of strings, got {list(value)!r}")
    if not all(value):
        _fail("stop", "must not contain an empty string")


def _check_token_ids(_instance: object, attribute: attrs.Attribute, value: tuple[Any, ...]) -> None:
    bad = next((t for t in value if not (_is_int(t) and t >= 0)), None)
    if bad is not None:
        _fail(attribute.alias, f"must be token ids (integers >= 0), got {bad!r}")


def _check_structured_output(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, StructuredOutput):
        _fail("structured_output", f"must be a StructuredOutput, got {type(value).__name__}")


# -- converters: the shapes a field may be given in ---------------------------


def _as_float(value: Any) -> Any:
    """An int as a float, so every number field holds floats; anything else
    (an int past any float too) as it is, for the validator to judge."""
    if _is_int(value):
        try:
            return float(value)
        except OverflowError:
            return value
    return value


def _as_stop(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list | tuple):
        _fail("stop", f"must be a string or a list of strings, got {value!r}")
    return tuple(value)


def _as_token_ids(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        _fail("stop_token_ids", f"must be a list of token ids, got {value!r}")
    return tuple(value)


def _as_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (JSON's keys are strings: ``{"50256": -100}``)
    or its pairs, as sorted pairs; every id >= 0 and bias in [-100, 100]."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, list | tuple) and all(isinstance(item, list | tuple) and len(item) == 2 for item in value):
        items = list(value)
    else:
        _fail("logit_bias", f"must be an object mapping token ids to numbers, got {value!r}")
    bias = []
    for key, number in items:
        token_id = key if _is_int(key) else _int_or_none(key)
        if token_id is None or token_id < 0:
            _fail("logit_bias", f"keys must be token ids (integers >= 0), got {key!r}")
        if not (_is_number(number) and -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS):
            _fail("logit_bias", f"values must be numbers in [-100, 100], got {number!r}")
        bias.append((token_id, float(number)))
    return tuple(sorted(bias))


def _int_or_none(key: Any) -> int | None:
    if not isinstance(key, str):
        return None
    try:
        return int(key)
    except ValueError:
        return None


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

    n: int = attrs.field(default=1, validator=_integer(1, MAX_N))
    # Stored as None when unset; read through the properties below.
    _temperature: float | None = attrs.field(default=None, converter=_as_float, validator=_number(0.0, optional=True))
    _top_p: float | None = attrs.field(
        default=None, converter=_as_float, validator=_number(0.0, 1.0, low_open=True, optional=True)
    )
    _top_k: int | None = attrs.field(default=None, validator=_check_top_k)  # 0 or -1: no top-k
    _min_p: float | None = attrs.field(default=None, converter=_as_float, validator=_number(0.0, 1.0, optional=True))
    presence_penalty: float = attrs.field(default=0.0, converter=_as_float, validator=_number(-2.0, 2.0))
    frequency_penalty: float = attrs.field(default=0.0, converter=_as_float, validator=_number(-2.0, 2.0))
    _repetition_penalty: float | None = attrs.field(
        default=None, converter=_as_float, validator=_number(0.0, low_open=True, optional=True)
    )
    seed: int | None = attrs.field(default=None, validator=_integer(optional=True))
    max_tokens: int | None = attrs.field(default=16, validator=_integer(1, optional=True))  # None: up to the context limit
    min_tokens: int = attrs.field(default=0, validator=_integer(0))
    stop: tuple[str, ...] = attrs.field(default=(), converter=_as_stop, validator=_check_stop)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_token_ids, validator=_check_token_ids)
    include_stop_str_in_output: bool = attrs.field(default=False, validator=_boolean)
    ignore_eos: bool = attrs.field(default=False, validator=_boolean)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_as_bias)
    # None: none; k: the chosen token's logprob plus the top k.
    logprobs: int | None = attrs.field(default=None, validator=_integer(0, MAX_LOGPROBS, optional=True))
    # None: none; k: each prompt token's logprob (after the first) plus the
    # top k of its position, computed over the whole prompt (such a request
    # does not read the prefix cache: a cached position has no logits).
    prompt_logprobs: int | None = attrs.field(default=None, validator=_integer(0, MAX_LOGPROBS, optional=True))
    skip_special_tokens: bool = attrs.field(default=True, validator=_boolean)
    # Structured output: the output follows this schema, regex, choice or
    # grammar (a token mask each step; see engine/sampling/grammar.py).
    structured_output: StructuredOutput | None = attrs.field(default=None, validator=_check_structured_output)
    # Plugins (engine/plugins.py) run in the sampler, by name.
    logits_processors: tuple[LogitsProcessorSpec, ...] = attrs.field(default=(), converter=_as_processor_specs)

    def __attrs_post_init__(self) -> None:
        # The rules between fields, once each field has passed its own.
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.structured_output is not None and self.ignore_eos:
            _fail("ignore_eos", "cannot be used with structured output (the grammar ends the output with EOS)")

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
        """Reject token ids past the model's vocabulary (negative ones never get this far)."""
        for field, ids in (("logit_bias", [token_id for token_id, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            bad = next((token_id for token_id in ids if token_id >= vocab_size), None)
            if bad is not None:
                _fail(field, f"has token id {bad} outside the vocabulary [0, {vocab_size})")
