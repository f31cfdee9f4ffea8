"""``POST /v1/completions`` and ``POST /v1/chat/completions``.

A handler parses the body, picks the served model, works out the request's
deadline and queues it with ``engine.generate_nowait``, so every refusal
(invalid, too long, overloaded, draining) is an HTTP status before any byte
of the response. Then it either streams the engine's deltas as SSE chunks or
gathers them into one JSON body. The deadline is the engine's own
(``deadline=``): when it passes the engine ends each completion with finish
reason ``DEADLINE`` and frees its KV blocks.

A client that goes away cancels the handler (quart-trio cancels it when the
ASGI server reports the disconnect); closing the request's stream then sends
the engine its ``Abort``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import trio
from quart import Response, g, request

from trioserve.actors.engine import RequestStream
from trioserve.actors.errors import RequestFailed

from .body import request_json
from .errors import ApiError, RequestTimeout, from_exception
from .host import current_host
from .protocol import ChatCompletionRequest, CompletionRequest, effective_timeout, parse_timeout_header
from .responses import json_response
from .served import ServedModel
from .sse import SSE_DONE, ChatCompletionStream, CompletionStream, OutputAccumulator, sse_error, sse_events

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "X-Request-Timeout"


def translate(exc: Exception) -> ApiError:
    """The API error for an exception of the engine or the actors. A
    request failed by an engine fault (docs/reliability.md) gets a 500 whose
    code names the fault and whose message holds no inner error text."""
    if isinstance(exc, RequestFailed):
        log.error("request %s failed: %s", exc.request_id, exc)
        return ApiError(500, exc.public_message, type="server_error", code=exc.code)
    error = from_exception(exc)
    if error.status >= 500:
        log.error("request failed: %s: %s", type(exc).__name__, exc)
    return error


async def create_completion() -> Response:
    return await _generate(CompletionRequest, chat=False)


async def create_chat_completion() -> Response:
    return await _generate(ChatCompletionRequest, chat=True)


async def _generate(kind: type[CompletionRequest] | type[ChatCompletionRequest], *, chat: bool) -> Response:
    arrival = trio.current_time()
    host = current_host()
    parsed = kind.from_json(request_json())
    served = host.get(parsed.model)
    g.model_name = served.name  # rejections from here on count against this model
    timeout = effective_timeout(
        parsed.timeout, parse_timeout_header(request.headers.get(TIMEOUT_HEADER)), host.config.max_request_time
    )
    try:
        stream = served.engine.generate_nowait(
            parsed.engine_prompt,
            parsed.params,
            priority=parsed.priority,
            deadline=None if timeout is None else arrival + timeout,
        )
    except Exception as exc:
        raise translate(exc) from None
    texts = served.texts if parsed.params.logprobs is not None else None
    if parsed.stream:
        builder_kind = ChatCompletionStream if chat else CompletionStream
        builder = builder_kind(served.name, texts=texts, include_usage=parsed.include_usage)
        response = Response(
            _sse_body(stream, builder, served, parsed.params.n),
            content_type="text/event-stream; charset=utf-8",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        # A stream lasts as long as generation does: no response timeout.
        response.timeout = None
        return response
    accumulator = OutputAccumulator(n=parsed.params.n, texts=texts)
    try:
        async for output in stream:
            served.observe(output, parsed.params.n)
            accumulator.add(output)
    except Exception as exc:
        raise translate(exc) from None
    finally:
        stream.close()
        served.metrics.forget(stream.request_id)
    if accumulator.timed_out:
        raise RequestTimeout(timeout, accumulator.num_output_tokens)
    body = accumulator.chat_completion_body(served.name) if chat else accumulator.completion_body(served.name)
    return json_response(body)


async def _sse_body(
    stream: RequestStream, builder: CompletionStream | ChatCompletionStream, served: ServedModel, n: int
) -> AsyncIterator[bytes]:
    """The response body of a streamed request. Holds no cancel scope or
    nursery across a ``yield``: the deadline lives in the engine."""
    try:
        try:
            async for output in stream:
                served.observe(output, n)
                if chunks := builder.chunks(output):
                    yield sse_events(chunks)
        except Exception as exc:
            # The status (200) is sent already: say it in the stream.
            yield sse_error(translate(exc))
        else:
            if chunks := builder.final_chunks():
                yield sse_events(chunks)
        yield SSE_DONE
    finally:
        # Runs when the client disconnected too (the body is closed then):
        # closing the stream aborts the request if it is still running.
        stream.close()
        served.metrics.forget(stream.request_id)
