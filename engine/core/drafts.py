"""Speculative drafts in the scheduler: which decoding sequences run a
proposal this step, and what their verification accepted.

A decoding sequence that may speculate (``may_speculate``,
engine/sampling/speculative.py) runs ``[last token, proposal]`` when the
proposal's tokens and blocks fit what is left of the step: speculation
never preempts anyone. Its proposal is cut to the room left before a
length limit (past it the tokens would be cut anyway) and to the
sequence's ``draft_limit``, which adapts to how many of its last proposal
were accepted.
"""

from __future__ import annotations

import math

import attrs

from trioserve.engine.core.sequence import Request
from trioserve.engine.sampling.speculative import NgramProposer, may_speculate


@attrs.define
class Drafts:
    """The proposals planned this step, by sequence id, and the counts of
    tokens proposed and accepted since the start. The proposer is the
    scheduler's (it may be swapped between steps), passed to each call."""

    _planned: dict[str, tuple[int, ...]] = attrs.field(init=False, factory=dict)
    num_draft_tokens: int = attrs.field(init=False, default=0)
    num_accepted_tokens: int = attrs.field(init=False, default=0)

    def clear(self) -> None:
        """Forget the last step's proposals (a new step is planned)."""
        self._planned.clear()

    def plan(
        self,
        request: Request,
        proposer: NgramProposer,
        *,
        tokens_left: int,
        free_blocks: int,
        num_blocks: int,
        max_context_len: int,
        block_size: int,
    ) -> tuple[int, int]:
        """A decoding request's tokens and new blocks this step with its
        proposal, if it may speculate and the proposal fits ``tokens_left``
        and ``free_blocks`` (else its plain 1 token and ``num_blocks``)."""
        params = request.sampling_params
        if not may_speculate(params, request.num_output_tokens):
            return 1, num_blocks
        # Room for the proposal and the token after it.
        limit = min(tokens_left - 1, max_context_len - request.num_tokens)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
        if request.draft_limit is not None:
            limit = min(limit, request.draft_limit)
        draft = proposer.propose(request.all_token_ids, limit)
        if not draft:
            return 1, num_blocks
        num_tokens = 1 + len(draft)
        blocks = max(0, math.ceil((request.num_computed_tokens + num_tokens) / block_size) - len(request.block_ids))
        if blocks > free_blocks:
            return 1, num_blocks  # speculation never preempts
        self._planned[request.request_id] = draft
        return num_tokens, blocks

    def take(self, request_id: str) -> tuple[int, ...]:
        """The proposal planned for this sequence (``()`` if none), now in its chunk."""
        return self._planned.pop(request_id, ())

    def drop(self, request_id: str) -> None:
        """The sequence was preempted while planning: no proposal for it."""
        self._planned.pop(request_id, None)

    def verified(self, request: Request, proposer: NgramProposer, num_draft_tokens: int, num_accepted: int) -> None:
        """Count a verified proposal and set the sequence's next ``draft_limit``."""
        assert num_accepted <= num_draft_tokens, f"{num_accepted} tokens accepted of {num_draft_tokens}"
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        request.draft_limit = proposer.next_limit(num_draft_tokens, num_accepted)
