"""Fixtures shared across the suite.

The default model (SmolLM2-135M-Instruct) is loaded once per session; its
GGUF is converted into the user's trioserve cache the first time, so later
runs start warm.
"""

from __future__ import annotations

import pytest
import torch

from trioserve.engine.config import EngineConfig
from trioserve.engine.engine_core import EngineCore
from trioserve.engine.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def default_loaded() -> LoadedModel:
    """The default model, float32 on CPU."""
    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    # Two cores: keep torch from oversubscribing them while pytest and the
    # event loop also need a slice.
    torch.set_num_threads(2)


def make_core(loaded: LoadedModel, **config) -> EngineCore:
    """An EngineCore on an already loaded model, with a small KV pool by default."""
    config.setdefault("kv_cache_memory", 64 << 20)
    return EngineCore(loaded, EngineConfig(**config))
