"""LoRA adapters loaded and unloaded over HTTP (vLLM's endpoints): ``POST
/v1/load_lora_adapter`` ``{lora_name, lora_path}`` and ``POST
/v1/unload_lora_adapter`` ``{lora_name}``, behind the API key like the
rest. Refusals use OpenAI's error shape naming the field; the server goes
on serving. How requests and ``/v1/models`` see the adapters: lora_models.py.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from trioserve.engine.lora import LoraError, LoraInUse, LoraNotFound

from .body import request_json
from .errors import ApiError, InvalidRequest, NotFoundError
from .host import current_host
from .lora_models import adapters_of, served_adapter, serves_lora
from .responses import json_response


def _text_field(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if value is None:
        raise InvalidRequest(f"{field} is required", param=field)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{field} must be a non-empty string, got {value!r}", param=field)
    return value


def _api_error(exc: LoraError) -> ApiError:
    if isinstance(exc, LoraNotFound):
        return NotFoundError(str(exc), param=exc.field, code="lora_not_found")
    if isinstance(exc, LoraInUse):
        return ApiError(409, str(exc), type="invalid_request_error", param=exc.field, code="lora_in_use")
    return InvalidRequest(str(exc), param=exc.field, code="invalid_lora_adapter")


async def load_lora_adapter() -> Response:
    host = current_host()
    body = request_json()
    name, path = _text_field(body, "lora_name"), _text_field(body, "lora_path")
    host.raise_unless_ready()
    if name in host.config.model_names or served_adapter(host.models.values(), name) is not None:
        raise InvalidRequest(f"the name {name!r} is taken by a served model or adapter", param="lora_name")
    served = next((s for s in host.models.values() if serves_lora(s)), None)
    if served is None:
        raise InvalidRequest("this server serves no LoRA adapters: start it with --enable-lora", param="lora_name")
    try:
        adapter = await served.engine.load_lora(name, path)
    except LoraError as exc:
        raise _api_error(exc) from None
    served.metrics.add_model(name)
    return json_response({"object": "lora_adapter", "id": name, "root": adapter.path, "parent": served.name})


async def unload_lora_adapter() -> Response:
    host = current_host()
    name = _text_field(request_json(), "lora_name")
    host.raise_unless_ready()
    served = next((s for s in host.models.values() if any(a.name == name for a in adapters_of(s))), None)
    if served is None:
        raise NotFoundError(f"no LoRA adapter {name!r} is loaded", param="lora_name", code="lora_not_found")
    try:
        await served.engine.unload_lora(name)
    except LoraError as exc:
        raise _api_error(exc) from None
    return json_response({"object": "lora_adapter", "id": name, "deleted": True})


def blueprint() -> Blueprint:
    """The two endpoints, for ``routes.register``."""
    bp = Blueprint("lora", __name__)
    bp.add_url_rule("/v1/load_lora_adapter", view_func=load_lora_adapter, methods=["POST"])
    bp.add_url_rule("/v1/unload_lora_adapter", view_func=unload_lora_adapter, methods=["POST"])
    return bp
