"""The Prometheus metrics: names, per-request latencies, engine totals, rejections."""

from __future__ import annotations

import attrs
import pytest
from prometheus_client.parser import text_string_to_metric_families

from trioserve.engine.core.outputs import RequestOutput, RequestTimes
from trioserve.engine.core.sequence import FinishReason
from trioserve.web.metrics import REJECT_REASONS, Metrics, token_buckets

NAMES = [
    "trioserve:num_requests_running",
    "trioserve:num_requests_waiting",
    "trioserve:kv_cache_usage_perc",
    "trioserve:prefix_cache_queries_total",
    "trioserve:prefix_cache_hits_total",
    "trioserve:num_preemptions_total",
    "trioserve:prompt_tokens_total",
    "trioserve:generation_tokens_total",
    "trioserve:request_success_total",
    "trioserve:request_rejected_total",
    "trioserve:time_to_first_token_seconds",
    "trioserve:inter_token_latency_seconds",
    "trioserve:time_per_output_token_seconds",
    "trioserve:e2e_request_latency_seconds",
    "trioserve:request_queue_time_seconds",
    "trioserve:request_prompt_tokens",
    "trioserve:request_generation_tokens",
]

M = {"model_name": "smol"}


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {**M, **labels})


def delta(now, *, tokens=1, index=0, request_id="r1", finish=None, num_output=1, first_token=1.0, first_scheduled=0.5):
    return RequestOutput(
        request_id=request_id,
        index=index,
        new_token_ids=tuple(range(tokens)),
        text_delta="x" * tokens,
        logprobs=(),
        finish_reason=finish,
        stop_reason=None,
        num_prompt_tokens=12,
        num_output_tokens=num_output,
        num_cached_tokens=0,
        times=RequestTimes(arrival=0.0, first_scheduled=first_scheduled, first_token=first_token, now=now),
    )


def test_render_contains_every_name():
    metrics = Metrics()
    metrics.add_model("smol")
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    text = body.decode()
    for name in NAMES:
        assert f"# TYPE {name}" in text, name
    families = {f.name for f in text_string_to_metric_families(text)}
    assert "trioserve:time_to_first_token_seconds" in families
    # add_model makes every series exist at zero before any traffic.
    assert value(metrics, "trioserve:e2e_request_latency_seconds_count") == 0.0
    assert value(metrics, "trioserve:request_success_total", finished_reason="deadline") == 0.0
    assert value(metrics, "trioserve:request_rejected_total", reason="draining") == 0.0


def test_each_instance_has_its_own_registry():
    first, second = Metrics(), Metrics()
    first.reject("smol", "overloaded")
    assert value(first, "trioserve:request_rejected_total", reason="overloaded") == 1.0
    assert value(second, "trioserve:request_rejected_total", reason="overloaded") is None


def test_one_request_feeds_every_latency_histogram():
    metrics = Metrics()
    metrics.observe_output("smol", delta(1.0, num_output=1))
    metrics.observe_output("smol", delta(1.0, tokens=0, num_output=1))  # held-back text: no token, no ITL
    metrics.observe_output("smol", delta(1.25, num_output=2))
    metrics.observe_output("smol", delta(1.5, num_output=3, finish=FinishReason.STOP))
    assert value(metrics, "trioserve:time_to_first_token_seconds_count") == 1
    assert value(metrics, "trioserve:time_to_first_token_seconds_sum") == 1.0
    assert value(metrics, "trioserve:inter_token_latency_seconds_count") == 2
    assert value(metrics, "trioserve:inter_token_latency_seconds_sum") == 0.5
    assert value(metrics, "trioserve:time_per_output_token_seconds_sum") == 0.25  # (1.5 - 1.0) / 2
    assert value(metrics, "trioserve:e2e_request_latency_seconds_sum") == 1.5
    assert value(metrics, "trioserve:request_queue_time_seconds_sum") == 0.5
    assert value(metrics, "trioserve:request_prompt_tokens_sum") == 12
    assert value(metrics, "trioserve:request_generation_tokens_sum") == 3
    assert value(metrics, "trioserve:request_success_total", finished_reason="stop") == 1
    # Bucketed: the 1 s TTFT lands in le=1.0 but not le=0.5.
    assert value(metrics, "trioserve:time_to_first_token_seconds_bucket", le="1.0") == 1
    assert value(metrics, "trioserve:time_to_first_token_seconds_bucket", le="0.5") == 0
    assert metrics.num_tracked == 0


