"""Request tracing with OpenTelemetry: one span per generation request.

Off by default. ``--otlp-traces-endpoint URL`` (or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) turns it on: spans go to that OTLP
collector over HTTP/protobuf (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc``
for gRPC, with its exporter installed); the other ``OTEL_*`` variables
(service name, resource attributes, headers, timeout, batching) apply as the
SDK reads them, and ``OTEL_SDK_DISABLED=true`` turns it off. When off, no
hook is registered and nothing of OpenTelemetry is imported.

A span covers one ``POST /v1/completions``, ``/v1/chat/completions``,
``/v1/responses`` or ``/v1/messages``, from its arrival to the request's
end (its last output, an error, or the client going away). Its parent is
the incoming W3C ``traceparent`` (a malformed one is ignored, with a log
line). Attributes follow OpenTelemetry's GenAI conventions (``gen_ai.*``);
its events are the request's timeline, taken from the ``RequestTimes``
value each engine output carries: ``queued``, ``admitted``,
``first_scheduled``, ``preempted`` (each), ``first_token``, ``deadline``
or ``aborted``, ``finished``. A request with latency objectives gets one
more at the door (web/slo_door.py): ``slo.admitted`` (the targets and the
predicted TTFT and TPOT), ``slo.not_enforced`` (a server without the slo
policy) or ``slo.refused`` (the objective, predicted and target).
"""

from __future__ import annotations

import logging
import os
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

import attrs
import trio
from quart import Quart, Response, g, request

from trioserve.actors import RequestStream
from trioserve.engine.errors import TrioserveError
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.core.sequence import FinishReason

from .completion_bodies import finish_reason as api_finish_reason

log = logging.getLogger(__name__)

# The traced paths and their GenAI operation names.
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    # Both answer a chat (web/openai_responses_api.py, web/anthropic_api.py).
    "/v1/responses": "chat",
    "/v1/messages": "chat",
}
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
DEFAULT_SERVICE_NAME = "trioserve"
_TRUE = ("1", "true", "yes", "on")


class TracingUnavailable(TrioserveError):
    """Tracing was asked for, but its packages are not installed."""


def tracing_wanted(endpoint: str | None, environ: Mapping[str, str]) -> bool:
    """Whether spans should be exported: an endpoint is given (the option
    or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) and the SDK is not disabled."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False
    return bool(endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def traces_url(endpoint: str) -> str:
    """``--otlp-traces-endpoint``'s URL for OTLP/HTTP: a bare ``http://host:port``
    gets the standard ``/v1/traces`` path."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL, got {endpoint!r}")
    if parts.path in ("", "/"):
        return urllib.parse.urlunsplit(parts._replace(path="/v1/traces"))
    return endpoint


def _otlp_exporter(endpoint: str | None, environ: Mapping[str, str]) -> Any:
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise TracingUnavailable(
                "OTLP over gRPC needs its exporter: pip install opentelemetry-exporter-otlp-proto-grpc"
            ) from None
        return OTLPSpanExporter(endpoint=endpoint)
    if protocol != "http/protobuf":
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be http/protobuf or grpc, got {protocol!r}")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=None if endpoint is None else traces_url(endpoint))


@attrs.define(eq=False)
class Tracing:
    """The server's tracer: where spans go and how a ``traceparent`` is read.

    ``provider`` is an SDK ``TracerProvider``; ``owns_provider``: ``shutdown``
    flushes and closes it (a provider handed in by the caller stays theirs).
    """

    provider: Any
    owns_provider: bool = False
    tracer: Any = attrs.field(init=False)
    propagator: Any = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = self.provider.get_tracer("trioserve.web")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_endpoint(cls, endpoint: str | None, environ: Mapping[str, str] | None = None) -> Tracing | None:
        """Export to ``endpoint`` (or the ``OTEL_*`` variables' endpoint) in
        batches; None when tracing is not wanted (``tracing_wanted``).
        Raises ``TracingUnavailable`` without the ``tracing`` extra."""
        environ = os.environ if environ is None else environ
        if not tracing_wanted(endpoint, environ):
            return None
        try:
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise TracingUnavailable(
                "--otlp-traces-endpoint needs OpenTelemetry: pip install 'trioserve[tracing]' "
                "(opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"
            ) from None
        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES;
        # without a name there, the service is trioserve.
        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        provider = TracerProvider(resource=resource)
        # Batched: the export runs in the processor's own thread, never in a request's.
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(endpoint, environ)))
        return cls(provider, owns_provider=True)

    def begin(self, headers: Mapping[str, str], operation: str) -> RequestTrace:
        """A span for the request with these headers, its parent taken from
        a valid ``traceparent``."""
        from opentelemetry import trace

        carrier = {name: headers[name] for name in (TRACEPARENT, TRACESTATE) if headers.get(name) is not None}
        context = self.propagator.extract(carrier) if carrier else None
        if TRACEPARENT in carrier and not trace.get_current_span(context).get_span_context().is_valid:
            log.info("ignored malformed traceparent %r: the span starts a new trace", carrier[TRACEPARENT][:128])
            context = None
        span = self.tracer.start_span(
            operation, context=context, kind=trace.SpanKind.SERVER, attributes={"gen_ai.operation.name": operation}
        )
        return RequestTrace(span, operation)

    async def shutdown(self) -> None:
        """Export what is left and stop (in a thread: it may wait on the collector)."""
        if self.owns_provider:
            await trio.to_thread.run_sync(self.provider.shutdown)


