"""Translation between the proto's messages and the engine's values.

``request_input`` builds the engine's ``RequestInput`` and
``SamplingParams`` from a request, so their own validators judge it (an invalid value raises
``InvalidRequestError`` naming the field, as over HTTP); fields left unset
keep the engine's defaults. ``status_of`` maps an error as the HTTP API
states it (``host.ClientError``: the server's ``ApiError``) to a gRPC
status code. The latency objectives' fields go to the server's door
(host.py's ``Objectives``) by the HTTP body's names, and its report comes
back as ``Usage.slo``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import grpc

from trioserve.actors.slo_admission import SloRefused
from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.core.new_request import RequestInput
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.sampling.sampling_params import SamplingParams
from . import trioserve_pb2 as pb
from .host import ClientError, SloReport

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

# SloMode's values by the HTTP body's slo_mode, and back.
_SLO_MODE_VALUES = {"enforced": pb.SLO_MODE_ENFORCED, "best_effort": pb.SLO_MODE_BEST_EFFORT}
_SLO_MODES = {value: name for name, value in _SLO_MODE_VALUES.items()}

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


def objective_fields(request: pb.GenerateRequest) -> dict[str, Any]:
    """The latency objectives the request sets, by the HTTP body's names
    (``slo_mode`` an unknown enum value as its number: refused there)."""
    fields: dict[str, Any] = {name: getattr(request, name) for name in ("ttft_ms", "tpot_ms") if request.HasField(name)}
    if request.slo_mode != pb.SLO_MODE_UNSPECIFIED:
        fields["slo_mode"] = _SLO_MODES.get(request.slo_mode, request.slo_mode)
    if request.slo_allow_shorter:
        fields["slo_allow_shorter"] = True
    return fields


def slo_report(usage: Mapping[str, Any]) -> pb.SloReport:
    """The ``usage.slo`` report of the HTTP API (web/slo.py) as its message."""
    report = pb.SloReport(enforced=usage["enforced"], slo_mode=_SLO_MODE_VALUES[usage["slo_mode"]])
    for name in ("ttft_ms", "tpot_ms", "max_tokens_lowered_to", "reason"):
        if usage.get(name) is not None:
            setattr(report, name, usage[name])
    for kind in ("predicted", "measured"):
        for name, value in (usage.get(kind) or {}).items():
            if value is not None:
                setattr(report, f"{kind}_{name}", value)
    for name, met in usage["met"].items():
        if met is not None:
            setattr(report, f"{name}_met", met)
    return report


def response(output: RequestOutput, slo: SloReport | None = None) -> pb.GenerateResponse:
    """One delta as a ``GenerateResponse``; the last of a completion carries
    its usage, and the first completion's its objectives' ``slo`` report."""
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
        if slo is not None and output.index == 0:
            message.usage.slo.CopyFrom(slo_report(slo.usage(output.times, output.num_output_tokens)))
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


def refusal_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """For a request refused for a latency objective, which one and by how
    much, in ms (the message says it in words): ``trioserve-slo-objective``
    (``ttft_ms`` / ``tpot_ms``), ``-predicted-ms``, ``-target-ms``, ``-over-ms``."""
    if not isinstance(exc, SloRefused):
        return ()
    return (
        ("trioserve-slo-objective", exc.objective),
        ("trioserve-slo-predicted-ms", f"{exc.predicted * 1000:.1f}"),
        ("trioserve-slo-target-ms", f"{exc.target * 1000:g}"),
        ("trioserve-slo-over-ms", f"{(exc.predicted - exc.target) * 1000:.1f}"),
    )
