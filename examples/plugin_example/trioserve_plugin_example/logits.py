"""Logits processors, chosen per request by name with their arguments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


class BanTokens:
    """``{"name": "ban_tokens", "args": {"token_ids": [...]}}``: never sample these tokens."""

    def __init__(self, args: Mapping[str, Any]) -> None:
        ids = args.get("token_ids")
        if not isinstance(ids, list | tuple) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError("token_ids must be a non-empty list of token ids")
        self.token_ids = list(ids)

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        ids = [t for t in self.token_ids if t < logits.shape[-1]]
        logits[ids] = float("-inf")
        return logits


class FailAfter:
    """``{"name": "fail_after", "args": {"tokens": k}}``: raise once ``k``
    tokens are out (to show that only its own request fails)."""

    def __init__(self, args: Mapping[str, Any]) -> None:
        tokens = args.get("tokens", 1)
        if not isinstance(tokens, int) or tokens < 0:
            raise ValueError("tokens must be an integer >= 0")
        self.tokens = tokens

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_token_ids) >= self.tokens:
            raise RuntimeError(f"fail_after: {len(output_token_ids)} tokens are out")
        return logits
