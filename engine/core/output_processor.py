"""What the core reports of its requests: each completion's detokenizer and
times, the ``RequestOutput`` of every step, and the requests that failed.

A request with ``n`` completions runs one sequence per completion; the
processor knows which request each sequence belongs to, and forgets a
request once each of its completions has reported its final output. A
fault of the detokenizer (or a logits processor, or a grammar) fails only
its request: the failure is kept until the caller takes it
(``take_failures``); the detokenizer's are counted, and the latest kept,
for ``/health``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from trioserve.engine.core.outputs import RequestOutput, RequestTimes
from trioserve.engine.core.scheduler_output import SchedulerOutput
from trioserve.engine.core.sequence import FinishReason, Request
from trioserve.engine.faults import Fault
from trioserve.engine.plugins import PluginError
from trioserve.engine.sampling.grammar import GrammarMatchers
from trioserve.engine.sampling.pooling import ChunkPooled, PooledState
from trioserve.engine.sampling.prompt_logprobs import ChunkPromptLogprobs, PromptLogprob
from trioserve.engine.sampling.sampler import TokenLogprobs
from trioserve.engine.text.detokenizer import DetokenizerDelta, IncrementalDetokenizer

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class Completion:
    """The core's bookkeeping of one of a request's ``n`` completions."""

    request: Request
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    first_scheduled: float | None = None
    first_token: float | None = None
    admitted: float = attrs.field(factory=time.monotonic)
    preemptions: tuple[float, ...] = ()
    # The prompt logprobs scored so far, position 1 on (prompt_logprobs
    # asked); reported once, with the first output once all are in.
    prompt_logprobs: list[PromptLogprob] = attrs.field(factory=list)
    prompt_logprobs_reported: bool = False
    # An embedding request's pooled rows so far (engine/sampling/pooling.py).
    pooled: PooledState | None = None

    def add_prompt_logprobs(self, scored: ChunkPromptLogprobs) -> None:
        """Keep a chunk's prompt logprobs. A chunk recomputed after a
        preemption scores positions already kept: only new ones count."""
        known = 1 + len(self.prompt_logprobs)  # the next position to score
        skip = known - scored.first_position
        if 0 <= skip < len(scored.entries):
            self.prompt_logprobs.extend(scored.entries[skip:])

    def take_prompt_logprobs(self) -> tuple[PromptLogprob, ...] | None:
        """The whole prompt's logprobs the first time they are all in, else None."""
        request = self.request
        if self.prompt_logprobs_reported or request.sampling_params.prompt_logprobs is None:
            return None
        if len(self.prompt_logprobs) < request.num_prompt_tokens - 1:
            return None
        self.prompt_logprobs_reported = True
        return tuple(self.prompt_logprobs)


