"""``trioserve bench tracing``: what tracing costs a request: the web
layer's span work (web/tracing.py) for one request of N outputs, with the
SDK's batch processor and an exporter that drops the spans (the export
itself runs in the processor's thread).

CPU time counts every thread of the process; on a shared machine wall time
includes waiting for a core. Needs the tracing extra
(``pip install 'trioserve[tracing]'``).
"""

from __future__ import annotations

import argparse
import time

from trioserve.engine.core.outputs import RequestOutput, RequestTimes
from trioserve.engine.core.sequence import FinishReason
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.web.tracing import Tracing

from ..arguments import positive_int, usage_error

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "tracing",
        help="the span work --otlp-traces-endpoint adds to a request",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench tracing``: "),
    )
    work = p.add_argument_group("workload")
    work.add_argument("--outputs", type=positive_int, default=64, help="outputs of each request (default: 64)")
    work.add_argument("--requests", type=positive_int, default=2000, help="requests timed, each way (default: 2000)")
    p.set_defaults(func=run)
    return p


def outputs(n: int) -> list[RequestOutput]:
    now = time.monotonic()
    times = RequestTimes(arrival=now, first_scheduled=now, first_token=now, now=now, admitted=now, preemptions=(now,))
    return [
        RequestOutput(
            request_id="r", index=0, new_token_ids=(1,), text_delta="x", logprobs=(),
            finish_reason=FinishReason.LENGTH if i == n - 1 else None, stop_reason=None,
            num_prompt_tokens=20, num_output_tokens=i + 1, num_cached_tokens=0, times=times,
        )  # fmt: skip
        for i in range(n)
    ]


def run(args: argparse.Namespace) -> int:
    try:  # the tracing extra, which trioserve runs without
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    except ImportError as exc:
        return usage_error("tracing", f"{exc}: install the tracing extra, pip install 'trioserve[tracing]'")

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop(), max_queue_size=1 << 16))
    tracing = Tracing(provider)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=args.outputs, seed=1)
    batch = outputs(args.outputs)
    headers = {"traceparent": TRACEPARENT}
    for label, traced in (("off", False), ("on", True)):
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(args.requests):
            if traced:
                trace = tracing.begin(headers, "chat")
                trace.describe(params, None, "m", "r")
                for output in batch:
                    trace.observe(output)
                trace.end()
            else:
                for output in batch:
                    pass
        wall = (time.perf_counter() - start) / args.requests
        cpu = (time.process_time() - cpu_start) / args.requests  # all threads: the exporter's too
        print(f"tracing {label}: {wall * 1e6:.1f} us wall, {cpu * 1e6:.1f} us CPU per request of {args.outputs} outputs")
    provider.shutdown()
    return 0
