"""RequestInput: the rules of a request's fields that need no model, stated
once (engine/core/new_request.py), whichever edge builds it."""

from __future__ import annotations

import pytest

from trioserve.engine.core.new_request import NewRequest, RequestInput, as_prompt
from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.sampling.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", "hello"),
        ([1, 2, 3], (1, 2, 3)),
        ((0,), (0,)),
        ([{"role": "user", "content": "hi"}], ({"role": "user", "content": "hi"},)),
    ],
)
def test_a_prompt_is_text_token_ids_or_messages(prompt, expected):
    assert RequestInput(prompt).prompt == expected


@pytest.mark.parametrize(
    "prompt",
    ["", [], (), [-1], [1, -5], [True], [1, "a"], [{"role": "user"}, 3], 5, None, {"text": "a"}, "lone \ud800"],
)
def test_a_bad_prompt_names_the_prompt(prompt):
    with pytest.raises(InvalidRequestError) as info:
        RequestInput(prompt)
    assert info.value.field == "prompt"
    assert "prompt" in str(info.value)


def test_empty_prompts_are_refused_by_one_rule():
    for empty in ("", [], ()):
        with pytest.raises(InvalidRequestError, match="^prompt must not be empty$"):
            as_prompt(empty)


@pytest.mark.parametrize("priority", ["high", 1.5, True, None])
def test_priority_is_an_integer(priority):
    with pytest.raises(InvalidRequestError) as info:
        RequestInput("hi", SamplingParams(), priority)
    assert info.value.field == "priority"


def test_params_must_be_sampling_params():
    with pytest.raises(InvalidRequestError) as info:
        RequestInput("hi", {"temperature": 0})  # type: ignore[arg-type]
    assert info.value.field == "params"
    request = RequestInput("hi", priority=-3)
    assert request.params == SamplingParams() and request.priority == -3 and not request.is_chat
    assert RequestInput([{"role": "user", "content": "x"}]).is_chat


def test_a_new_request_holds_at_least_one_token():
    # A non-empty text can tokenize to nothing: the core's own value says so.
    with pytest.raises(InvalidRequestError) as info:
        NewRequest("r", (), SamplingParams())
    assert info.value.field == "prompt"
