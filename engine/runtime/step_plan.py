"""The step plan: what one model step computes, as an immutable value.

The scheduler builds a ``StepPlan`` once per step; the runner executes it.
It is the whole boundary between them: every field is a frozen value (token
ids, positions, block tables, sampling rows), nothing refers to the
scheduler's live ``Request`` objects, and a plan pickles, so it can go to a
runner in another thread or another process and mean the same thing there.

What a runner keeps between steps is only what belongs to the sequence's
draws (a seeded request's random generator, a cached prompt tensor); it
drops that when a plan lists the sequence in ``released``.
"""

from __future__ import annotations

import attrs

from trioserve.engine.lora.registry import LoraRef
from trioserve.engine.sampling.pooling import Pooling
from trioserve.engine.sampling.rows import SamplingRow, TokenMask



@attrs.frozen
class ScheduledChunk:
    """Compute ``token_ids`` of a sequence at positions ``start ..
    start + num_tokens - 1``.

    ``block_ids`` is the sequence's block table, covering at least those
    positions. ``sampling`` is set when the chunk reaches the sequence's last
    known token, so the step samples its next token. A speculating chunk
    (engine/sampling/speculative.py) ends with ``num_draft_tokens`` proposed tokens
    after that last known token: the step wants logits at each of them and
    verifies the proposal. ``window_block_ids``: for a model whose
    sliding-window layers have a KV group of their own, the sequence's
    table there (engine/core/block_manager.py); None otherwise.
    ``prompt_targets``: for a request wanting prompt logprobs, the prompt
    tokens that follow the chunk's first ``len(prompt_targets)`` positions;
    the step then wants logits at every position and reports each target's
    logprob with the top ``prompt_logprobs`` tokens of its position.
    ``pooling``: for an embedding request (engine/sampling/pooling.py), which
    never samples, how its final hidden states pool; the step keeps the
    chunk's last ``num_pooled`` rows of them instead of logits.
    """

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    sampling: SamplingRow | None = None
    num_draft_tokens: int = 0
    window_block_ids: tuple[int, ...] | None = None
    prompt_targets: tuple[int, ...] = ()
    prompt_logprobs: int = 0
    pooling: Pooling | None = None
    num_pooled: int = 0
    # The LoRA adapter the chunk's tokens run with (engine/lora); None: the base model.
    lora: LoraRef | None = None

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[self.num_tokens - self.num_draft_tokens :]

    @property
    def num_logits(self) -> int:
        """Logit rows the step needs: one per verified position, or every
        position for prompt logprobs (the targets' rows first, the sampled
        row last), or the rows an embedding request pools."""
        if self.pooling is not None:
            return self.num_pooled
        if self.prompt_targets:
            return self.num_tokens
        return 1 + self.num_draft_tokens if self.sampling is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def samples(self) -> bool:
        return self.sampling is not None

    @property
    def is_decode(self) -> bool:
        """It computes only the token sampled last step (else it is prompt,
        or output recomputed after a preemption)."""
        return (
            self.num_tokens - self.num_draft_tokens == 1
            and self.sampling is not None
            and self.sampling.num_output_tokens > 0
        )



@attrs.frozen
class StepPlan:
    """One step for the runner: ``chunks`` in batch order, and the
    sequences ended since the runner's last step (``released``), whose
    per-sequence sampling state it may drop before running the chunks (an
    id may come back in a chunk of the same plan as a new request), and the
    allowed tokens of its constrained rows (``token_mask``).

    ``awaits_mask``: the plan has constrained rows whose mask is still being
    filled; it follows the plan as a message of its own, and the runner
    runs the forward meanwhile and samples once it has it
    (``ModelRunner.forward_step`` / ``sample_step``). ``token_mask`` is then
    None."""

    chunks: tuple[ScheduledChunk, ...]
    released: tuple[str, ...] = ()
    token_mask: TokenMask | None = None  # structured output's allowed tokens
    awaits_mask: bool = False

    def __attrs_post_init__(self) -> None:
        assert not (self.awaits_mask and self.token_mask is not None), "a plan awaits its mask or carries it, not both"

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
