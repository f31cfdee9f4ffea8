"""Translation between the proto's messages and the engine's values.

``request_input`` builds the engine's ``RequestInput`` and
``SamplingParams`` from a request, so their own validators judge it (an invalid value raises
``InvalidRequestError`` naming the field, as over HTTP); fields left unset
keep the engine's defaults. ``status_of`` maps an error as the HTTP API
states it (``host.ClientError``: the server's ``ApiError``) to a gRPC
status code.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.core.new_request import RequestInput
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.sampling.sampling_params import SamplingParams
from . import trioserve_pb2 as pb
from .host import ClientError

# SamplingParameters' fields that are `optional` scalars: unset keeps the default.
_OPTIONAL_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "include_stop_str_in_output",
    "ignore_eos",
    "skip_special_tokens",
)

# The gRPC code for each HTTP status the server's errors carry.
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def sampling_params(message: pb.SamplingParameters) -> SamplingParams:
    """The request's ``SamplingParams``; raises ``InvalidRequestError`` naming a bad field."""
    fields: dict[str, Any] = {name: getattr(message, name) for name in _OPTIONAL_FIELDS if message.HasField(name)}
    if message.stop:
        fields["stop"] = tuple(message.stop)
    if message.stop_token_ids:
        fields["stop_token_ids"] = tuple(message.stop_token_ids)
    if message.logit_bias:
        fields["logit_bias"] = dict(message.logit_bias)
    if message.logits_processors:
        fields["logits_processors"] = [_processor(p) for p in message.logits_processors]
    return SamplingParams(**fields)


def _processor(message: pb.LogitsProcessor) -> dict[str, Any]:
    try:
        args = json.loads(message.args_json) if message.args_json else {}
    except ValueError as exc:
        raise InvalidRequestError(f"logits_processors: args_json of {message.name!r} is not JSON: {exc}", field="logits_processors") from None
    return {"name": message.name, "args": args}


def request_input(request: pb.GenerateRequest) -> RequestInput:
    """The request's ``RequestInput`` (its prompt, text or token ids, its
    parameters and priority); raises ``InvalidRequestError`` naming a bad
    field, or ``prompt`` if neither prompt is set."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise InvalidRequestError("prompt must be set: text or token_ids", field="prompt")
    prompt = request.text if which == "text" else tuple(request.token_ids.ids)
    return RequestInput(prompt, sampling_params(request.params), request.priority)


def response(output: RequestOutput) -> pb.GenerateResponse:
    """One delta as a ``GenerateResponse``; the last of a completion carries its usage."""
    message = pb.GenerateResponse(
        request_id=output.request_id,
        index=output.index,
        text=output.text_delta,
        token_ids=output.new_token_ids,
    )
    if output.finish_reason is not None:
        message.finish_reason = output.finish_reason.value
        if output.stop_reason is not None:
            message.stop_reason = str(output.stop_reason)
        message.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=output.num_prompt_tokens,
                completion_tokens=output.num_output_tokens,
                cached_tokens=output.num_cached_tokens,
            )
        )
    return message


def status_of(error: ClientError) -> grpc.StatusCode:
    """The gRPC status for an API error: 400 is INVALID_ARGUMENT, 429
    RESOURCE_EXHAUSTED, 503 UNAVAILABLE, other 5xx INTERNAL."""
    return _CODES.get(error.status, grpc.StatusCode.INTERNAL)


def trailing_metadata(error: ClientError) -> tuple[tuple[str, str], ...]:
    """The error's field (``param``), machine-readable ``code`` and
    ``Retry-After`` as trailing metadata, for clients that want more than
    the message (which names the field already)."""
    metadata = []
    if error.param is not None:
        metadata.append(("trioserve-param", error.param))
    if error.code is not None:
        metadata.append(("trioserve-code", error.code))
    if "Retry-After" in error.headers:
        metadata.append(("retry-after", error.headers["Retry-After"]))
    return tuple(metadata)
