"""``POST /v1/embeddings``: OpenAI's embeddings API on a model served with
``--task embed`` (engine/sampling/pooling.py).

Every input of a call is queued at once (``submit_nowait``, so a refusal
is a status before anything runs) and the engine batches them like any
requests: they share steps, deadlines and admission with the rest. The
vectors come back as floats, or with ``encoding_format`` ``base64`` as the
base64 of their little-endian float32 bytes, as OpenAI sends them (and as
the ``openai`` client asks for them by default).
"""

from __future__ import annotations

import base64
import struct
from typing import Any

import attrs
import trio
from quart import Response, g, request

from trioserve.actors import RequestStream
from trioserve.engine.core.new_request import RequestInput
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.core.sequence import FinishReason
from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.sampling.pooling import PoolingParams

from . import request_ids
from .body import request_json
from .completions import TIMEOUT_HEADER, translate
from .errors import ApiError, InvalidRequest, RequestTimeout
from .fields import invalid, is_token_ids, string
from .host import current_host
from .json_body import require_object
from .responses import json_response
from .served import ServedModel
from .timeouts import effective_timeout, parse_timeout_header

# The most inputs one call may embed (OpenAI's limit).
MAX_INPUTS = 2048
ENCODINGS = ("float", "base64")
# The engine's names for the body's fields where they differ.
_NAMES = {"prompt": "input"}


@attrs.frozen(kw_only=True)
class EmbeddingRequest:
    """A parsed ``POST /v1/embeddings`` body."""

    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str
    dimensions: int | None

    @classmethod
    def from_json(cls, body: Any) -> EmbeddingRequest:
        body = require_object(body)
        encoding = string(body, "encoding_format", "float")
        if encoding not in ENCODINGS:
            raise InvalidRequest(f"encoding_format must be one of {', '.join(ENCODINGS)}, got {encoding!r}", param="encoding_format")
        string(body, "user", None)  # OpenAI's end-user id: checked, not used
        dimensions = body.get("dimensions")
        if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1):
            raise InvalidRequest(f"dimensions must be a positive integer, got {dimensions!r}", param="dimensions")
        return cls(model=string(body, "model", None), inputs=_inputs(body), encoding_format=encoding, dimensions=dimensions)


def _inputs(body: dict[str, Any]) -> tuple[str | tuple[int, ...], ...]:
    """``input``: a string, a list of token ids, or a list of either (one
    vector each). Each is judged by the engine's rules for a prompt."""
    value = body.get("input")
    if value is None:
        raise InvalidRequest("input is required", param="input")
    if isinstance(value, str) or (is_token_ids(value) and value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(i, str) or is_token_ids(i) for i in value):
        items = value
    else:
        raise InvalidRequest(
            "input must be a string, a list of token ids, or a non-empty list of strings or of token-id lists",
            param="input",
        )
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(f"input may hold at most {MAX_INPUTS} items, got {len(items)}", param="input")
    return tuple(i if isinstance(i, str) else tuple(i) for i in items)


async def create_embedding() -> Response:
    arrival = trio.current_time()
    host = current_host()
    parsed = EmbeddingRequest.from_json(request_json())
    served = host.get(parsed.model)
    g.model_name = served.name  # rejections from here on count against this model
    timeout = effective_timeout(parse_timeout_header(request.headers.get(TIMEOUT_HEADER)), host.config.max_request_time)
    deadline = None if timeout is None else arrival + timeout
    log_requests = host.config.log_requests
    streams: list[RequestStream] = []
    try:
        pooling = PoolingParams(parsed.dimensions)
        for prompt in parsed.inputs:
            new = RequestInput(prompt, pooling=pooling)
            options = dict(deadline=deadline, final_only=True)
            if not streams:
                streams.append(request_ids.submit_nowait(served.engine, new, **options))
            else:  # a call's later inputs: its id with ``.INDEX`` after it
                request_id = f"{streams[0].request_id}.{len(streams)}"
                streams.append(served.engine.submit_nowait(new, request_id=request_id, **options))
    except BaseException as exc:
        for stream in streams:  # the inputs queued before the refusal
            stream.close()
            served.metrics.forget(stream.request_id)
        if isinstance(exc, InvalidRequestError):
            raise invalid(exc, _NAMES) from None
        if not isinstance(exc, Exception):
            raise
        raise translate(exc, log_requests=log_requests) from None
    outputs = await _gather(streams, served, log_requests=log_requests)
    if any(output.finish_reason is FinishReason.DEADLINE for output in outputs):
        raise RequestTimeout(timeout)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(_vector(output), parsed.encoding_format)}
        for i, output in enumerate(outputs)
    ]
    tokens = sum(output.num_prompt_tokens for output in outputs)
    return json_response(
        {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def _gather(streams: list[RequestStream], served: ServedModel, *, log_requests: bool) -> list[RequestOutput]:
    """Each input's final output, read side by side; the first failure
    ends them all and is raised as its ``ApiError``."""
    outputs: list[RequestOutput | None] = [None] * len(streams)
    failures: list[ApiError] = []

    async def one(i: int, stream: RequestStream, cancel: trio.CancelScope) -> None:
        try:
            async for output in stream:
                served.observe(output, 1)
                outputs[i] = output
        except Exception as exc:
            failures.append(translate(exc, log_requests=log_requests))
            cancel.cancel()
        finally:
            stream.close()
            served.metrics.forget(stream.request_id)

    async with trio.open_nursery() as nursery:
        for i, stream in enumerate(streams):
            nursery.start_soon(one, i, stream, nursery.cancel_scope)
    if failures:
        raise failures[0]
    assert all(output is not None and output.finished for output in outputs)
    return outputs  # type: ignore[return-value]


def _vector(output: RequestOutput) -> tuple[float, ...]:
    if output.embedding is None:
        # Aborted under it (the server draining): no vector came.
        raise ApiError(503, "the server stopped before this input was embedded", type="server_error", code="aborted")
    return output.embedding


def _encode(vector: tuple[float, ...], encoding: str) -> list[float] | str:
    """The vector as JSON numbers, or base64 of its little-endian float32 bytes."""
    if encoding == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
