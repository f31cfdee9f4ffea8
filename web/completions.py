"""``POST /v1/completions`` and ``POST /v1/chat/completions``.

A handler parses the body, picks the served model, works out the request's
deadline and queues it with ``engine.submit_nowait``, so every refusal
(invalid, too long, overloaded, draining) is an HTTP status before any byte
of the response. Then it either streams the engine's deltas as SSE chunks or
gathers them into one JSON body. The deadline is the engine's own
(``deadline=``): when it passes the engine ends each completion with finish
reason ``DEADLINE`` and frees its KV blocks.

A client that goes away cancels the handler (quart-trio cancels it when the
ASGI server reports the disconnect); closing the request's stream then sends
the engine its ``Abort``.

Overload control may drop a queued request before any compute (a queue
timeout: 503; shed for a higher priority: 429). With ``max_queue_time`` set,
a streamed response's status waits for the request's first output, so such a
request gets its status like a non-streamed one; a stream already started
ends each completion with finish reason ``queue_timeout`` or ``shed``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import attrs
import trio
from quart import Response, g, request

from trioserve.actors import RequestStream
from trioserve.actors.errors import RequestDropped, RequestFailed
from trioserve.actors.deltas import final_output
from trioserve.engine.errors import TrioserveError
from trioserve.engine.core.new_request import RequestInput
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.plugins import RequestContext

from .body import request_json
from . import request_ids, slo_door, tracing
from .completion_bodies import ChatCompletionStream, CompletionStream, OutputAccumulator, batch_completion_body
from .errors import ApiError, RequestTimeout, from_exception
from .host import current_host
from .plugins import current_plugins
from .protocol import CHAT_NAMES, ChatCompletionRequest, CompletionRequest
from .responses import json_response
from .served import ServedModel
from .sse import SSE_DONE, sse_error, sse_events
from .timeouts import effective_timeout, parse_timeout_header
from .output_reader import ChatReading
from .parsers import OutputParsers
from .reasoning import prompt_opens_thinking
from .settings import ServerConfig
from .slo import SloReport
from .structured import ModelTokens, chat_constraint
from .tools import render_prompt

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "X-Request-Timeout"


def translate(exc: Exception, *, log_requests: bool) -> ApiError:
    """The API error for an exception of the engine or the actors; a 5xx is
    logged. trioserve's own errors say nothing of the request; any other's
    message may quote it (a prompt), so it is logged only with
    ``log_requests``. A request failed by an engine fault
    (docs/reliability.md) gets a 500 whose code names the fault and whose
    message holds no inner error text."""
    if isinstance(exc, RequestFailed):
        log.error("request %s failed: %s", exc.request_id, exc)
        return ApiError(500, exc.public_message, type="server_error", code=exc.code)
    error = from_exception(exc)
    if error.status >= 500 and error.status != 503:  # 503s are overload or shutdown, not faults
        if log_requests or isinstance(exc, TrioserveError):
            log.error("request failed: %s: %s", type(exc).__name__, exc)
        else:
            log.error("request failed: %s (its message is logged with --log-requests)", type(exc).__name__)
    return error


async def create_completion() -> Response:
    return await _generate(CompletionRequest, chat=False)


async def create_chat_completion() -> Response:
    return await _generate(ChatCompletionRequest, chat=True)


async def _generate(kind: type[CompletionRequest] | type[ChatCompletionRequest], *, chat: bool) -> Response:
    arrival = trio.current_time()
    host = current_host()
    plugins = current_plugins()
    endpoint = "chat.completions" if chat else "completions"
    body = request_json()
    if isinstance(body, dict):  # anything else the parser refuses below
        model = body.get("model") if isinstance(body.get("model"), str) else None
        body = plugins.preprocess(body, RequestContext(endpoint, model))
    parsed = kind.from_json(body)
    served = host.get(parsed.model)
    g.model_name = served.name  # rejections from here on count against this model
    log_requests = host.config.log_requests
    timeout = effective_timeout(
        parsed.timeout, parse_timeout_header(request.headers.get(TIMEOUT_HEADER)), host.config.max_request_time
    )
    # What the request samples with, the fields the body left out taken
    # from the model's defaults (as the engine takes them): for the trace.
    params = served.engine.sampling_defaults.apply(parsed.params)
    reading = None
    deadline = None if timeout is None else arrival + timeout
    news = [parsed.request] if chat else list(parsed.requests)
    # Latency objectives: the body's, then the headers', then the server's defaults (web/slo_door.py).
    news = [slo_door.objectives(served, new, request.headers, parsed.model) for new in news]
    streams: list[RequestStream] = []
    try:
        if chat:
            news[0], reading = chat_input(parsed, news[0], served, host.config)
        for new in news:
            # A schema, regex or grammar compiles in a worker thread (cached).
            await served.engine.prepare(new.params)
            streams.append(_submit(served, new, streams, deadline))
    except BaseException as exc:
        for stream in streams:  # a batch's prompts queued before the refusal
            stream.close()
            served.metrics.forget(stream.request_id)
        if not isinstance(exc, Exception):
            raise
        slo_door.refused(served, news[0].priority, exc)
        raise refusal(translate(exc, log_requests=log_requests), chat) from None
    # The output cap a shortened admission lowers, by the body's name for it.
    cap = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    reports = [slo_door.admitted(served, new, stream, max_tokens_field=cap) for new, stream in zip(news, streams)]
    for i, stream in enumerate(streams):
        stream = tracing.follow(stream, params, parsed.model, served.name)  # itself when tracing is off
        context = RequestContext(endpoint, served.name, stream.request_id, body)
        streams[i] = plugins.postprocessed(stream, context, parsed.params.n)
    stream = streams[0]
    wants_prompt = not chat and parsed.prompt_logprobs is not None
    texts = served.texts if parsed.params.logprobs is not None or wants_prompt else None
    if parsed.stream:
        first = None
        if served.engine.config.max_queue_time is not None:
            first = await first_output(stream, served, parsed.params.n, log_requests=log_requests)
        builder_kind = ChatCompletionStream if chat else CompletionStream
        builder = builder_kind(served.name, texts=texts, include_usage=parsed.include_usage)
        if reading is not None:
            builder.reading = reading
        if isinstance(builder, CompletionStream):
            builder.prompt_logprobs = wants_prompt
        builder.report_slo(reports[0])
        return event_stream(_sse_body(stream, builder, served, parsed.params.n, first, log_requests=log_requests))
    accumulators = [OutputAccumulator(n=parsed.params.n, texts=texts) for _ in streams]
    for accumulator, report in zip(accumulators, reports):
        accumulator.report_slo(report)
    if not chat:
        for accumulator, new in zip(accumulators, news):
            accumulator.echo = _echo_text(new, served) if parsed.echo else None
            accumulator.drop_output = parsed.drop_output
            accumulator.prompt_logprobs = wants_prompt
    await _gather_all(streams, accumulators, served, parsed.params.n, log_requests=log_requests)
    if any(accumulator.timed_out for accumulator in accumulators):
        raise RequestTimeout(timeout, sum(accumulator.num_output_tokens for accumulator in accumulators))
    if chat:
        return json_response(accumulators[0].chat_completion_body(served.name, reading=reading))
    bodies = [accumulator.completion_body(served.name) for accumulator in accumulators]
    return json_response(bodies[0] if len(bodies) == 1 else batch_completion_body(bodies, parsed.params.n))


def _submit(served: ServedModel, new: RequestInput, streams: list[RequestStream], deadline: float | None) -> RequestStream:
    """Queue one prompt's request. The first takes the HTTP request's id;
    a batch's later prompts take that id with ``.INDEX`` after it."""
    if not streams:
        return request_ids.submit_nowait(served.engine, new, deadline=deadline)
    return served.engine.submit_nowait(new, request_id=f"{streams[0].request_id}.{len(streams)}", deadline=deadline)


