"""Helpers for the actor tests: the tiny model of ``trioserve.testing`` on the
test device, prompts, and checks that an engine ended clean."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from conftest import TEST_DEVICE

from trioserve import testing
from trioserve.actors import Engine, open_engine
from trioserve.actors.executor import FakeExecutor
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.loading.loader import LoadedModel


def tiny_loaded() -> LoadedModel:
    """``trioserve.testing``'s tiny model on TEST_DEVICE (CPU unless
    TRIOSERVE_TEST_DEVICE says otherwise)."""
    return testing.tiny_loaded(TEST_DEVICE)


def assert_clean(engine: Engine) -> None:
    """Every KV block is back in the pool and the core holds no request."""
    kv = engine.statistics().allocator.kv
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} blocks still held"
    core = engine.core
    assert not core.has_unfinished()
    assert not core.scheduler.has_unfinished()
    assert core.scheduler.num_waiting == 0 and core.scheduler.num_running == 0
    engine.check_invariants()
    assert not core.scheduler.block_holders()


def prompts(count: int, *, seed: int = 0) -> list[str]:
    words = "the quick brown fox jumps over lazy dogs while seven wizards quietly hex bright amber jugs".split()
    out = []
    for i in range(count):
        n = 3 + (i * 7 + seed) % 9
        out.append(" ".join(words[(i * 3 + j * 5 + seed) % len(words)] for j in range(n)))
    return out


@asynccontextmanager
async def fake_engine(
    *,
    step_time: float,
    token_time: float = 0.0,
    fail: Any = None,
    executor_cls: type[FakeExecutor] = FakeExecutor,
    engine_kw: dict[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[Engine]:
    """An engine on the tiny model whose executor is ``executor_cls`` (a
    ``FakeExecutor``: steps of ``step_time + token_time * tokens`` trio
    seconds), for tests on the autojump clock. ``engine.fake`` is the
    executor; on exit the engine must be clean and hold no request id."""
    executors: list[FakeExecutor] = []

    def make(core: EngineCore) -> FakeExecutor:
        executor = executor_cls.for_core(core, step_time=step_time, token_time=token_time, fail=fail)
        executors.append(executor)
        return executor

    config_value = testing.engine_config(**config)
    async with open_engine(config_value, loaded=tiny_loaded(), executor=make, **(engine_kw or {})) as engine:
        engine.fake = executors[0]
        yield engine
    assert_clean(engine)
    assert engine.statistics().num_reserved_ids == 0
