"""A scripted token path for a served model, through the plugins' own
door: the ``scripted`` logits processor makes a request's first output
tokens exactly ``token_ids`` (every other logit -inf), then leaves the
logits alone. A test writes what a reasoning model writes (``<think>``,
its thoughts, ``</think>``) with the tiny model this way, and lets the
grammar of the request's structured output drive the rest.

``scripted_plugin(monkeypatch)`` makes the entry point findable, as an
installed package's would be; the server then loads it with
``plugins=("scripted",)`` in its engine config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import torch

import trioserve.engine.plugins as engine_plugins

NAME = "scripted"


def scripted(args: dict[str, Any]) -> Callable[[Sequence[int], torch.Tensor], torch.Tensor]:
    """The processor of ``args["token_ids"]`` (a list of ints)."""
    script = args.get("token_ids")
    if not isinstance(script, list | tuple) or not all(type(i) is int and i >= 0 for i in script):
        raise ValueError("token_ids must be a list of token ids")
    script = tuple(script)

    def process(output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        done = len(output_token_ids)
        if done >= len(script):
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[script[done]] = 0.0
        return forced

    return process


def scripted_plugin(monkeypatch: Any) -> None:
    """Offer this module's ``scripted`` as an installed logits processor."""
    found = engine_plugins.available

    def available() -> dict[str, dict[str, metadata.EntryPoint]]:
        groups = found()
        group = engine_plugins.GROUPS["logits_processors"]
        entry = metadata.EntryPoint(name=NAME, value=f"{__name__}:scripted", group=group)
        groups[group] = {**groups[group], NAME: entry}
        return groups

    monkeypatch.setattr(engine_plugins, "available", available)


def script(tokenizer: Any, *texts: str) -> dict[str, Any]:
    """The request's ``logits_processors`` entry writing ``texts``, each
    encoded alone (so a marker such as ``</think>`` keeps the ids the
    server looks for, whatever text comes before it)."""
    ids = [int(i) for text in texts for i in tokenizer.encode(text, add_special_tokens=False)]
    return {"name": NAME, "args": {"token_ids": ids}}
