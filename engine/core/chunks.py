"""A request's part of one step: the chunk of tokens it runs (``chunk_for``),
and what the tokens it gets back do to it (``append_tokens``)."""

from __future__ import annotations

from trioserve.engine.core.sequence import FinishReason, Request
from trioserve.engine.runtime.step_plan import ScheduledChunk
from trioserve.engine.sampling.rows import SamplingRow


def chunk_for(
    request: Request,
    start: int,
    num_tokens: int,
    table: tuple[int, ...],
    draft: tuple[int, ...] = (),
    window_table: tuple[int, ...] | None = None,
) -> ScheduledChunk:
    """The chunk's value: its tokens sliced from the prompt or the output
    (a decode step copies one token, never the whole sequence), then a
    proposal to verify. ``num_tokens`` counts the proposal's tokens too.
    ``window_table``: the sequence's window-group table, passed through."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_tokens -= len(draft)
    end = start + num_tokens
    if start >= len(prompt):
        tokens = tuple(output[start - len(prompt) : end - len(prompt)])
    elif end <= len(prompt):
        tokens = tuple(prompt[start:end])
    else:
        tokens = (*prompt[start:], *output[: end - len(prompt)])
    sampling = None
    pooling = request.pooling
    if pooling is not None:
        # An embedding request never samples: its chunks keep the rows it pools.
        num_pooled = pooling.num_rows(start, num_tokens, len(prompt))
        return ScheduledChunk(request.request_id, start, tokens, table, window_block_ids=window_table,
                              pooling=pooling, num_pooled=num_pooled)  # fmt: skip
    if end == request.num_tokens:
        sampling = SamplingRow.for_sequence(
            request.request_id, request.sampling_params, prompt, output, request.eos_token_ids
        )
    targets: tuple[int, ...] = ()
    want = request.sampling_params.prompt_logprobs
    if want is not None:
        # Position p's logits give the logprob of prompt token p + 1.
        targets = tuple(prompt[start + 1 : min(end + 1, len(prompt))])
    return ScheduledChunk(
        request.request_id, start, tokens + draft, table, sampling, len(draft), window_table, targets, want or 0,
        lora=request.lora,
    )  # fmt: skip


def append_tokens(
    request: Request, chunk: ScheduledChunk, tokens: list[int], max_context_len: int
) -> FinishReason | None:
    """Advance ``request`` by its sampling chunk's result: ``tokens`` are the
    sampled token and, for a speculating chunk, the ones after it (its
    accepted proposals, then one more). Its computed tokens grow by the
    chunk less the proposal's rejected tokens (their slots are overwritten
    later); its output takes ``tokens`` up to the first stop. Returns that
    stop's reason, or None."""
    request.num_computed_tokens += chunk.num_tokens - chunk.num_draft_tokens + len(tokens) - 1
    reason = None
    for token in tokens:
        request.output_token_ids.append(token)
        reason = stop_reason(request, max_context_len)
        if reason is not None:
            break
    # Cut at a stop, accepted tokens past it are not computed tokens either.
    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
    return reason


def stop_reason(request: Request, max_context_len: int) -> FinishReason | None:
    """Why the request stops at its last output token (EOS, a stop token,
    ``max_tokens`` or the context limit), or None. EOS and stop tokens count
    only from ``min_tokens`` on."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    if request.num_tokens >= max_context_len:
        return FinishReason.LENGTH
    return None
