"""The app's routes, its API-key check and its error handlers.

Handlers only translate between HTTP and the engines: the generation
endpoints are in ``completions.py``; the rest are here.
"""

from __future__ import annotations

import hmac
import logging
from importlib import metadata

from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException

from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.tokenizer import apply_chat_template

from . import completions
from .body import read_body, request_json
from .errors import ApiError, AuthenticationError, InternalError, InvalidRequest, NotFoundError, RequestTooLarge
from .health import health_report
from .host import HostState, current_host
from .protocol import DetokenizeRequest, TokenizeRequest
from .responses import error_response, json_response

log = logging.getLogger(__name__)

# Paths that need the API key when one is set; /health, /metrics and
# /version stay open for load balancers and scrapers.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

# The rejection reason counted for each refusal status (see web/metrics.py).
_REJECT_REASONS = {400: "invalid", 401: "unauthorized", 404: "not_found", 413: "too_large", 429: "overloaded"}


def register(app: Quart) -> None:
    """Add every route and handler to ``app``."""
    app.before_request(read_body_and_check_api_key)
    app.add_url_rule("/v1/completions", view_func=completions.create_completion, methods=["POST"])
    app.add_url_rule("/v1/chat/completions", view_func=completions.create_chat_completion, methods=["POST"])
    app.add_url_rule("/v1/models", view_func=list_models, methods=["GET"])
    app.add_url_rule("/health", view_func=health, methods=["GET"])
    app.add_url_rule("/metrics", view_func=metrics, methods=["GET"])
    app.add_url_rule("/tokenize", view_func=tokenize, methods=["POST"])
    app.add_url_rule("/detokenize", view_func=detokenize, methods=["POST"])
    app.add_url_rule("/version", view_func=version, methods=["GET"])
    app.register_error_handler(ApiError, handle_api_error)
    app.register_error_handler(HTTPException, handle_http_exception)
    app.register_error_handler(Exception, handle_unexpected)


async def read_body_and_check_api_key() -> None:
    host = current_host()
    await read_body(host.config.max_body_size)
    key = host.config.api_key
    if key is None or not request.path.startswith(PROTECTED_PREFIXES):
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    # compare_digest: the time taken says nothing about how much matched.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise AuthenticationError()


# -- endpoints -----------------------------------------------------------------


async def list_models() -> Response:
    host = current_host()
    data = []
    for name in host.config.model_names:
        served = host.models.get(name)
        data.append(
            {
                "id": name,
                "object": "model",
                "created": served.created if served is not None else host.started,
                "owned_by": "trioserve",
                # Unknown until the model has loaded (unless capped by the config).
                "max_model_len": served.max_model_len if served is not None else host.config.engine.max_model_len,
            }
        )
    return json_response({"object": "list", "data": data})


async def health() -> Response:
    try:
        current_host().raise_unless_ready()
    except ApiError as error:
        return error_response(error)
    return json_response(health_report(current_host()))


async def metrics() -> Response:
    host = current_host()
    for served in list(host.models.values()):
        if host.state in (HostState.READY, HostState.DRAINING):
            served.update_metrics()
    body, content_type = host.metrics.render()
    return Response(body, content_type=content_type)


async def tokenize() -> Response:
    host = current_host()
    parsed = TokenizeRequest.from_json(request_json())
    served = host.get(parsed.model)
    g.model_name = served.name
    tokenizer = served.engine.tokenizer
    try:
        if parsed.messages is not None:
            ids = apply_chat_template(
                tokenizer, [m.as_dict() for m in parsed.messages], add_generation_prompt=parsed.add_generation_prompt
            )
            bos = tokenizer.bos_token_id
            if parsed.add_special_tokens and bos is not None and ids[:1] != [bos]:
                ids = [bos, *ids]
        else:
            ids = list(tokenizer.encode(parsed.prompt, add_special_tokens=parsed.add_special_tokens))
    except InvalidRequestError as exc:
        raise InvalidRequest(str(exc), param=exc.field) from None
    return json_response({"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids})


async def detokenize() -> Response:
    host = current_host()
    parsed = DetokenizeRequest.from_json(request_json())
    served = host.get(parsed.model)
    g.model_name = served.name
    vocab = served.engine.model_config.vocab_size
    bad = next((t for t in parsed.tokens if t >= vocab), None)
    if bad is not None:
        raise InvalidRequest(f"tokens has token id {bad} outside the vocabulary [0, {vocab})", param="tokens")
    return json_response({"prompt": served.engine.tokenizer.decode(list(parsed.tokens))})


async def version() -> Response:
    return json_response({"version": metadata.version("trioserve")})


# -- errors --------------------------------------------------------------------


async def handle_api_error(error: ApiError) -> Response:
    reason = _REJECT_REASONS.get(error.status)
    if error.status == 503 and error.code == "draining":
        reason = "draining"
    if reason is not None and request.path.startswith(PROTECTED_PREFIXES):
        host = current_host()
        # Label by a served model only: a client's unknown name would make
        # a new series per typo.
        host.metrics.reject(g.get("model_name", host.default_name), reason)
    response = error_response(error)
    if isinstance(error, RequestTooLarge):
        response.headers["Connection"] = "close"  # the body was left unread (see body.py)
    return response


async def handle_http_exception(exc: HTTPException) -> Response:
    """Quart's own errors (unknown path, wrong method, ...) in OpenAI's shape."""
    status = exc.code or 500
    if status == 404:
        error: ApiError = NotFoundError(f"no route for {request.method} {request.path}", code="not_found")
    elif status >= 500:
        error = InternalError()
    else:
        error = ApiError(status, exc.description or exc.name, type="invalid_request_error", code=exc.name.lower().replace(" ", "_"))
    return await handle_api_error(error)


async def handle_unexpected(exc: Exception) -> Response:
    log.error("unexpected error in %s %s", request.method, request.path, exc_info=exc)
    return error_response(InternalError(f"internal server error ({type(exc).__name__})"))
