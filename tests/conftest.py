"""Fixtures shared across the suite.

The default model (SmolLM2-135M-Instruct) is loaded once per session; its
GGUF is converted into the user's trioserve cache the first time, so later
runs start warm.
"""

from __future__ import annotations

import os

import pytest
import torch

from trioserve.engine.config import EngineConfig
from trioserve.engine.engine_core import EngineCore
from trioserve.engine.loader import LoadedModel, load_model

# Where the model/KV-path tests put the model, its KV cache and its batches:
# "cpu" (the default) or "cuda" / "cuda:N" (TRIOSERVE_TEST_DEVICE=cuda), so
# the same tests check the CUDA path on a machine that has one.
TEST_DEVICE = os.environ.get("TRIOSERVE_TEST_DEVICE", "cpu")
ON_CUDA = torch.device(TEST_DEVICE).type == "cuda"

# float32 tests compare against float32 references at 1e-4 or tighter: keep
# CUDA matmuls in full float32 (no TF32). No effect on CPU.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def pytest_configure(config):
    if ON_CUDA and not torch.cuda.is_available():
        raise pytest.UsageError(f"TRIOSERVE_TEST_DEVICE={TEST_DEVICE}, but CUDA is not available")


@pytest.fixture(scope="session")
def default_loaded() -> LoadedModel:
    """The default model, float32 on TEST_DEVICE (CPU unless TRIOSERVE_TEST_DEVICE says otherwise)."""
    return load_model(None, dtype="float32", device=TEST_DEVICE)


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    # Two cores: keep torch from oversubscribing them while pytest and the
    # event loop also need a slice.
    torch.set_num_threads(2)


def make_core(loaded: LoadedModel, **config) -> EngineCore:
    """An EngineCore on an already loaded model, with a small KV pool by default."""
    config.setdefault("kv_cache_memory", 64 << 20)
    return EngineCore(loaded, EngineConfig(**config))
