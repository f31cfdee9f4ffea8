"""Fixtures shared across the suite.

The default model (SmolLM2-135M-Instruct) is loaded once per session; its
GGUF is converted into the user's trioserve cache the first time, so later
runs start warm.

The CPU paths this machine runs (``CpuPaths``, trials of oneDNN packing and
of each dtype's matmul) are detected once at start and printed in the
session header; tests of a capability-dependent path take them from the
``cpu_paths`` fixture, check the fallback where a path is missing, and are
marked ``cpu_paths``. ``.ci/run`` runs those a second time with the
fallbacks forced (``TRIOSERVE_CPU_ASSUME=avx2``, oneDNN and ATen capped at
AVX2), as on an AVX2-only CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from trioserve.engine.kernels import native
from trioserve.engine.kernels.capability import CpuPaths
from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.errors import CpuCapabilityError
from trioserve.engine.loading.loader import LoadedModel, load_model
from trioserve.web import batch_store

# Where the model/KV-path tests put the model, its KV cache and its batches:
# "cpu" (the default) or "cuda" / "cuda:N" (TRIOSERVE_TEST_DEVICE=cuda), so
# the same tests check the CUDA path on a machine that has one.
TEST_DEVICE = os.environ.get("TRIOSERVE_TEST_DEVICE", "cpu")
ON_CUDA = torch.device(TEST_DEVICE).type == "cuda"

# float32 tests compare against float32 references at 1e-4 or tighter: keep
# CUDA matmuls in full float32 (no TF32). No effect on CPU.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


_CPU_PATHS = pytest.StashKey[CpuPaths]()


def pytest_configure(config):
    if ON_CUDA and not torch.cuda.is_available():
        raise pytest.UsageError(f"TRIOSERVE_TEST_DEVICE={TEST_DEVICE}, but CUDA is not available")
    try:
        config.stash[_CPU_PATHS] = CpuPaths.from_environment()
    except CpuCapabilityError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config):
    paths = config.stash[_CPU_PATHS]
    forced = ", ".join(p.name for p in paths.forced) or "none"
    missing = ", ".join(p.name for p in paths.paths if not p.available) or "none"
    return [
        *paths.describe(),
        f"CPU fallbacks exercised: {missing} (forced: {forced})",
    ]


@pytest.fixture(scope="session")
def cpu_paths(pytestconfig) -> CpuPaths:
    """The CPU paths detected at the session's start (see the header)."""
    return pytestconfig.stash[_CPU_PATHS]


@pytest.fixture(scope="session")
def isas() -> tuple[str, ...]:
    """The native kernels' ISA variants this CPU runs; the native tests skip
    without a build, except under CI, where setup must have built them."""
    try:
        return native.cpu_isas()
    except native.NativeUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"scripts/setup.sh must build the native kernels under CI: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def default_loaded() -> LoadedModel:
    """The default model, dequantized to float32 on TEST_DEVICE (CPU unless TRIOSERVE_TEST_DEVICE says otherwise)."""
    return load_model(None, dtype="float32", device=TEST_DEVICE, quantization="none")


@pytest.fixture(scope="session", autouse=True)
def _batch_dir(tmp_path_factory):
    # Every app without --batch-dir keeps the Batch API's batches in the
    # default folder and resumes the unfinished ones it finds there: the
    # test servers get a folder of this session's own, so a batch a test
    # left unfinished runs in no other test's server, nor in the user's.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(batch_store.BATCH_DIR_ENV, str(tmp_path_factory.mktemp("batches")))
        yield


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    # Two cores: keep torch from oversubscribing them while pytest and the
    # event loop also need a slice.
    torch.set_num_threads(2)


def make_core(loaded: LoadedModel, **config) -> EngineCore:
    """An EngineCore on an already loaded model, with a small KV pool by default."""
    config.setdefault("kv_cache_memory", 64 << 20)
    config.setdefault("warm_up", False)  # kernels are built as they are met
    return EngineCore(loaded, EngineConfig(**config))
