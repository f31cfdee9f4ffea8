"""Anthropic's Messages API: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, for the anthropic SDK and the tools
built on it.

A request is translated into the chat completions body
(web/anthropic_messages.py) and parsed, prepared and queued as the chat
path does it (web/completions.py); the chat answer is then told in
Anthropic's shapes (web/anthropic_reply.py, web/anthropic_stream.py).
Every error on these paths, the API key's and the body's included, is
rewritten into Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}``, with the field at fault named in the message: the routes
live in their own blueprint, whose ``after_request`` sees every response
of its paths.

Latency objectives (body extension fields or ``x-slo-*`` headers) take
the chat path's door (web/slo_door.py): a refusal is a 429
``rate_limit_error`` (503 ``overloaded_error`` while the engine runs
degraded) with ``Retry-After``, and ``usage.slo`` reports them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import trio
from quart import Blueprint, Response, g, request

from trioserve.actors import RequestStream
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.plugins import RequestContext
from trioserve.engine.text.tokenizer import apply_chat_template

from . import completions, tracing
from .anthropic_messages import MessagesBody, anthropic_names
from .anthropic_reply import message_body
from .anthropic_stream import MessageStream, sse_event, sse_events
from .body import request_json
from .completion_bodies import OutputAccumulator
from .errors import ApiError, RequestTimeout
from .fields import invalid
from .host import current_host
from .plugins import current_plugins
from .protocol import ChatCompletionRequest
from .responses import json_response
from .served import ServedModel
from .timeouts import effective_timeout, parse_timeout_header

ENDPOINT = "messages"
# Anthropic's error types by HTTP status; other 4xx are invalid requests.
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def blueprint() -> Blueprint:
    """The Messages API's routes, their errors in Anthropic's shape."""
    routes = Blueprint("anthropic", __name__)
    routes.add_url_rule("/v1/messages", view_func=create_message, methods=["POST"])
    routes.add_url_rule("/v1/messages/count_tokens", view_func=count_tokens, methods=["POST"])
    routes.after_request(anthropic_error)
    return routes


def error_json(status: int, message: str, param: str | None = None) -> dict[str, object]:
    """Anthropic's error body; its error has no field for ``param``, so the
    message names it unless it does already."""
    if param and param not in message:
        message = f"{param}: {message}"
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


async def anthropic_error(response: Response) -> Response:
    """An error response of the app's (OpenAI's shape) in Anthropic's."""
    if response.status_code < 400 or response.mimetype != "application/json":
        return response
    error = json.loads(await response.get_data()).get("error")
    if isinstance(error, dict):
        body = error_json(response.status_code, str(error.get("message")), error.get("param"))
        response.set_data(json.dumps(body, ensure_ascii=False))
    return response


def _chat_request(messages: MessagesBody) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.from_json(messages.chat)
    except ApiError as error:
        raise _renamed(error) from None


def _renamed(error: ApiError) -> ApiError:
    """``error`` naming fields as the Anthropic body does (the chat body's
    names for a tool's fields differ)."""
    error.message = anthropic_names(error.message)
    error.param = None if error.param is None else anthropic_names(error.param)
    return error


async def create_message() -> Response:
    """Answer a message as the chat path answers its chat completion:
    the same steps, through ``completions``' own helpers (``submit_chat``,
    ``first_output``), so that a change there reaches both APIs; only the
    shapes in and out are Anthropic's."""
    arrival = trio.current_time()
    host = current_host()
    plugins = current_plugins()
    body = request_json()
    model = body.get("model") if isinstance(body.get("model"), str) else None
    body = plugins.preprocess(body, RequestContext(ENDPOINT, model))
    messages = MessagesBody.from_json(body)
    parsed = _chat_request(messages)
    served = host.get(parsed.model)
    g.model_name = served.name
    log_requests = host.config.log_requests
    timeout = effective_timeout(  # Anthropic's body has no timeout field: the header's and the server's
        None, parse_timeout_header(request.headers.get(completions.TIMEOUT_HEADER)), host.config.max_request_time
    )
    params = served.engine.sampling_defaults.apply(parsed.params)
    try:
        queued = await completions.submit_chat(parsed, served, host.config, None if timeout is None else arrival + timeout)
    except ApiError as error:
        raise _renamed(error) from None
    stream, reading, report = queued.stream, queued.reading, queued.slo
    stream = tracing.follow(stream, params, parsed.model, served.name)
    stream = plugins.postprocessed(stream, RequestContext(ENDPOINT, served.name, stream.request_id, body), 1)
    if messages.stream:
        first = None
        if served.engine.config.max_queue_time is not None:
            first = await completions.first_output(stream, served, 1, log_requests=log_requests)
        events = MessageStream(served.name, reading, messages.stop_sequences)
        events.report_slo(report)
        return completions.event_stream(_event_body(stream, events, served, first, log_requests=log_requests))
    accumulator = OutputAccumulator(n=1)
    accumulator.report_slo(report)
    await completions.gather(stream, accumulator, served, 1, log_requests=log_requests)
    if accumulator.timed_out:
        raise RequestTimeout(timeout, accumulator.num_output_tokens)
    chat = accumulator.chat_completion_body(served.name, reading=reading)
    return json_response(message_body(chat, served.name, messages.stop_sequences))


async def _event_body(
    stream: RequestStream,
    events: MessageStream,
    served: ServedModel,
    first: RequestOutput | None,
    *,
    log_requests: bool,
) -> AsyncIterator[bytes]:
    """The body of a streamed message. An error after the status went
    out is an ``error`` event, as Anthropic's streams end on one."""
    try:
        try:
            if first is not None and (out := events.events(first)):
                yield sse_events(out)
            async for output in stream:
                served.observe(output, 1)
                if out := events.events(output):
                    yield sse_events(out)
        except Exception as exc:
            error = completions.translate(exc, log_requests=log_requests)
            yield sse_event("error", error_json(error.status, error.message, error.param))
        else:
            yield sse_events(events.final_events())
    finally:
        # Runs on a client's disconnect too: closing aborts the request.
        stream.close()
        served.metrics.forget(stream.request_id)


async def count_tokens() -> Response:
    """``{"input_tokens": N}``: the prompt's tokens as ``/v1/messages`` would
    render it (the same messages, tools and template)."""
    host = current_host()
    messages = MessagesBody.from_json(request_json(), counting=True)
    parsed = _chat_request(messages)
    served = host.get(parsed.model)
    g.model_name = served.name
    try:
        new, _ = completions.chat_input(parsed, parsed.request, served, host.config)
        prompt = new.prompt
        if not isinstance(prompt, list | tuple) or not all(isinstance(t, int) for t in prompt):
            # Not rendered on the web side: the engine templates it so.
            prompt = apply_chat_template(served.engine.tokenizer, parsed.engine_prompt, add_generation_prompt=True)
    except InvalidRequestError as exc:
        raise invalid(exc, {"prompt": "messages"}) from None
    return json_response({"input_tokens": len(prompt)})
