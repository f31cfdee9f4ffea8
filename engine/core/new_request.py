"""``NewRequest``: a request as the edge accepted it.

Everything a caller may get wrong is checked once, by
``EngineCore.validate``, where the model is known: the id, the prompt
(tokenized, every id in the vocabulary, short enough to fit with one
generated token), the sampling parameters against the vocabulary. What
comes out is this frozen value; the core, the scheduler and the actors take
it as given and only assert invariants.
"""

from __future__ import annotations

import attrs

from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.sampling.sampling_params import SamplingParams

# A request with n > 1 runs one sequence per completion, named
# "<request id>/<index>"; an id with this character could name another
# request's sequence, so ids may not contain it.
SEQUENCE_SEPARATOR = "/"


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
        raise InvalidRequestError("priority must be an integer", field="priority")
    return priority


@attrs.frozen
class NewRequest:
    """A validated request: what ``EngineCore.admit`` takes.

    Built by ``EngineCore.validate``; the checks that need no model run
    again here as validators, so no value of this type holds an unusable id
    or an empty prompt.
    """

    request_id: str = attrs.field(validator=lambda _, __, value: check_request_id(value))
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    params: SamplingParams = attrs.field(validator=attrs.validators.instance_of(SamplingParams))
    priority: int = attrs.field(default=0, validator=lambda _, __, value: check_priority(value))

    @prompt_token_ids.validator
    def _check_prompt(self, _attribute: object, value: tuple[int, ...]) -> None:
        if not value:
            raise InvalidRequestError("prompt must not be empty", field="prompt")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def sequence_ids(self) -> tuple[str, ...]:
        """The ids of its sequences: the request's own for ``n == 1``, one
        per completion otherwise."""
        if self.params.n == 1:
            return (self.request_id,)
        return tuple(f"{self.request_id}{SEQUENCE_SEPARATOR}{index}" for index in range(self.params.n))
