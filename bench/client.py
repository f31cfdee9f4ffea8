"""One streamed request to an OpenAI-compatible server, timed.

Timings follow vLLM's ``benchmark_serving``: TTFT is the time from sending
the request to the first chunk that carries text, each ITL is the gap
between two such chunks, and E2E latency ends at the last of them (the usage
trailer and ``[DONE]`` carry no token). Chunks with no text (a role-only
chat header, a detokenizer holding back half a character) do not count as
tokens, so an empty header sent before prefill cannot fake a fast TTFT.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import httpx
import trio

from trioserve.engine.errors import TrioserveError

from .datasets import SampleRequest
from .measurement import RequestMeasurement
from .metrics import parse_prefix_cache_counters, prefix_cache_hit_rate


class ServerError(TrioserveError):
    """The server could not be asked what it serves (``GET /v1/models``)."""


class _StreamError(Exception):
    """A response stream that is not the SSE an OpenAI server sends."""


@attrs.frozen
class Target:
    """Where and how to send requests."""

    base_url: str = attrs.field(converter=lambda url: url.rstrip("/"))
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    ignore_eos: bool = False
    request_timeout: float = 3600.0

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        return self.base_url + self.endpoint

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_payload(target: Target, sample: SampleRequest, extra: Mapping[str, Any] | None = None) -> dict:
    """The JSON body for one streamed, greedy request; ``extra``'s fields
    are added to it (a priority, latency objectives)."""
    payload: dict = {
        "model": target.model,
        "max_tokens": sample.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.chat:
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        payload["prompt"] = sample.prompt
    if target.ignore_eos:
        payload["ignore_eos"] = True
    return payload | dict(extra or {})


class SSEParser:
    """Splits a byte stream into the ``data`` payloads of its SSE events."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Return the payloads of the events that ``chunk`` completes."""
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        events = []
        for raw in lines:
            # Splitting bytes on b"\n" is safe: no UTF-8 sequence contains it.
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
            # Comments (":" pings), event/id/retry fields carry no payload.
        return events

    def close(self) -> list[str]:
        """Payloads left when the stream ends without a final blank line."""
        return self.feed(b"\n\n")


def _chunk_text(data: dict, chat: bool) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    if chat:
        delta = choices[0].get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
    return choices[0].get("text") or ""


class _Recorder:
    """Accumulates one response's events with the time each arrived."""

    def __init__(self, start: float, chat: bool) -> None:
        self.start = self.last = start
        self.chat = chat
        self.ttft = 0.0
        self.itl: list[float] = []
        self.texts: list[str] = []
        self.usage: dict = {}

    def event(self, payload: str, now: float) -> None:
        if payload == "[DONE]":
            return
        try:
            data = json.loads(payload)
        except json.JSONDecodeError:
            raise _StreamError(f"malformed SSE data: {payload[:200]}") from None
        if not isinstance(data, dict):
            raise _StreamError(f"malformed SSE data: {payload[:200]}")
        if data.get("error"):
            raise _StreamError(f"server error in stream: {json.dumps(data['error'])[:300]}")
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        try:
            text = _chunk_text(data, self.chat)
        except (AttributeError, TypeError, IndexError):
            raise _StreamError(f"unexpected chunk shape: {payload[:200]}") from None
        if text:
            if self.texts:
                self.itl.append(now - self.last)
            else:
                self.ttft = now - self.start
            self.last = now
            self.texts.append(text)

    def output(self, sample: SampleRequest) -> RequestMeasurement:
        if not self.texts:
            error = "no token in the response stream"
            return RequestMeasurement(False, sample.prompt_len, start_time=self.start, error=error)
        return RequestMeasurement(
            success=True,
            prompt_len=self.usage.get("prompt_tokens") or sample.prompt_len,
            output_tokens=self.usage.get("completion_tokens") or len(self.texts),
            ttft=self.ttft,
            itl=tuple(self.itl),
            e2el=self.last - self.start,
            start_time=self.start,
            generated_text="".join(self.texts),
            predicted_ttft=_slo_seconds(self.usage, "predicted"),
            server_ttft=_slo_seconds(self.usage, "measured"),
        )


def _slo_seconds(usage: Mapping[str, Any], which: str) -> float | None:
    """``usage.slo.<which>.ttft_ms`` in seconds, None where the response has none."""
    slo = usage.get("slo")
    part = slo.get(which) if isinstance(slo, dict) else None
    value = part.get("ttft_ms") if isinstance(part, dict) else None
    return value / 1000 if isinstance(value, int | float) else None


async def _stream(
    client: httpx.AsyncClient, target: Target, sample: SampleRequest, extra: Mapping[str, Any] | None
) -> RequestMeasurement:
    recorder = _Recorder(trio.current_time(), target.chat)
    parser = SSEParser()
    body = build_payload(target, sample, extra)
    async with client.stream("POST", target.url, json=body, headers=target.headers()) as r:
        if r.status_code != 200:
            body = (await r.aread()).decode("utf-8", errors="replace").strip()
            error = f"HTTP {r.status_code}: {body[:300]}"
            return RequestMeasurement(False, sample.prompt_len, start_time=recorder.start, error=error)
        async for chunk in r.aiter_bytes():
            now = trio.current_time()
            for payload in parser.feed(chunk):
                recorder.event(payload, now)
    for payload in parser.close():
        recorder.event(payload, trio.current_time())
    return recorder.output(sample)


