"""A scheduling policy: shortest prompt first."""

from __future__ import annotations

from typing import Any

from trioserve.engine.config import EngineConfig


class ShortestPromptFirst:
    """Waiting requests run shortest prompt first (then by priority, then
    arrival); a waiting request may preempt running ones whose prompt is
    more than twice as long. Made once per engine from its config."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def key(self, request: Any, age: int) -> tuple[int, int, int]:
        return (request.num_prompt_tokens, request.priority, request.arrival_index)

    def outranks(self, key_a: tuple[int, ...], key_b: tuple[int, ...]) -> bool:
        return 2 * key_a[0] < key_b[0]