@attrs.define(eq=False)
class OutputProcessor:
    """The completions of the core's requests, by sequence id, and their
    outputs. ``grammars``: the constrained sequences' matchers, dropped with
    their completion."""

    tokenizer: Any
    grammars: GrammarMatchers
    _completions: dict[str, Completion] = attrs.field(init=False, factory=dict)  # by sequence id
    _children: dict[str, tuple[str, ...]] = attrs.field(init=False, factory=dict)  # request id -> sequence ids
    _failures: dict[str, Exception] = attrs.field(init=False, factory=dict)  # request id -> its error
    num_detokenizer_errors: int = attrs.field(init=False, default=0)
    last_fault: Fault | None = attrs.field(init=False, default=None)

    # -- the requests ---------------------------------------------------------

    def new_detokenizer(self, prompt_ids: list[int], request: Request) -> IncrementalDetokenizer:
        """A detokenizer for ``request``'s output; it decodes the prompt's
        tail, so the tokenizer may raise here."""
        params = request.sampling_params
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def add(self, request_id: str, completions: list[Completion]) -> None:
        """Start reporting a request's completions (its grammar's matchers start too)."""
        for completion in completions:
            sequence_id = completion.request.request_id
            self._completions[sequence_id] = completion
            constraint = completion.request.sampling_params.structured_output
            if constraint is not None:
                self.grammars.add(sequence_id, constraint)
        self._children[request_id] = tuple(c.request.request_id for c in completions)

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self._completions

    def get(self, sequence_id: str) -> Completion | None:
        return self._completions.get(sequence_id)

    def children(self, request_id: str) -> tuple[str, ...] | None:
        """The sequence ids of a request still reported, or None."""
        return self._children.get(request_id)

    def parent_of(self, sequence_id: str) -> str | None:
        """The request id a completion's sequence id belongs to."""
        completion = self._completions.get(sequence_id)
        return None if completion is None else completion.parent_id

    def __len__(self) -> int:
        """How many requests are still reported."""
        return len(self._children)

    def forget(self, completion: Completion) -> None:
        sequence_id = completion.request.request_id
        del self._completions[sequence_id]
        self.grammars.remove(sequence_id)
        siblings = self._children[completion.parent_id]
        if all(child not in self._completions for child in siblings):
            del self._children[completion.parent_id]

    # -- outputs ------------------------------------------------------------------

    def add_prompt_logprobs(self, scored: Mapping[str, ChunkPromptLogprobs]) -> None:
        """Keep a step's prompt logprobs with their completions."""
        for sequence_id, chunk in scored.items():
            completion = self._completions.get(sequence_id)
            if completion is not None:
                completion.add_prompt_logprobs(chunk)

    def add_pooled(self, shares: Mapping[str, ChunkPooled]) -> None:
        """Add a step's pooled rows to their embedding requests."""
        for sequence_id, share in shares.items():
            completion = self._completions.get(sequence_id)
            if completion is not None and completion.pooled is not None:
                completion.pooled.add(share)

    def step_started(self, ended: list[Request], plan: SchedulerOutput, now: float) -> list[RequestOutput]:
        """Note which completions ``plan`` scheduled for the first time or
        preempted; return the final outputs of those in ``ended`` (ended
        between steps: aborts, deadlines) not reported yet."""
        outputs = []
        for request in ended:
            completion = self._completions.get(request.request_id)
            if completion is not None:
                outputs.append(self.final_output(completion, (), "", (), now))
        for chunk in plan.chunks:
            completion = self._completions.get(chunk.request_id)
            if completion is not None and completion.first_scheduled is None:
                completion.first_scheduled = now
        for request_id in plan.preempted:
            completion = self._completions.get(request_id)
            if completion is not None:
                completion.preemptions += (now,)
        return outputs

    @staticmethod
    def detokenize(completion: Completion, token_ids: tuple[int, ...]) -> tuple[tuple[int, ...], DetokenizerDelta]:
        """Feed a step's tokens to the completion's detokenizer one at a
        time, so a stop string ends the output where plain decoding would:
        the tokens after it are taken off the request's output. Returns the
        tokens kept and their delta."""
        if len(token_ids) == 1:
            return token_ids, completion.detokenizer.add_tokens(token_ids)
        texts = []
        for j, token_id in enumerate(token_ids):
            delta = completion.detokenizer.add_tokens([token_id])
            texts.append(delta.text)
            if delta.stop_str is not None:
                dropped = len(token_ids) - j - 1
                if dropped:
                    request = completion.request
                    del request.output_token_ids[-dropped:]
                    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                return token_ids[: j + 1], attrs.evolve(delta, text="".join(texts))
        return token_ids, attrs.evolve(delta, text="".join(texts))

    def final_output(
        self,
        completion: Completion,
        token_ids: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprobs, ...],
        now: float,
        stop_str: str | None = None,
    ) -> RequestOutput:
        """The completion's last output (with what its detokenizer held
        back, unless a stop string or an error ended it); it is forgotten."""
        request = completion.request
        reason = request.finish_reason
        assert reason is not None, f"{request.request_id} reported finished without a reason"
        if stop_str is None and reason is not FinishReason.ERROR:
            try:
                text += completion.detokenizer.finish()
            except Exception as exc:
                self.detokenizer_failed(completion, exc)
        stop_reason: str | int | None = stop_str
        if stop_reason is None and reason is FinishReason.STOP and request.output_token_ids:
            last = request.output_token_ids[-1]
            if last in request.sampling_params.stop_token_ids:
                stop_reason = last
        self.forget(completion)
        return self.output(completion, token_ids, text, logprobs, now, reason, stop_reason)

    @staticmethod
    def output(
        completion: Completion,
        token_ids: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprobs, ...],
        now: float,
        reason: FinishReason | None = None,
        stop_reason: str | int | None = None,
    ) -> RequestOutput:
        request = completion.request
        prompt_logprobs = completion.take_prompt_logprobs() if token_ids else None
        embedding = None
        if reason is FinishReason.STOP and completion.pooled is not None:
            embedding = completion.pooled.embedding()
        return RequestOutput(
            request_id=completion.parent_id,
            index=completion.index,
            new_token_ids=tuple(token_ids),
            text_delta=text,
            logprobs=tuple(logprobs),
            finish_reason=reason,
            stop_reason=stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            times=RequestTimes(
                arrival=request.arrival_time,
                first_scheduled=completion.first_scheduled,
                first_token=completion.first_token,
                now=now,
                admitted=completion.admitted,
                preemptions=completion.preemptions,
            ),
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=None if prompt_logprobs is None else tuple(request.prompt_token_ids),
            embedding=embedding,
        )

    # -- failures -----------------------------------------------------------------

    def detokenizer_failed(self, completion: Completion, exc: Exception) -> None:
        if completion.parent_id in self._failures:
            return
        message = f"the detokenizer failed on this request's output ({type(exc).__name__})"
        self.num_detokenizer_errors += 1
        self.last_fault = Fault("detokenizer_failed", message)
        log.warning("request %s: %s", completion.parent_id, message)
        self._failures[completion.parent_id] = exc

    def plugin_failed(self, completion: Completion, error: PluginError) -> None:
        """A logits processor raised on this sequence: fail its request
        (as a detokenizer failure does)."""
        if completion.parent_id in self._failures:
            return
        log.warning("request %s: %s", completion.parent_id, error)
        self._failures[completion.parent_id] = error

    def fail(self, request_id: str, error: Exception) -> bool:
        """Fail a request with ``error`` unless it has failed already;
        returns whether it is newly failed."""
        if request_id in self._failures:
            return False
        self._failures[request_id] = error
        return True

    def failed(self) -> Iterator[str]:
        """The ids of the requests failed since the last ``take_failures``."""
        return iter(list(self._failures))

    def take_failures(self) -> dict[str, Exception]:
        """The requests whose detokenizer (or logits processor, a
        ``PluginError``, or grammar) failed since the last call, with its
        exception."""
        failures, self._failures = self._failures, {}
        return failures
