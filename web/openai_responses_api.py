"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``.

A request is translated into the chat completions body
(web/openai_responses.py) and parsed, prepared and queued as the chat
path does it (web/completions.py's ``submit_chat`` and ``first_output``,
as web/anthropic_api.py uses them); the chat answer is then told as a
``response`` object (web/openai_responses_output.py) or its typed events
(web/openai_responses_stream.py). Errors keep the app's
OpenAI shape, the field at fault named as the Responses body names it.

A response is kept unless the request sent ``store: false``
(web/responses_store.py, in the host: bounded, per process), so it can
be read back, deleted, and continued by a request whose
``previous_response_id`` names it: that request's prompt is the stored
conversation (its input and output items) followed by its own input.
``background: true`` is refused: every response here is answered while
the request waits.

Latency objectives (``ttft_ms``, ``tpot_ms``, ``slo_mode``,
``slo_allow_shorter`` as body extension fields, or the ``x-slo-*``
headers) take the chat path's door (web/slo_door.py); a refusal is the
app's error (429 or 503), and ``usage.slo`` reports them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import trio
from quart import Blueprint, Response, g, request

from trioserve.actors import RequestStream
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.plugins import RequestContext

from . import completions, tracing
from .body import request_json
from .completion_bodies import OutputAccumulator
from .errors import ApiError, InvalidRequest, NotFoundError, RequestTimeout
from .host import ModelHost, current_host
from .json_body import require_object
from .openai_responses import ResponsesBody, output_conversation, responses_names
from .openai_responses_output import ResponseShape, new_id
from .openai_responses_stream import ResponseEvents, sse_events
from .plugins import current_plugins
from .protocol import ChatCompletionRequest
from .responses import json_response
from .responses_store import StoredResponse
from .served import ServedModel
from .timeouts import effective_timeout, parse_timeout_header

ENDPOINT = "responses"


def blueprint() -> Blueprint:
    """The Responses API's routes."""
    routes = Blueprint("openai_responses", __name__)
    routes.add_url_rule("/v1/responses", view_func=create_response, methods=["POST"])
    routes.add_url_rule("/v1/responses/<response_id>", view_func=get_response, methods=["GET"])
    routes.add_url_rule("/v1/responses/<response_id>", view_func=delete_response, methods=["DELETE"])
    return routes


def _renamed(error: ApiError) -> ApiError:
    """``error`` naming fields as the Responses body does."""
    error.message = responses_names(error.message)
    error.param = None if error.param is None else responses_names(error.param)
    return error


def _previous(host: ModelHost, body: dict[str, object]) -> StoredResponse | None:
    previous_id = body.get("previous_response_id")
    if previous_id is None:
        return None
    if not isinstance(previous_id, str):
        raise InvalidRequest("previous_response_id must be a string", param="previous_response_id")
    previous = host.responses.get(previous_id)
    if previous is None:
        raise InvalidRequest(
            f"previous_response_id: no stored response has id {previous_id!r} (never stored, sent with store false, "
            "deleted, or dropped for newer ones)",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return previous


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"no stored response has id {response_id!r}", param="response_id", code="response_not_found")


async def get_response(response_id: str) -> Response:
    stored = current_host().responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return json_response(stored.body)


async def delete_response(response_id: str) -> Response:
    if not current_host().responses.delete(response_id):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


async def create_response() -> Response:
    """Answer a response as the chat path answers its chat completion:
    the same steps through ``completions``' helpers; only the shapes in
    and out are the Responses API's."""
    arrival = trio.current_time()
    host = current_host()
    plugins = current_plugins()
    body = require_object(request_json())
    model = body.get("model") if isinstance(body.get("model"), str) else None
    body = plugins.preprocess(body, RequestContext(ENDPOINT, model))
    responses = ResponsesBody.from_json(body, _previous(host, body))
    try:
        parsed = ChatCompletionRequest.from_json(responses.chat)
    except ApiError as error:
        raise _renamed(error) from None
    served = host.get(parsed.model)
    g.model_name = served.name
    log_requests = host.config.log_requests
    timeout = effective_timeout(  # the body has no timeout field: the header's and the server's
        None, parse_timeout_header(request.headers.get(completions.TIMEOUT_HEADER)), host.config.max_request_time
    )
    params = served.engine.sampling_defaults.apply(parsed.params)
    shape = ResponseShape(new_id("resp"), served.name, responses, params.temperature, params.top_p)
    try:
        queued = await completions.submit_chat(
            parsed, served, host.config, None if timeout is None else arrival + timeout, max_tokens_field="max_output_tokens"
        )
    except ApiError as error:
        raise _renamed(error) from None
    stream, reading, report = queued.stream, queued.reading, queued.slo
    stream = tracing.follow(stream, params, parsed.model, served.name)
    stream = plugins.postprocessed(stream, RequestContext(ENDPOINT, served.name, stream.request_id, body), 1)
    tokenizer = served.engine.tokenizer

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    def keep(response: dict[str, object]) -> None:
        if responses.store:
            conversation = (*responses.conversation, *output_conversation(response["output"]))  # type: ignore[arg-type]
            host.responses.put(StoredResponse(response, conversation))

    if responses.stream:
        first = None
        if served.engine.config.max_queue_time is not None:
            first = await completions.first_output(stream, served, 1, log_requests=log_requests)
        events = ResponseEvents(shape, reading, count_tokens)
        events.report_slo(report)
        return completions.event_stream(_event_body(stream, events, served, first, keep, log_requests=log_requests))
    accumulator = OutputAccumulator(n=1)
    accumulator.report_slo(report)
    await completions.gather(stream, accumulator, served, 1, log_requests=log_requests)
    if accumulator.timed_out:
        raise RequestTimeout(timeout, accumulator.num_output_tokens)
    answer = shape.from_chat(accumulator.chat_completion_body(served.name, reading=reading), count_tokens)
    keep(answer)
    return json_response(answer)


async def _event_body(
    stream: RequestStream,
    events: ResponseEvents,
    served: ServedModel,
    first: RequestOutput | None,
    keep: Callable[[dict[str, object]], None],
    *,
    log_requests: bool,
) -> AsyncIterator[bytes]:
    """The body of a streamed response; kept in the store once whole. An
    error after the status went out is an ``error`` event."""
    try:
        try:
            if first is not None and (out := events.events(first)):
                yield sse_events(out)
            async for output in stream:
                served.observe(output, 1)
                if out := events.events(output):
                    yield sse_events(out)
        except Exception as exc:
            error = _renamed(completions.translate(exc, log_requests=log_requests))
            yield sse_events([events.error_event(error)])
        else:
            last = events.final_events()
            assert events.response is not None
            keep(events.response)
            yield sse_events(last)
    finally:
        # Runs on a client's disconnect too: closing aborts the request.
        stream.close()
        served.metrics.forget(stream.request_id)