def _echo_text(new: RequestInput, served: ServedModel) -> str:
    """The text ``echo`` puts first: the prompt as sent, or its token ids decoded."""
    if isinstance(new.prompt, str):
        return new.prompt
    return served.engine.tokenizer.decode(list(new.prompt), skip_special_tokens=False)


async def _gather_all(
    streams: list[RequestStream], accumulators: list[OutputAccumulator], served: ServedModel, n: int, *, log_requests: bool
) -> None:
    """Read each stream into its accumulator, the streams of a batch of
    prompts side by side; the first failure ends them all and is raised."""
    if len(streams) == 1:
        await gather(streams[0], accumulators[0], served, n, log_requests=log_requests)
        return
    failures: list[ApiError] = []

    async def one(stream: RequestStream, accumulator: OutputAccumulator, cancel: trio.CancelScope) -> None:
        try:
            await gather(stream, accumulator, served, n, log_requests=log_requests)
        except ApiError as error:
            failures.append(error)
            cancel.cancel()

    async with trio.open_nursery() as nursery:
        for stream, accumulator in zip(streams, accumulators):
            nursery.start_soon(one, stream, accumulator, nursery.cancel_scope)
    if failures:
        raise failures[0]


def event_stream(body: AsyncIterator[bytes]) -> Response:
    """An SSE response of ``body``: never cached nor buffered by a proxy,
    and without a response timeout (a stream lasts as long as generation
    does)."""
    response = Response(
        body,
        content_type="text/event-stream; charset=utf-8",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None
    return response


async def gather(
    stream: RequestStream, accumulator: OutputAccumulator, served: ServedModel, n: int, *, log_requests: bool
) -> None:
    """Read one request's outputs into ``accumulator`` (a failure: its ``ApiError``)."""
    try:
        async for output in stream:
            served.observe(output, n)
            accumulator.add(output)
    except Exception as exc:
        raise translate(exc, log_requests=log_requests) from None
    finally:
        stream.close()
        served.metrics.forget(stream.request_id)


def chat_input(
    parsed: ChatCompletionRequest, new: RequestInput, served: ServedModel, config: ServerConfig
) -> tuple[RequestInput, ChatReading]:
    """The chat request's input and how its output is read (web/parsers.py):
    the prompt is rendered here when it shows tools, takes template
    variables, or a reasoning parser must know whether it opens the
    reasoning; the parsers' special tokens are kept in the text unless the
    request said otherwise; the constraint is fitted to the model's formats
    (web/structured.py's ``chat_constraint``)."""
    tokenizer = served.engine.tokenizer
    parsers = OutputParsers.for_template(tokenizer.chat_template, config.reasoning_parser, config.tool_call_parser)
    starts_inside, text = False, ""
    if parsed.renders_tools or parsed.chat_template_kwargs or parsers.reasoning is not None:
        ids, text = render_prompt(
            tokenizer,
            parsed.engine_prompt,
            parsed.tools,
            with_tools=parsed.renders_tools,
            template_kwargs=dict(parsed.chat_template_kwargs or {}),
        )
        new = attrs.evolve(new, prompt=ids)
        starts_inside = prompt_opens_thinking(text)
    if parsers.special_tokens(parsed.tools is not None) and not parsed.sets_special_tokens:
        new = attrs.evolve(new, params=attrs.evolve(new.params, skip_special_tokens=False))
    constraint = chat_constraint(
        new.params.structured_output,
        tools=parsed.tools,
        tool_format=parsers.tools,
        reasoning=parsers.reasoning,
        prompt=text,
        tokens=ModelTokens(tokenizer),
    )
    if constraint != new.params.structured_output:
        new = attrs.evolve(new, params=attrs.evolve(new.params, structured_output=constraint))
    reading = ChatReading(parsers.reasoning, starts_inside, parsed.tools, parsers.tools)
    return new, reading


@attrs.frozen
class QueuedChat:
    """A chat request ``submit_chat`` queued: its input, how its output is
    read, its stream and its latency objectives' report (None: none)."""

    new: RequestInput
    reading: ChatReading
    stream: RequestStream
    slo: SloReport | None


async def submit_chat(
    parsed: ChatCompletionRequest,
    served: ServedModel,
    config: ServerConfig,
    deadline: float | None,
    *,
    max_tokens_field: str = "max_tokens",
) -> QueuedChat:
    """Queue one chat request as the chat path does, through the latency
    objectives' door (web/slo_door.py): what /v1/responses and
    /v1/messages do with the chat request their body became. A refusal
    raises its ``ApiError``, fields named as the chat API names them;
    ``max_tokens_field``: the body's name for its output cap, which the
    latency objectives' report names if a shortened admission lowers it."""
    new = slo_door.objectives(served, parsed.request, request.headers, parsed.model)
    try:
        new, reading = chat_input(parsed, new, served, config)
        await served.engine.prepare(new.params)
        stream = request_ids.submit_nowait(served.engine, new, deadline=deadline)
    except Exception as exc:
        slo_door.refused(served, new.priority, exc)
        raise refusal(translate(exc, log_requests=config.log_requests), True) from None
    return QueuedChat(new, reading, stream, slo_door.admitted(served, new, stream, max_tokens_field=max_tokens_field))


def refusal(error: ApiError, chat: bool) -> ApiError:
    """The engine's refusal, its field named as the chat API names it
    (its prompt is the templated messages; its logprobs, top_logprobs)."""
    if chat and error.param in CHAT_NAMES:
        error.param = CHAT_NAMES[error.param]
    return error


async def first_output(
    stream: RequestStream, served: ServedModel, n: int, *, log_requests: bool
) -> RequestOutput | None:
    """Wait for a streamed request's first output before its status goes
    out, so that a drop in the queues answers 503/429 (bounded by
    ``max_queue_time`` plus one prefill)."""
    try:
        output = await stream.__anext__()
    except StopAsyncIteration:
        return None
    except Exception as exc:
        served.metrics.forget(stream.request_id)
        raise translate(exc, log_requests=log_requests) from None
    except BaseException:
        served.metrics.forget(stream.request_id)  # the stream closed itself
        raise
    served.observe(output, n)
    return output


async def _sse_body(
    stream: RequestStream,
    builder: CompletionStream | ChatCompletionStream,
    served: ServedModel,
    n: int,
    first: RequestOutput | None = None,
    *,
    log_requests: bool,
) -> AsyncIterator[bytes]:
    """The response body of a streamed request (``first``: its first output,
    already taken and observed). Holds no cancel scope or nursery across a
    ``yield``: the deadline lives in the engine."""
    try:
        try:
            if first is not None and (chunks := builder.chunks(first)):
                yield sse_events(chunks)
            async for output in stream:
                served.observe(output, n)
                if chunks := builder.chunks(output):
                    yield sse_events(chunks)
        except RequestDropped as exc:
            # Dropped before any compute, after the status (200) went out:
            # each completion ends with the drop's own finish reason.
            for index in range(n):
                output = final_output(
                    stream.request_id,
                    index,
                    exc.finish_reason,
                    num_prompt_tokens=exc.num_prompt_tokens,
                    arrival_time=time.monotonic(),
                )
                if chunks := builder.chunks(output):
                    yield sse_events(chunks)
            if chunks := builder.final_chunks():
                yield sse_events(chunks)
        except Exception as exc:
            # The status (200) is sent already: say it in the stream.
            yield sse_error(translate(exc, log_requests=log_requests))
        else:
            if chunks := builder.final_chunks():
                yield sse_events(chunks)
        yield SSE_DONE
    finally:
        # Runs when the client disconnected too (the body is closed then):
        # closing the stream aborts the request if it is still running.
        stream.close()
        served.metrics.forget(stream.request_id)
