"""Prompt logprobs: how likely the model found each prompt token.

The logits at a prompt position give the distribution of the next token,
so position ``p`` scores prompt token ``p + 1`` (the first prompt token has
no score). ``prompt_logprobs`` scores a chunk's targets from its rows of
logits: the raw model distribution (log-softmax of the logits, no
temperature, penalty or mask), as vLLM and OpenAI's ``echo`` report it.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch


@attrs.frozen
class PromptLogprob:
    """One prompt token's logprob and its ``rank`` in its position's
    distribution (1: the most likely), with the ``top`` most likely tokens
    of that position, most likely first (their ranks are 1, 2, ...)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@attrs.frozen
class ChunkPromptLogprobs:
    """A chunk's prompt logprobs: ``entries[i]`` scores the prompt token at
    position ``first_position + i``."""

    first_position: int
    entries: tuple[PromptLogprob, ...]


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> tuple[PromptLogprob, ...]:
    """Score ``targets[i]`` by row ``i`` of ``logits`` [len(targets), V],
    with the top ``k`` tokens of each row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(targets), dtype=torch.int64, device=logits.device).unsqueeze(-1)
    chosen = logprobs.gather(-1, index)  # [N, 1]
    # Ties count in the token's favour: rank 1 when nothing is more likely.
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = min(k, logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    chosen_list = chosen.squeeze(-1).tolist()
    rank_list = ranks.tolist()
    top_value_list, top_id_list = top_values.tolist(), top_ids.tolist()
    return tuple(
        PromptLogprob(int(token), chosen_list[i], rank_list[i], tuple(zip(top_id_list[i], top_value_list[i])))
        for i, token in enumerate(targets)
    )
