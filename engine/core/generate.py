"""A small synchronous generation loop, for the command line and examples."""

from __future__ import annotations

from collections.abc import Iterator

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore, Prompt
from trioserve.engine.loading.generation_config import load_sampling_defaults
from trioserve.engine.sampling.sampling_params import SamplingParams


def generate(config: EngineConfig, prompt: Prompt, params: SamplingParams) -> Iterator[str]:
    """Yield the text of a continuation of ``prompt``, piece by piece,
    sampled with ``params``; the sampling fields it leaves unset take the
    model's defaults (``config.generation_config``), as a server's
    requests do."""
    defaults = load_sampling_defaults(config.generation_config, config.model)
    core = EngineCore.from_config(config)
    try:
        core.add_request("generate", prompt, defaults.apply(params))
        while core.has_unfinished():
            for output in core.step():
                if output.text_delta:
                    yield output.text_delta
    finally:
        core.close()  # a tensor-parallel group's ranks


def generate_greedy(config: EngineConfig, prompt: Prompt, *, max_tokens: int = 64) -> Iterator[str]:
    """Yield the text of a greedy continuation of ``prompt``, piece by piece."""
    return generate(config, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
