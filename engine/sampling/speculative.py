"""Speculative decoding without a draft model: n-gram (prompt lookup)
proposals and their verification.

Proposing (scheduler side): the latest ``n`` tokens of a sequence are looked
up, ``n`` from ``max_ngram`` down to ``min_ngram``, among its earlier tokens
(prompt and output); at the most recent earlier match, the up to ``k``
tokens that followed it are the proposal. A sequence decoding ``t`` then
computes the chunk ``[t, d1 .. dk]`` in one forward that returns logits at
every position of the chunk.

How many tokens a sequence proposes adapts to its acceptance
(``NgramProposer.next_limit``): which tokens are proposed never depends on
the logits being verified, so neither output guarantee below changes.

Verifying (runner side), for one chunk's ``k + 1`` logit rows, each
processed as the sampler would (bias, temperature, top-k/top-p/min-p):

- greedy: accept the longest prefix of the proposal that equals the argmax
  at each position, then the model's own argmax after it, so the output is
  the one plain greedy decoding gives;
- sampled: each position's token is drawn from ``p_j`` exactly as a
  one-token step draws it (the same noise from the sequence's generator),
  and the proposal is kept while the draws agree with it; the first
  disagreeing draw, or a bonus draw from ``p_k`` after all ``k``, ends the
  chunk. A proposed ``x`` is kept with probability ``p_j(x)``, as
  rejection sampling of a one-hot draft would, each emitted token has the
  distribution ``p`` the plain sampler draws from, and a seeded sequence
  emits the same tokens with speculation on or off.

Sequences that do not speculate (the scheduler decides, ``may_speculate``):
structured output (the mask is for one position), logprobs, penalties
(they read the output, which the proposal would change per position), and a
sequence still short of ``min_tokens`` (the EOS ban depends on the position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from trioserve.engine.sampling.argmax import argmax
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.validators import integer_at_least

if TYPE_CHECKING:
    from trioserve.engine.config import EngineConfig

@attrs.frozen
class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` next tokens by prompt
    lookup, matching the latest ``max_ngram`` .. ``min_ngram`` tokens."""

    num_speculative_tokens: int = attrs.field(default=4, validator=integer_at_least(1))
    max_ngram: int = attrs.field(default=4, validator=integer_at_least(1))
    min_ngram: int = attrs.field(  # as EngineConfig.speculative_min_ngram
        default=attrs.Factory(lambda self: min(2, self.max_ngram), takes_self=True), validator=integer_at_least(1)
    )

    def __attrs_post_init__(self) -> None:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")

    def propose(self, token_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """Up to ``min(limit, num_speculative_tokens)`` tokens to follow
        ``token_ids``; () when no n-gram of it recurs (or ``limit < 1``)."""
        k = min(limit, self.num_speculative_tokens)
        length = len(token_ids)
        if k < 1 or length < 2:
            return ()
        tokens = list(token_ids)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            tail = tokens[length - n :]
            # The most recent earlier occurrence: recent text predicts best.
            for start in range(length - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return tuple(follow)
        return ()

    def next_limit(self, proposed: int, accepted: int) -> int:
        """The most tokens a sequence's next proposal may have, after
        ``accepted`` of its ``proposed`` were accepted: one more than were
        accepted, two more after a full acceptance, at most ``k``.

        A proposal's tokens each cost a verified row whether accepted or
        not, and where a text departs from its source (an edit, a new
        paragraph) the next proposals tend to fail too: shrinking to what was
        just accepted spends less there, while a run of full acceptances
        climbs back to ``k`` in a step or two.
        """
        assert 0 <= accepted <= proposed, (accepted, proposed)
        return min(self.num_speculative_tokens, accepted + (2 if accepted == proposed else 1))


def speculative_proposer(config: EngineConfig) -> NgramProposer | None:
    """The proposer ``config`` asks for, or None."""
    if config.speculative is None:
        return None
    return NgramProposer(
        num_speculative_tokens=config.num_speculative_tokens,
        max_ngram=config.speculative_max_ngram,
        min_ngram=config.speculative_min_ngram,
    )


def may_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a decoding sequence with these parameters may verify a
    proposal this step (see the module's docstring for why not)."""
    return (
        params.structured_output is None
        and not params.logits_processors  # they run in sample(), which a proposal's verification bypasses
        and params.logprobs is None
        and not params.has_penalties
        and num_output_tokens >= max(1, params.min_tokens)
    )


def verify_greedy(logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    """The tokens greedy decoding emits from ``logits`` [k + 1, V] (already
    processed) for the proposal ``draft`` (k tokens): the agreeing prefix
    and the model's own next token."""
    choice = argmax(logits).tolist()
    out: list[int] = []
    for j, token in enumerate(draft):
        out.append(choice[j])
        if choice[j] != token:
            return out
    out.append(choice[len(draft)])
    return out


def verify_sampled(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None) -> list[int]:
    """The tokens emitted for the one-hot proposal ``draft`` (k tokens)
    against the target distributions ``probs`` [k + 1, V]: each position's
    token is drawn as a one-token step draws it (the exponential race, one
    vocabulary of noise from ``generator`` a token), and the proposal is
    kept while it agrees; the first disagreeing draw, or the bonus draw
    after an agreeing run, ends it. Each token is distributed as the
    target's, a proposed token kept with probability p(token) (what
    rejection sampling gives a one-hot proposal), and a seeded sequence
    draws the same noise for the same token with speculation on or off, so
    it emits the same tokens either way (issue 39)."""
    out: list[int] = []
    for j, token in enumerate(draft):
        out.append(_draw(probs[j], generator))
        if out[-1] != token:
            return out
    out.append(_draw(probs[len(draft)], generator))
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    # Unnormalised weights are fine: the exponential race picks token i
    # with probability weights[i] / sum(weights).
    noise = torch.empty_like(weights).exponential_(generator=generator)
    noise.clamp_min_(torch.finfo(weights.dtype).tiny)
    return int(argmax(weights / noise, dim=0))
