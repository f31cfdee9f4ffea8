"""What a running trioserve server says at ``/metrics``, and waiting until
it is idle: the one place the benchmarks, the soak and the tests wait.

``metric_values`` reads a Prometheus exposition into ``{key: value}``; a key
is the sample's name, plus its labels other than ``model_name`` as
``name{label=value,...}`` (sorted), so ``trioserve:num_requests_running``
and ``trioserve:request_success_total{finished_reason=stop}``.
"""

from __future__ import annotations

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

RUNNING = "trioserve:num_requests_running"
WAITING = "trioserve:num_requests_waiting"
KV_USAGE = "trioserve:kv_cache_usage_perc"


def metric_values(text: str, model: str | None = None) -> dict[str, float]:
    """The samples of a Prometheus exposition for served ``model``; with
    None, every sample, the values of several models with the same key
    summed (the whole server)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("model_name", None) != model and model is not None:
                continue
            extra = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            key = f"{sample.name}{{{extra}}}" if extra else sample.name
            values[key] = values.get(key, 0.0) + sample.value
    return values


async def scrape(http: httpx.AsyncClient, model: str | None = None) -> dict[str, float]:
    """``metric_values`` of the server ``http`` is opened on (its
    ``base_url``); ``httpx.HTTPStatusError`` unless it answers 200."""
    response = await http.get("/metrics")
    response.raise_for_status()
    return metric_values(response.text, model)


def is_idle(values: dict[str, float]) -> bool:
    """No request runs or waits on the engine."""
    return values[RUNNING] == 0 and values[WAITING] == 0


async def wait_idle(
    http: httpx.AsyncClient,
    model: str | None = None,
    *,
    timeout: float = 120.0,
    blocks_free: bool = False,
    poll: float = 0.02,
) -> dict[str, float]:
    """Poll ``/metrics`` until no request runs or waits (an abort applies at
    the engine's next step boundary) and, with ``blocks_free``, no KV block
    is held; return the last scrape. ``trio.TooSlowError`` after
    ``timeout`` seconds.

    Without ``blocks_free`` the caller sees what idle leaves held, which is
    what a leak check wants to report rather than wait out."""
    with trio.fail_after(timeout):
        while True:
            values = await scrape(http, model)
            if is_idle(values) and (not blocks_free or values[KV_USAGE] == 0):
                return values
            await trio.sleep(poll)


def wait_idle_sync(url: str, model: str | None = None, **kwargs) -> dict[str, float]:
    """``wait_idle`` from a thread without a trio loop (a synchronous test
    of a server running in another thread), on the server at ``url``."""

    async def wait() -> dict[str, float]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            return await wait_idle(http, model, **kwargs)

    return trio.run(wait)
