"""What the engine core reports for a request after each step."""

from __future__ import annotations

import attrs

from trioserve.engine.sampling.prompt_logprobs import PromptLogprob
from trioserve.engine.sampling.sampler import TokenLogprobs
from trioserve.engine.core.sequence import FinishReason


@attrs.frozen
class RequestTimes:
    """Monotonic timestamps (``time.monotonic()``) of a completion's timeline,
    for metrics and traces: ``arrival`` (queued), ``admitted`` (the core took
    it from the admission queue), ``first_scheduled``, ``first_token``,
    ``preemptions`` (each time the scheduler took its blocks for room,
    oldest first; not pauses for a slow reader) and ``now`` (this output)."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    now: float
    admitted: float | None = None
    preemptions: tuple[float, ...] = ()


@attrs.frozen
class RequestOutput:
    """One step's news for one completion of a request.

    ``index`` tells the ``n`` completions of one request apart. The last
    output of a completion has ``finish_reason`` set; its ``text_delta``
    includes any text the detokenizer held back. ``prompt_logprobs``: when
    the request asked for them, the first output with a token carries them,
    one per prompt token after the first (position 1 on), and
    ``prompt_token_ids`` (all of them, so the first is known too).
    ``embedding``: an embedding request's vector, on its final output
    when it finished with its prompt computed (``FinishReason.STOP``).
    """

    request_id: str
    index: int
    new_token_ids: tuple[int, ...]
    text_delta: str
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: FinishReason | None
    stop_reason: str | int | None  # the stop string or stop token that ended it, if any
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    times: RequestTimes
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    embedding: tuple[float, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
