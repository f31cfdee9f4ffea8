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
from trioserve.engine.text.tokenizer import apply_chat_template

from . import anthropic_api, batches_api, chat_page, completions, files_api, openai_responses_api, request_ids
from .body import body_left_unread, read_body, request_json
from .embeddings_api import create_embedding
from .errors import ApiError, AuthenticationError, InternalError, InvalidRequest, NotFoundError, log_unexpected
from .fields import invalid
from .health import health_report
from .host import HostState, ModelHost, current_host
from .lora_api import blueprint as lora_blueprint
from .lora_models import adapter_cards
from .protocol import DetokenizeRequest, TokenizeRequest
from .responses import error_response, json_response

log = logging.getLogger(__name__)

# With an API key set, every path needs it but these: load balancers and
# scrapers poll them without one (as vLLM leaves them open). A path missing
# from this list, unknown ones included, answers 401 before 404, so an
# unauthenticated client learns nothing of what exists. The chat page is
# open too: it holds no data and asks for the key itself.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", *chat_page.PATHS})
# Paths whose refusals are counted in the metrics, by model.
API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
# Characters of a request body that --log-requests logs, at most.
MAX_LOGGED_BODY = 4096

# The rejection reason counted for each refusal status (see web/metrics.py).
_REJECT_REASONS = {400: "invalid", 401: "unauthorized", 404: "not_found", 413: "too_large", 429: "overloaded"}


def register(app: Quart) -> None:
    """Add every route and handler to ``app``."""
    request_ids.register(app)  # first: a refusal carries the id too
    app.before_request(check_api_key_and_read_body)
    app.add_url_rule("/v1/completions", view_func=completions.create_completion, methods=["POST"])
    app.add_url_rule("/v1/chat/completions", view_func=completions.create_chat_completion, methods=["POST"])
    app.add_url_rule("/v1/embeddings", view_func=create_embedding, methods=["POST"])
    app.add_url_rule("/v1/models", view_func=list_models, methods=["GET"])
    app.add_url_rule("/health", view_func=health, methods=["GET"])
    app.add_url_rule("/metrics", view_func=metrics, methods=["GET"])
    app.add_url_rule("/tokenize", view_func=tokenize, methods=["POST"])
    app.add_url_rule("/detokenize", view_func=detokenize, methods=["POST"])
    app.add_url_rule("/version", view_func=version, methods=["GET"])
    app.register_blueprint(anthropic_api.blueprint())
    batches_api.register(app)  # and /v1/files
    app.register_blueprint(openai_responses_api.blueprint())
    app.register_blueprint(lora_blueprint())  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    chat_page.register(app)
    app.register_error_handler(ApiError, handle_api_error)
    app.register_error_handler(HTTPException, handle_http_exception)
    app.register_error_handler(Exception, handle_unexpected)


async def check_api_key_and_read_body() -> None:
    """Refuse a request without the API key before reading its body (an
    unauthenticated client uploads nothing), then read the body."""
    config = current_host().config
    if config.api_key is not None and request.path not in OPEN_PATHS:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if not scheme and "x-api-key" in request.headers:  # Anthropic's clients send it so
            scheme, token = "bearer", request.headers["x-api-key"]
        # compare_digest: the time taken says nothing about how much matched.
        # As bytes: the header's as the client sent them (quart decoded
        # them as Latin-1), the key's in UTF-8 (as argv gave them).
        given = token.strip().encode("latin-1")
        expected = config.api_key.encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, expected):
            raise AuthenticationError()
    # An upload of a batch's lines may be larger than any request body.
    uploading = request.method == "POST" and request.path == files_api.PATH
    await read_body(config.max_upload_size if uploading else config.max_body_size, config.body_timeout)
    if config.log_requests and g.body:
        text = g.body[:MAX_LOGGED_BODY].decode("utf-8", "backslashreplace")
        more = len(g.body) - MAX_LOGGED_BODY
        log.info("%s %s: %s%s", request.method, request.path, text, f" ... ({more} more bytes)" if more > 0 else "")


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
                # What fills the sampling fields a request leaves out, and where it comes from.
                "sampling_defaults": served.engine.sampling_defaults.as_json() if served is not None else None,
                # "native", or "transformers": the slower transformers fallback (engine/models/hf_fallback.py).
                "implementation": served.implementation if served is not None else None,
            }
        )
    data += adapter_cards(host.models.values())  # LoRA adapters, each with its base model as parent
    return json_response({"object": "list", "data": data})


async def health() -> Response:
    try:
        current_host().raise_unless_ready()
    except ApiError as error:
        return error_response(error)
    return json_response(health_report(current_host().models))


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
        raise invalid(exc) from None
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
    host = current_host()
    return json_response(
        {
            "version": metadata.version("trioserve"),
            "cpu": cpu_report(host),
            "kv_cache": kv_report(host),
            "invariance": invariance_report(host),
        }
    )


def invariance_report(host: ModelHost) -> dict[str, object]:
    """Each served model's batch invariance (``model.Invariance``; None
    until a worker process has reported its model): whether a request's
    tokens do not depend on what shares its steps, and why."""
    report: dict[str, object] = {}
    for name, served in list(host.models.items()):
        invariance = served.engine.projection_choice.invariance
        report[name] = None if invariance is None else invariance.as_json()
    return report


def kv_report(host: ModelHost) -> dict[str, object]:
    """Each served model's KV cache: its dtype and pool size, and why (engine/core/kv_budget.py)."""
    report = {}
    for name, served in list(host.models.items()):
        core = served.engine.core
        report[name] = {**core.kv_pool.as_json(), "dtype_reason": core.kv_dtype.reason}
    return report


def cpu_report(host: ModelHost) -> dict[str, object] | None:
    """What this CPU runs (``CpuPaths.as_json()``) and, under ``models``, the
    path each model served on CPU took and why; None until one has loaded."""
    paths = None
    chosen = {}
    for name, served in list(host.models.items()):
        loaded = served.engine.core.loaded
        if loaded.cpu_paths is not None:
            paths = paths or loaded.cpu_paths
            chosen[name] = served.engine.projection_choice.as_json()
    return None if paths is None else {**paths.as_json(), "models": chosen}


# -- errors --------------------------------------------------------------------


async def handle_api_error(error: ApiError) -> Response:
    reason = _REJECT_REASONS.get(error.status)
    if error.status == 503 and error.code in ("draining", "queue_timeout"):
        reason = error.code
    if reason is not None and request.path.startswith(API_PREFIXES):
        host = current_host()
        # Label by a served model only: a client's unknown name would make
        # a new series per typo.
        host.metrics.reject(g.get("model_name", host.default_name), reason)
    response = error_response(error)
    if body_left_unread():
        # Tell the client what hypercorn does next: with the rest of the
        # body unread, the connection cannot carry another request.
        response.headers["Connection"] = "close"
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
    """A bug: logged with its traceback, answered with a 500 naming only
    the exception's class (no traceback, message or path in the body)."""
    what = f"unexpected error in {request.method} {request.path}"
    log_unexpected(log, what, exc, with_message=current_host().config.log_requests)
    return error_response(InternalError(f"internal server error ({type(exc).__name__})"))
