"""The outputs a request's reader hands out that no step made as such.

``Delta`` merges the outputs of one completion that a reader takes at once
(the reader coalesces: request.py). ``final_output`` is the last output of a
completion that ends outside a step: its deadline passed on the caller's
side, or it was dropped before it was scheduled.
"""

from __future__ import annotations

import time

import attrs

from trioserve.engine.core.outputs import RequestOutput, RequestTimes
from trioserve.engine.core.sequence import FinishReason
from trioserve.engine.sampling.sampler import TokenLogprobs


def final_output(
    request_id: str,
    index: int,
    reason: FinishReason,
    *,
    num_prompt_tokens: int,
    arrival_time: float,
    last: RequestOutput | None = None,
) -> RequestOutput:
    """A final output with no new tokens, for a completion that ends outside
    a step (its deadline passed on the caller's side, or it was dropped
    before it was scheduled). ``last`` is its latest output, if any."""
    now = time.monotonic()
    if last is not None:
        return attrs.evolve(
            last,
            new_token_ids=(),
            text_delta="",
            logprobs=(),
            finish_reason=reason,
            stop_reason=None,
            times=attrs.evolve(last.times, now=now),
        )
    return RequestOutput(
        request_id=request_id,
        index=index,
        new_token_ids=(),
        text_delta="",
        logprobs=(),
        finish_reason=reason,
        stop_reason=None,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=0,
        num_cached_tokens=0,
        times=RequestTimes(arrival=arrival_time, first_scheduled=None, first_token=None, now=now),
    )


@attrs.define
class Delta:
    """Outputs of one completion merged into one: tokens, text and logprobs
    concatenated, everything else from the latest."""

    token_ids: list[int] = attrs.field(factory=list)
    text: list[str] = attrs.field(factory=list)
    logprobs: list[TokenLogprobs] = attrs.field(factory=list)
    last: RequestOutput | None = None
    # The prompt's logprobs come once, with an early output: kept.
    prompt: RequestOutput | None = None

    count: int = 0

    def add(self, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self.prompt = output
        self.token_ids.extend(output.new_token_ids)
        self.text.append(output.text_delta)
        self.logprobs.extend(output.logprobs)
        self.last = output
        self.count += 1

    def build(self) -> RequestOutput:
        assert self.last is not None
        if self.count == 1:
            return self.last  # nothing to merge
        return attrs.evolve(
            self.last,
            new_token_ids=tuple(self.token_ids),
            text_delta="".join(self.text),
            logprobs=tuple(self.logprobs),
            prompt_logprobs=None if self.prompt is None else self.prompt.prompt_logprobs,
            prompt_token_ids=None if self.prompt is None else self.prompt.prompt_token_ids,
        )