def test_n_completions_count_as_one_request():
    metrics = Metrics()
    observe = lambda d: metrics.observe_output("smol", d, num_completions=2)  # noqa: E731
    observe(delta(1.0, index=0))
    observe(delta(1.1, index=1, first_token=1.1))
    observe(delta(2.0, index=0, num_output=2, finish=FinishReason.LENGTH))
    assert value(metrics, "trioserve:e2e_request_latency_seconds_count") is None  # waits for completion 1
    observe(delta(3.0, index=1, num_output=2, finish=FinishReason.DEADLINE))
    assert value(metrics, "trioserve:time_to_first_token_seconds_count") == 1
    assert value(metrics, "trioserve:time_per_output_token_seconds_count") == 2
    assert value(metrics, "trioserve:time_per_output_token_seconds_sum") == pytest.approx(1.0 + 1.9)
    assert value(metrics, "trioserve:e2e_request_latency_seconds_count") == 1
    assert value(metrics, "trioserve:e2e_request_latency_seconds_sum") == 3.0
    assert value(metrics, "trioserve:request_generation_tokens_sum") == 4
    assert value(metrics, "trioserve:request_success_total", finished_reason="deadline") == 1
    assert value(metrics, "trioserve:request_success_total", finished_reason="length") is None
    assert metrics.num_tracked == 0


def test_forget_drops_an_abandoned_request():
    metrics = Metrics()
    metrics.observe_output("smol", delta(1.0, request_id="gone"))
    assert metrics.num_tracked == 1
    metrics.forget("gone")
    metrics.forget("never-seen")
    assert metrics.num_tracked == 0


def test_never_scheduled_request_skips_queue_time():
    metrics = Metrics()
    aborted = delta(0.2, tokens=0, num_output=0, first_token=None, first_scheduled=None, finish=FinishReason.ABORT)
    metrics.observe_output("smol", aborted)
    assert value(metrics, "trioserve:request_queue_time_seconds_count") is None
    assert value(metrics, "trioserve:time_to_first_token_seconds_count") is None
    assert value(metrics, "trioserve:request_success_total", finished_reason="abort") == 1


@attrs.frozen
class Stats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


def test_statistics_set_gauges_and_advance_counters():
    metrics = Metrics()
    metrics.update_from_statistics("smol", Stats(3, 5, 0.25, 100, 40, 1, 100, 30))
    assert value(metrics, "trioserve:num_requests_running") == 3
    assert value(metrics, "trioserve:num_requests_waiting") == 5
    assert value(metrics, "trioserve:kv_cache_usage_perc") == 0.25
    metrics.update_from_statistics("smol", Stats(1, 0, 0.5, 150, 60, 1, 150, 70))
    assert value(metrics, "trioserve:num_requests_running") == 1
    assert value(metrics, "trioserve:prefix_cache_queries_total") == 150
    assert value(metrics, "trioserve:prefix_cache_hits_total") == 60
    assert value(metrics, "trioserve:num_preemptions_total") == 1
    assert value(metrics, "trioserve:prompt_tokens_total") == 150
    assert value(metrics, "trioserve:generation_tokens_total") == 70
    # A new engine restarts its totals: they count again from zero.
    metrics.update_from_statistics("smol", Stats(prompt_tokens=10))
    assert value(metrics, "trioserve:prompt_tokens_total") == 160


def test_rejections_by_reason():
    metrics = Metrics()
    for reason in REJECT_REASONS:
        metrics.reject("smol", reason)
    metrics.reject("smol", "overloaded")
    assert value(metrics, "trioserve:request_rejected_total", reason="overloaded") == 2
    assert value(metrics, "trioserve:request_rejected_total", reason="too_large") == 1
    with pytest.raises(ValueError, match="reason must be one of"):
        metrics.reject("smol", "bored")


def test_token_buckets():
    assert token_buckets(8192) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 8192)
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    metrics = Metrics(max_model_len=100)
    metrics.observe_output("smol", delta(1.0, num_output=1, finish=FinishReason.STOP))
    assert value(metrics, "trioserve:request_prompt_tokens_bucket", le="20.0") == 1
    assert value(metrics, "trioserve:request_prompt_tokens_bucket", le="10.0") == 0