async def send_request(
    client: httpx.AsyncClient, target: Target, sample: SampleRequest, extra: Mapping[str, Any] | None = None
) -> RequestMeasurement:
    """Send one streamed request (``extra``: fields added to its body) and
    time it; never raises for a failed request, which comes back with
    ``success=False`` and the error text."""
    start = trio.current_time()
    try:
        with trio.fail_after(target.request_timeout):
            return await _stream(client, target, sample, extra)
    except trio.TooSlowError:
        error = f"timed out after {target.request_timeout:g} s"
    except (httpx.HTTPError, _StreamError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return RequestMeasurement(False, sample.prompt_len, start_time=start, error=error)


# Seconds an idle pooled connection is reused for: under the servers' own
# idle timeouts (trioserve's --keep-alive-timeout and llama-server's, 5 s
# each, httpx's default expiry too). At equal timeouts the server can close
# a connection just as the client sends on it, and that request fails with
# a ReadError no server did anything to cause (one in 3,000 of a goodput
# run did).
KEEPALIVE_EXPIRY = 2.0


def open_client(target: Target, max_concurrency: int | None) -> httpx.AsyncClient:
    """An HTTP client whose pool is as wide as the concurrency, so requests
    wait on the benchmark's limiter and not, unseen, on the pool."""
    limits = httpx.Limits(
        max_connections=max_concurrency, max_keepalive_connections=max_concurrency, keepalive_expiry=KEEPALIVE_EXPIRY
    )
    timeout = None if math.isinf(target.request_timeout) else target.request_timeout
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout))


async def fetch_first_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id the server lists at ``GET /v1/models``."""
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            response = await client.get(url, headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot list models at {url}: {exc}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"{url} did not return a model list; pass --model") from None


async def fetch_metrics_text(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The server's Prometheus exposition at ``/metrics``, or ``None`` if it has none."""
    try:
        response = await client.get(base_url.rstrip("/") + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


@attrs.frozen
class RunResult:
    """The outputs of one timed run, in dataset order, and how it was loaded."""

    outputs: tuple[RequestMeasurement, ...]
    duration_s: float
    max_concurrency: int | None
    request_rate: float
    burstiness: float
    # Share of prompt tokens the server found in its prefix cache during the
    # run, from its /metrics; None when it exports no such counters.
    prefix_cache_hit_rate: float | None


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, *, seed: int = 0) -> list[float]:
    """When to send each request, in seconds from the start of the run.

    Gaps are gamma-distributed with mean ``1/request_rate``: shape
    ``burstiness`` 1 is a Poisson process, lower is burstier, ``inf`` is a
    fixed gap. As in vLLM the offsets are rescaled so the last one falls at
    ``num_requests / request_rate``, which keeps throughput comparable across
    seeds. An infinite rate sends everything at once.
    """
    if not request_rate > 0:
        raise ValueError("request_rate must be > 0")
    if not burstiness > 0:
        raise ValueError("burstiness must be > 0")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, total = [], 0.0
    for _ in range(num_requests):
        if math.isinf(burstiness):
            total += 1.0 / request_rate
        else:
            total += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
        offsets.append(total)
    scale = (num_requests / request_rate) / total
    return [offset * scale for offset in offsets]


async def _send_all(
    client: httpx.AsyncClient,
    target: Target,
    samples: Sequence[SampleRequest],
    offsets: Sequence[float],
    limiter: trio.CapacityLimiter | None,
    on_done: Callable[[RequestMeasurement], None] | None,
) -> list[RequestMeasurement]:
    outputs: list[RequestMeasurement | None] = [None] * len(samples)

    async def one(i: int) -> None:
        # Timing starts once the limiter admits the request, as in vLLM: time
        # spent queued in the client is not the server's latency.
        if limiter is None:
            outputs[i] = await send_request(client, target, samples[i])
        else:
            async with limiter:
                outputs[i] = await send_request(client, target, samples[i])
        if on_done is not None:
            on_done(outputs[i])

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i, offset in enumerate(offsets):
            await trio.sleep_until(start + offset)
            nursery.start_soon(one, i)
    return outputs  # type: ignore[return-value]


async def _prefix_counters(client: httpx.AsyncClient, base_url: str):
    text = await fetch_metrics_text(client, base_url)
    return None if text is None else parse_prefix_cache_counters(text)


async def run_benchmark(
    target: Target,
    samples: Sequence[SampleRequest],
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    warmups: Sequence[SampleRequest] = (),
    on_done: Callable[[RequestMeasurement], None] | None = None,
) -> RunResult:
    """Send ``samples`` at the given rate with at most ``max_concurrency`` in
    flight, after ``warmups`` (sent unpaced, and left out of the result).

    The server's /metrics is read after the warm-up and after the run, so the
    prefix-cache hit rate covers the timed requests only. ``on_done`` is
    called as each timed request finishes (a progress bar).
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    offsets = arrival_offsets(len(samples), request_rate, burstiness, seed=seed)
    limiter = None if max_concurrency is None else trio.CapacityLimiter(max_concurrency)
    async with open_client(target, max_concurrency) as client:
        if warmups:
            await _send_all(client, target, warmups, [0.0] * len(warmups), limiter, None)
        before = await _prefix_counters(client, target.base_url)
        start = trio.current_time()
        outputs = await _send_all(client, target, samples, offsets, limiter, on_done)
        duration = trio.current_time() - start
        after = await _prefix_counters(client, target.base_url)
    return RunResult(
        outputs=tuple(outputs),
        duration_s=duration,
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        prefix_cache_hit_rate=prefix_cache_hit_rate(before, after),
    )
