"""The ``trioserve.v1.Generation`` service: its handlers run on the gRPC
server's asyncio loop and do their work in trio through a ``TrioPortal``.

``Generate`` does what ``POST /v1/completions`` does (web/completions.py):
it builds the engine's ``RequestInput`` (whose validators judge it),
queues it with ``submit_nowait`` (so every refusal is a status before any
response) and streams its deltas. The call's deadline (``context.time_remaining()``),
capped by ``--max-request-time``, becomes the request's ``deadline``, less
``DEADLINE_MARGIN`` so the final ``deadline`` delta can still reach the
client. When the call is cancelled, or its deadline passes on the client's
side first, grpcio cancels the handler; the portal cancels the trio task,
whose ``finally`` closes the request's stream: the engine aborts it at its
next step boundary and frees its KV blocks.

Latency objectives come as the request's fields (``ttft_ms``, ...) or the
call's ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` metadata and go through the
server's door (``objectives``: the HTTP API's validator, defaults and
counts); a refusal ends the call with RESOURCE_EXHAUSTED (UNAVAILABLE while
degraded) and ``messages.refusal_metadata``; ``Usage.slo`` reports them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import trio

from trioserve.engine.plugins import RequestContext

from . import messages
from . import trioserve_pb2 as pb
from . import trioserve_pb2_grpc as pb_grpc
from .host import Host, NoPlugins, Objectives, Plugins, Translate
from .portal import Emit, PortalClosed, TrioPortal

# Seconds taken off a call's deadline for the engine's, so that a request
# ended by its deadline sends its final delta before the client gives up.
DEADLINE_MARGIN = 0.05


class GenerationServicer(pb_grpc.GenerationServicer):
    """Serves ``host``'s models; every engine call goes through ``portal``.
    The output post-processors of ``plugins`` apply to ``Generate``'s
    deltas as over HTTP (the request pre-processors see HTTP bodies only).
    ``translate`` says what a failed call tells its client (a status and
    trailing metadata, ``messages.status_of``); ``objectives`` is the
    server's door for latency objectives; ``max_request_time``
    (seconds; None: none) caps every request's deadline."""

    def __init__(
        self,
        host: Host,
        portal: TrioPortal,
        *,
        translate: Translate,
        objectives: Objectives,
        plugins: Plugins | None = None,
        max_request_time: float | None = None,
    ) -> None:
        self.host = host
        self.portal = portal
        self.translate = translate
        self.objectives = objectives
        self.plugins = plugins or NoPlugins()
        self.max_request_time = max_request_time

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        remaining = context.time_remaining()
        metadata = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
        try:
            async for response in self.portal.iterate(self._generate, request, remaining, metadata):
                yield response
        except Exception as exc:
            await self._fail(context, exc)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            return await self.portal.run(self._abort, request)
        except Exception as exc:
            await self._fail(context, exc)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            return await self.portal.run(self._tokenize, request)
        except Exception as exc:
            await self._fail(context, exc)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        try:
            return await self.portal.run(self._list_models)
        except Exception as exc:
            await self._fail(context, exc)

    # -- in trio -------------------------------------------------------------------

    async def _generate(
        self, emit: Emit, request: pb.GenerateRequest, remaining: float | None, metadata: Mapping[str, str]
    ) -> None:
        arrival = trio.current_time()
        served = self.host.get(request.model or None)
        new = self.objectives.given(messages.request_input(request), messages.objective_fields(request))
        new = self.objectives.complete(served, new, metadata)
        timeout = self.max_request_time
        if remaining is not None:
            remaining = max(remaining - DEADLINE_MARGIN, 0.0)
            timeout = remaining if timeout is None else min(timeout, remaining)
        try:
            stream = served.engine.submit_nowait(
                new, request_id=request.request_id or None, deadline=None if timeout is None else arrival + timeout
            )
        except Exception as exc:
            self.objectives.refused(served, new.priority, exc)
            raise
        report = self.objectives.admitted(served, new, stream)
        n = new.params.n
        context = RequestContext("grpc.generate", served.name, stream.request_id)
        stream = self.plugins.postprocessed(stream, context, n)
        try:
            async for output in stream:
                served.observe(output, n)
                await emit(messages.response(output, report))
        finally:
            stream.close()
            served.metrics.forget(stream.request_id)

    async def _abort(self, request: pb.AbortRequest) -> pb.AbortResponse:
        served = self.host.get(request.model or None)
        return pb.AbortResponse(aborted=served.engine.abort(request.request_id))

    async def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        served = self.host.get(request.model or None)
        ids = served.engine.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        return pb.TokenizeResponse(token_ids=list(ids), max_model_len=served.max_model_len)

    async def _list_models(self) -> pb.ListModelsResponse:
        self.host.raise_unless_ready()
        models = [
            pb.ModelInfo(
                name=name,
                max_model_len=served.max_model_len,
                vocab_size=served.engine.model_config.vocab_size,
                created=served.created,
            )
            for name, served in self.host.models.items()
        ]
        return pb.ListModelsResponse(models=models)

    async def _fail(self, context: grpc.aio.ServicerContext, exc: Exception) -> Any:
        """End the call with the status for ``exc`` (raises, as ``context.abort`` does).
        Every failure, refusals before any output and errors after, goes
        through ``translate``: the message and fields the HTTP API gives."""
        if isinstance(exc, PortalClosed):
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        error = self.translate(exc)
        metadata = messages.trailing_metadata(error) + messages.refusal_metadata(exc)
        await context.abort(messages.status_of(error), error.message, metadata)