@attrs.define(eq=False)
class RequestTrace:
    """One request's span, filled in as the request goes and ended once."""

    span: Any
    operation: str
    # Wall-clock minus monotonic, to place RequestTimes on the span's clock.
    _offset_ns: int = attrs.field(init=False, factory=lambda: time.time_ns() - time.monotonic_ns())
    _n: int = attrs.field(init=False, default=1)
    _last: dict[int, RequestOutput] = attrs.field(init=False, factory=dict)
    ended: bool = attrs.field(init=False, default=False)

    def describe(self, params: SamplingParams, requested_model: str | None, served_model: str, request_id: str) -> None:
        """The request as the engine took it."""
        self._n = params.n
        self.span.update_name(f"{self.operation} {served_model}")
        attributes: dict[str, Any] = {
            "gen_ai.request.model": requested_model or served_model,
            "gen_ai.response.model": served_model,
            "gen_ai.response.id": request_id,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
        }
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        if params.n != 1:
            attributes["gen_ai.request.choice.count"] = params.n
        self.span.set_attributes(attributes)

    def observe(self, output: RequestOutput) -> None:
        """An output of the request; the latest of each completion holds its timeline so far."""
        self._last[output.index] = output

    def fail(self, exc: BaseException) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.span.record_exception(exc)
        self.span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        self.span.set_attribute("error.type", type(exc).__name__)

    def end(self, *, status: int | None = None, error_code: str | None = None) -> None:
        """Add the timeline's events and the usage, and end the span; later calls do nothing."""
        if self.ended:
            return
        self.ended = True
        now_ns = time.time_ns()
        events: list[tuple[int, str, dict[str, Any]]] = []
        outputs = [self._last[i] for i in sorted(self._last)]
        if outputs:
            events.append((self._ns(min(o.times.arrival for o in outputs)), "queued", {}))
            admitted = [o.times.admitted for o in outputs if o.times.admitted is not None]
            if admitted:
                events.append((self._ns(min(admitted)), "admitted", {}))
        reasons = []
        for output in outputs:
            index = {"gen_ai.response.choice.index": output.index} if self._n > 1 else {}
            times = output.times
            if times.first_scheduled is not None:
                events.append((self._ns(times.first_scheduled), "first_scheduled", index))
            events.extend((self._ns(t), "preempted", index) for t in times.preemptions)
            if times.first_token is not None:
                events.append((self._ns(times.first_token), "first_token", index))
            reason = output.finish_reason
            if reason is None:  # the stream closed first: the client went away
                events.append((now_ns, "aborted", {**index, "trioserve.abort.cause": "client disconnected"}))
                reasons.append(api_finish_reason(FinishReason.ABORT))
                continue
            if reason is FinishReason.DEADLINE:
                events.append((self._ns(times.now), "deadline", index))
            elif reason is FinishReason.ABORT:
                events.append((self._ns(times.now), "aborted", index))
            reasons.append(api_finish_reason(reason))
            events.append((self._ns(times.now), "finished", {**index, "gen_ai.response.finish_reason": reasons[-1]}))
        for timestamp, name, attributes in sorted(events, key=lambda e: e[0]):
            self.span.add_event(name, attributes, timestamp=timestamp)
        if outputs:
            self.span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": outputs[0].num_prompt_tokens,
                    "gen_ai.usage.output_tokens": sum(o.num_output_tokens for o in outputs),
                    "gen_ai.response.finish_reasons": reasons,
                }
            )
        if status is not None:
            self.span.set_attribute("http.response.status_code", status)
            if status >= 400:
                from opentelemetry.trace import Status, StatusCode

                self.span.set_attribute("error.type", error_code or str(status))
                if status >= 500:
                    self.span.set_status(Status(StatusCode.ERROR, error_code or str(status)))
        self.span.end(end_time=max(now_ns, *(e[0] for e in events)) if events else now_ns)

    def _ns(self, monotonic: float) -> int:
        return int(monotonic * 1e9) + self._offset_ns


