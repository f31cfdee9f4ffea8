"""trioserve's actor engine: request, scheduler, executor and cache-allocator
actors on trio, talking over bounded memory channels.

    async with open_engine(config) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text_delta, end="")

See docs/architecture.md for the actors, their channels and the semantics of
backpressure, deadlines, cancellation, priorities and faults.
"""

from .engine import open_engine
from .handle import Engine
from .errors import (
    DuplicateRequestError,
    EngineClosed,
    EngineError,
    EngineOverloaded,
    ExpensiveRequestRefused,
    QueueTimeout,
    RequestDropped,
    RequestFailed,
    RequestShed,
)
from .executor import Executor, FakeExecutor, ModelExecutor
from .stream import RequestStream
from .statistics import (
    AllocatorStatistics,
    EngineStatistics,
    ExecutorStatistics,
    OverloadStatistics,
    SchedulerActorStatistics,
)

__all__ = [
    "AllocatorStatistics",
    "DuplicateRequestError",
    "Engine",
    "EngineClosed",
    "EngineError",
    "EngineOverloaded",
    "EngineStatistics",
    "Executor",
    "ExecutorStatistics",
    "ExpensiveRequestRefused",
    "FakeExecutor",
    "ModelExecutor",
    "OverloadStatistics",
    "QueueTimeout",
    "RequestDropped",
    "RequestFailed",
    "RequestShed",
    "RequestStream",
    "SchedulerActorStatistics",
    "open_engine",
]
