"""A small synchronous generation loop, for the command line and examples."""

from __future__ import annotations

from collections.abc import Iterator

from .config import EngineConfig
from .engine_core import EngineCore, Prompt
from .sampling_params import SamplingParams


def generate_greedy(config: EngineConfig, prompt: Prompt, *, max_tokens: int = 64) -> Iterator[str]:
    """Yield the text of a greedy continuation of ``prompt``, piece by piece."""
    core = EngineCore.from_config(config)
    try:
        core.add_request("generate", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        while core.has_unfinished():
            for output in core.step():
                if output.text_delta:
                    yield output.text_delta
    finally:
        core.close()  # a tensor-parallel group's ranks
