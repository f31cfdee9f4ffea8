"""SamplingParams rejects bad values with an error that names the field."""

import math

import attrs
import pytest

from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.sampling.sampling_params import SamplingParams

BAD_VALUES = [
    ("n", 0),
    ("n", -3),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.2),
    ("top_k", -2),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("min_tokens", -1),
    ("logprobs", 21),
    ("logprobs", -1),
    ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: -101}),
    ("logit_bias", {"not-a-token": 1.0}),
    ("stop", ["ok", ""]),
    ("stop_token_ids", ["x"]),
    ("seed", 1.5),
    # Wrong types name the field too, rather than escaping as a TypeError.
    ("temperature", "hot"),
    ("top_p", "wide"),  # None is no wrong type: it leaves top_p to the model's default
    ("min_p", [0.1]),
    ("presence_penalty", True),
    ("stop", [1]),
    # The types JSON can send where they do not belong (the HTTP API hands
    # its values over as they come: these rules are the only ones).
    ("n", True),
    ("n", 1.5),
    ("n", "2"),
    ("n", 129),
    ("top_k", True),
    ("top_k", 2.5),
    ("seed", True),
    ("max_tokens", "10"),
    ("min_tokens", False),
    ("logprobs", True),
    ("temperature", 10**400),
    ("stop", 3),
    ("stop", ""),
    ("stop_token_ids", "x"),
    ("stop_token_ids", [True]),
    ("ignore_eos", 1),
    ("include_stop_str_in_output", "yes"),
    ("skip_special_tokens", None),
    ("logit_bias", {"5": True}),
    ("logit_bias", {"5": "1"}),
    ("logit_bias", [1, 2]),
    ("logit_bias", "x"),
    # Negative token ids are no model's: refused before the vocabulary is known.
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"-1": 1.0}),
    ("stop_token_ids", [-1]),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_names_its_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert field in str(info.value)


def test_min_tokens_above_max_tokens_names_min_tokens():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(min_tokens=10, max_tokens=5)
    assert info.value.field == "min_tokens"
    assert "max_tokens" in str(info.value)


def test_invalid_request_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 16, "min_tokens": 0, "logprobs": None}),
        ({"temperature": 0.0}, {"temperature": 0.0, "greedy": True}),
        ({"top_p": 1.0, "top_k": -1, "min_p": 1.0}, {"top_p": 1.0, "top_k": -1, "min_p": 1.0}),
        (
            {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.3},
            {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.3},
        ),
        ({"max_tokens": None, "min_tokens": 100}, {"max_tokens": None, "min_tokens": 100}),
        ({"max_tokens": 1, "min_tokens": 1}, {"max_tokens": 1, "min_tokens": 1}),
        ({"logprobs": 0}, {"logprobs": 0}),
        ({"logprobs": 20}, {"logprobs": 20}),
        ({"logit_bias": {"7": -100, 3: 100}}, {"logit_bias": ((3, 100.0), (7, -100.0))}),
        ({"seed": -(2**63)}, {"seed": -(2**63)}),
    ],
)
def test_good_values_are_kept(kwargs, expected):
    params = SamplingParams(**kwargs)
    assert {name: getattr(params, name) for name in expected} == expected


def test_conversions():
    params = SamplingParams(stop="END", logit_bias={"7": -100, 3: 2}, stop_token_ids=[4, 9])
    assert params.stop == ("END",)
    assert params.logit_bias == ((3, 2.0), (7, -100.0))
    assert params.stop_token_ids == (4, 9)
    # Numbers are held as floats whatever JSON gave; evolve keeps the value.
    params = SamplingParams(temperature=0, presence_penalty=-2, top_p=1)
    assert [type(v) for v in (params.temperature, params.presence_penalty, params.top_p)] == [float] * 3
    assert attrs.evolve(params, n=2).logit_bias == params.logit_bias
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {100: 1.0}}, "logit_bias"),
        ({"stop_token_ids": [3, 100]}, "stop_token_ids"),
    ],
)
def test_validate_for_vocab_rejects_unknown_token_ids(kwargs, field):
    params = SamplingParams(**kwargs)
    with pytest.raises(InvalidRequestError) as info:
        params.validate_for_vocab(100)
    assert info.value.field == field
    assert "100" in str(info.value)


def test_validate_for_vocab_bounds_are_exact():
    # Ids 0 and 99 fit a vocabulary of 100; 99 is one past a vocabulary of 99.
    params = SamplingParams(logit_bias={0: 1.0, 99: -1.0}, stop_token_ids=[0, 99])
    assert params.validate_for_vocab(100) is None
    with pytest.raises(InvalidRequestError, match="token id 99 outside the vocabulary") as info:
        params.validate_for_vocab(99)
    assert info.value.field == "logit_bias"
