"""A served model: its engine, and what the HTTP layer needs of it."""

from __future__ import annotations

import time

import attrs

from trioserve.actors import Engine
from trioserve.actors.statistics import EngineStatistics
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.core.sequence import FinishReason
from trioserve.engine.models.hf_fallback import implementation

from .logprobs import TokenTexts
from .metrics import Metrics


@attrs.frozen
class MetricsStatistics:
    """``engine.statistics()`` in the shape ``Metrics.update_from_statistics`` reads."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @classmethod
    def from_engine(cls, stats: EngineStatistics) -> MetricsStatistics:
        return cls(
            num_running=stats.num_running,
            # Admitted but not scheduled yet, plus still in the admission queue.
            num_waiting=stats.num_waiting + stats.num_queued,
            kv_cache_usage=stats.kv_usage,
            prefix_cache_queries=stats.allocator.kv.prefix_cache_queries,
            prefix_cache_hits=stats.allocator.kv.prefix_cache_hits,
            num_preemptions=stats.scheduler.num_preemptions,
            prompt_tokens=stats.scheduler.total_prompt_tokens,
            generation_tokens=stats.scheduler.total_generation_tokens,
            spec_decode_num_draft_tokens=stats.scheduler.num_draft_tokens,
            spec_decode_num_accepted_tokens=stats.scheduler.num_accepted_tokens,
        )


@attrs.define(eq=False)
class ServedModel:
    """One model being served: its engine, and what responses need of it."""

    name: str
    engine: Engine
    metrics: Metrics
    created: int = attrs.field(factory=lambda: int(time.time()))
    texts: TokenTexts = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.texts = TokenTexts(self.engine.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def implementation(self) -> str:
        """What runs the model: ``"native"`` (a family of engine/models) or
        ``"transformers"`` (the slower transformers fallback, hf_fallback.py)."""
        return implementation(self.engine.model_config)

    def observe(self, output: RequestOutput, num_completions: int) -> None:
        """Feed one delta to the metrics."""
        self.metrics.observe_output(self.name, output, num_completions=num_completions)
        if output.index == 0 and output.finish_reason is FinishReason.DEADLINE and output.times.first_scheduled is None:
            # Its time ran out before it ever ran: refused for lack of time.
            self.metrics.reject(self.name, "deadline")

    def update_metrics(self) -> None:
        stats = self.engine.statistics()
        self.metrics.update_from_statistics(self.name, MetricsStatistics.from_engine(stats))
        self.metrics.update_overload(self.name, stats.overload)
        self.metrics.replicas.update(self.name, stats.replicas)
        self.metrics.update_worker(self.name, stats.executor.num_worker_restarts)