class TracedStream:
    """A ``RequestStream`` whose outputs and end go to the request's span."""

    def __init__(self, stream: RequestStream, trace: RequestTrace) -> None:
        self._stream = stream
        self._trace = trace

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    def __aiter__(self) -> TracedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            output = await self._stream.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            self._trace.fail(exc)
            raise
        self._trace.observe(output)
        return output

    def close(self) -> None:
        self._stream.close()
        self._trace.end()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()


# -- the app's hooks -----------------------------------------------------------------


def register(app: Quart, tracing: Tracing) -> None:
    """Trace ``app``'s generation requests; call before ``routes.register``,
    so that a request refused by the API key or body checks has its span too."""

    async def begin_span() -> None:
        operation = OPERATIONS.get(request.path)
        if operation is not None and request.method == "POST":
            g.trace = tracing.begin(request.headers, operation)

    async def end_span(response: Response) -> Response:
        trace: RequestTrace | None = g.get("trace")
        if trace is not None and not trace.ended:
            request_id = g.get("request_id")
            if request_id is not None:
                trace.span.set_attribute("trioserve.request_id", request_id)
            if response.status_code == 200 and response.mimetype == "text/event-stream":
                trace.span.set_attribute("http.response.status_code", 200)  # the stream ends the span
            else:
                code = None
                if response.status_code >= 400 and response.mimetype == "application/json":
                    error = (await response.get_json(silent=True) or {}).get("error") or {}
                    code = error.get("code") or error.get("type")
                trace.end(status=response.status_code, error_code=code)
        return response

    app.before_request(begin_span)
    app.after_request(end_span)


def follow(stream: RequestStream, params: SamplingParams, requested_model: str | None, served_model: str) -> Any:
    """The request's stream, traced when the request has a span (else ``stream`` itself)."""
    trace: RequestTrace | None = g.get("trace")
    if trace is None:
        return stream
    trace.describe(params, requested_model, served_model, stream.request_id)
    return TracedStream(stream, trace)


def slo_decided(report: Any) -> None:
    """Mark on the request's span (if it has one) its latency objectives
    and the door's prediction and decision (web/slo.py's ``SloReport``)."""
    trace: RequestTrace | None = g.get("trace")
    if trace is None:
        return
    attributes: dict[str, Any] = {
        "trioserve.slo.enforced": report.enforced,
        # As the trioserve:slo_requests_total counter labels it.
        "trioserve.slo.decision": report.verdict,
        "trioserve.slo.mode": "best_effort" if report.objectives.best_effort else "enforced",
    }
    for name, value in (("ttft_ms", report.objectives.ttft), ("tpot_ms", report.objectives.tpot)):
        if value is not None:
            attributes[f"trioserve.slo.{name}"] = value * 1000
    if report.decision is not None:
        prediction = report.decision.prediction
        attributes["trioserve.slo.predicted_ttft_ms"] = prediction.ttft * 1000
        attributes["trioserve.slo.predicted_tpot_ms"] = prediction.tpot * 1000
        if report.decision.max_tokens is not None:
            attributes["trioserve.slo.max_tokens_lowered_to"] = report.decision.max_tokens
    trace.span.add_event("slo.admitted" if report.enforced else "slo.not_enforced", attributes)


def slo_refused(exc: Any) -> None:
    """Mark on the request's span (if it has one) a refusal at the door
    for a latency objective (``SloRefused``)."""
    trace: RequestTrace | None = g.get("trace")
    if trace is None:
        return
    trace.span.add_event(
        "slo.refused",
        {
            "trioserve.slo.decision": f"refused_{exc.reason}",
            "trioserve.slo.objective": exc.objective,
            "trioserve.slo.predicted_ms": exc.predicted * 1000,
            "trioserve.slo.target_ms": exc.target * 1000,
            "trioserve.slo.over_ms": (exc.predicted - exc.target) * 1000,
            "trioserve.slo.degraded": exc.degraded,
        },
    )
