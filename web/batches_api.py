"""``/v1/batches``: OpenAI's Batch API, over the files of ``/v1/files``.

``POST /v1/batches`` takes ``input_file_id`` (a file of purpose ``batch``),
``endpoint`` (``/v1/chat/completions``, ``/v1/completions``, or
``/v1/embeddings`` where the server serves it), ``completion_window``
(``24h``) and optional ``metadata``; ``GET /v1/batches`` lists batches
(``after``, ``limit``), ``GET /v1/batches/ID`` gives one and
``POST /v1/batches/ID/cancel`` cancels one. The batches run in the server
(web/batch_service.py) at low priority beside interactive requests.

``register(app)`` adds these routes and ``/v1/files``'s, and starts the
batches' runner in the app's serving nursery.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response
from quart_trio import QuartTrio

from . import fields, files_api
from .batch_service import EXTENSION, BatchService, current_batches, served_endpoints
from .batch_store import BatchStore, default_batch_dir
from .body import request_json
from .errors import InvalidRequest, NotFoundError
from .host import EXTENSION as HOST_EXTENSION
from .host import ModelHost
from .responses import json_response

PATH = "/v1/batches"
DEFAULT_BATCHES_LIMIT = 20
MAX_BATCHES_LIMIT = 100


def register(app: QuartTrio) -> None:
    """Serve ``/v1/files`` and ``/v1/batches`` from ``app``, keeping them in
    its config's ``batch_dir``, and run the batches while ``app`` serves."""
    host: ModelHost = app.extensions[HOST_EXTENSION]
    store = BatchStore(host.config.batch_dir or default_batch_dir())
    service = BatchService.for_app(app, host, store)
    app.extensions[EXTENSION] = service
    blueprint = Blueprint("batches", __name__)
    files_api.register(blueprint)
    blueprint.add_url_rule(PATH, view_func=create_batch, methods=["POST"])
    blueprint.add_url_rule(PATH, view_func=list_batches, methods=["GET"])
    blueprint.add_url_rule(f"{PATH}/<batch_id>", view_func=retrieve_batch, methods=["GET"])
    blueprint.add_url_rule(f"{PATH}/<batch_id>/cancel", view_func=cancel_batch, methods=["POST"])
    app.register_blueprint(blueprint)

    @app.before_serving
    async def start_batches() -> None:
        await app.nursery.start(service.run)


async def create_batch() -> Response:
    body = request_json()
    service = current_batches()
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str):
        raise InvalidRequest("input_file_id must be the id of a file uploaded with purpose 'batch'", param="input_file_id")
    endpoints = served_endpoints(service.app)
    endpoint = body.get("endpoint")
    if endpoint not in endpoints:
        raise InvalidRequest(f"endpoint must be one of {', '.join(sorted(endpoints))}; got {endpoint!r}", param="endpoint")
    window = body.get("completion_window")
    if window != "24h":
        raise InvalidRequest(f"completion_window must be '24h'; got {window!r}", param="completion_window")
    metadata = fields.metadata(body.get("metadata"))
    meta = service.store.file(input_file_id)
    if meta is None:
        raise NotFoundError(f"no file with id {input_file_id!r}", param="input_file_id", code="file_not_found")
    if meta["purpose"] != "batch":
        raise InvalidRequest(f"file {input_file_id} has purpose {meta['purpose']!r}, not 'batch'", param="input_file_id")
    return json_response(service.create(input_file_id, endpoint, metadata))


async def list_batches() -> Response:
    batches = list(current_batches().store.batches())
    return json_response(files_api.page(batches, DEFAULT_BATCHES_LIMIT, maximum=MAX_BATCHES_LIMIT))


async def retrieve_batch(batch_id: str) -> Response:
    return json_response(_batch(batch_id))


async def cancel_batch(batch_id: str) -> Response:
    return json_response(current_batches().cancel(_batch(batch_id)))


def _batch(batch_id: str) -> dict[str, Any]:
    batch = current_batches().store.batch(batch_id)
    if batch is None:
        raise NotFoundError(f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found")
    return batch
